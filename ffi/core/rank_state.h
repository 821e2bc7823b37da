// The definition behind the opaque fusedar_rank handle (internal to the core).
#pragma once

#include <cstdint>
#include <vector>

#include "../kernels/large_message.h"
#include "fusedar/core.h"
#include "watchdog.h"

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
  // Local control block, workspace[3N]: FlashInfer's 5 ints, then the bounded-wait
  // settings the kernel reads (watchdog.h).
  fusedar::watchdog::Control* control = nullptr;
  void** table = nullptr;                    // device copy of the 3N+1 pointer table
  std::vector<fusedar_peer> peers;           // indexed by TP rank; peers[rank] is us
  // Opt-in cross-rank handshake (handshake.cu); set before finalize.
  bool handshake = false;
  uint64_t handshake_timeout_ns = 0;
  unsigned long long* check_seq = nullptr;  // device: handshakes so far on this rank
  // Bounded waits (watchdog.h): the kernel's timeout (0: wait forever) and the one failure
  // record, written by a timed-out wait of the kernel or a failed handshake.
  uint64_t timeout_ns = fusedar::watchdog::kDefaultTimeoutNs;
  void* record = nullptr;         // pinned, device-mapped watchdog::Record (host address)
  void* record_device = nullptr;  // the same record's device address
  // Side streams, events and peer pointers of the large-message algorithm (from finalize).
  fusedar::kernels::large::Resources* large = nullptr;
};
