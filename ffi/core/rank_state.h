// The definition behind the opaque fusedar_rank handle (internal to the core).
#pragma once

#include <vector>

#include "fusedar/core.h"

struct fusedar_peer {
  void* ptr[FUSEDAR_SHARED_BUFFERS] = {};
  bool ipc[FUSEDAR_SHARED_BUFFERS] = {};  // opened with cudaIpcOpenMemHandle: close on destroy
  bool known = false;
};

struct fusedar_rank {
  int device = -1;
  int rank = -1;
  fusedar_workspace_info info{};
  void* local[FUSEDAR_SHARED_BUFFERS] = {};  // this rank's own shared buffers
  int* control = nullptr;                    // local 5-int control block
  void** table = nullptr;                    // device copy of the 3N+1 pointer table
  std::vector<fusedar_peer> peers;           // indexed by TP rank; peers[rank] is us
};
