// The definition behind the opaque fusedar_rank handle (internal to the core).
#pragma once

#include <cstdint>
#include <vector>

#include "../kernels/large_message.h"
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
  // Opt-in cross-rank call check (call_check.cu); set before finalize.
  bool check_calls = false;
  uint64_t check_timeout_ns = 0;
  unsigned long long* check_seq = nullptr;  // device: handshakes so far on this rank
  void* check_diag = nullptr;               // pinned, device-mapped failure record (host)
  void* check_diag_device = nullptr;        // the same record's device address
  // Side streams, events and peer pointers of the large-message algorithm (from finalize).
  fusedar::kernels::large::Resources* large = nullptr;
};
