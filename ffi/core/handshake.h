// Opt-in cross-rank handshake (internal to the core; the C API is in fusedar/core.h).
//
// FlashInfer's kernel spins until every peer has taken part in the same call; ranks that
// call with different shapes, patterns or one-shot choices never finish. With the check
// on, fusedar_launch first runs a one-block handshake kernel on the same stream:
//
//   seq = ++counter                          (device-resident: CUDA-graph replays advance it)
//   for every rank p: peer p's area, bank seq%2, slot[me] = {seq, signature}
//                                            (signature first, then seq with a
//                                             system-scope release store)
//   for every rank p: wait until own area, bank seq%2, slot[p].seq == seq
//                                            (acquire loads), then compare signatures;
//   mismatch, timeout (%globaltimer) or a rank ahead by two -> printf + record + __trap()
//   (the workspace's failure record, watchdog.h, shared with the kernel's bounded waits).
//
// The area sits in the barrier-flags allocation after FlashInfer's flags (which are left
// as they are), so it is peer-mapped already and zeroed at finalize. It is allocated for
// every workspace, checked or not, so that a peer with the check on never writes outside
// the allocation of a rank with it off (that rank never answers: the peer times out).
//
// Two banks by call parity make slot reuse safe: a peer can start its handshake of call
// k+2 (which writes bank k%2 again) only after finishing call k+1, which needs our slot of
// call k+1, which we write only after our handshake of call k (and every read of bank k%2)
// has finished: same stream, and the handshake is launched without PDL, so it starts after
// the previous fused kernel has completed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "fusedar/core.h"
#include "rank_state.h"
#include "watchdog.h"

namespace fusedar::handshake {

constexpr int64_t kSlotBytes = 32;  // {seq, word, num_tokens, hidden_dim}, 8 bytes each
constexpr int64_t kBanks = 2;
constexpr int kMaxWorld = 16;

// Byte offset of the handshake area in each rank's barrier-flags allocation.
inline int64_t area_offset(const fusedar_workspace_info& info) {
  return (info.flag_bytes + 255) / 256 * 256;
}
inline int64_t area_bytes(int world_size) { return kBanks * world_size * kSlotBytes; }
// What the barrier-flags allocation holds: FlashInfer's flags, then the handshake area.
inline int64_t flag_allocation_bytes(const fusedar_workspace_info& info) {
  return area_offset(info) + area_bytes(info.world_size);
}

// Everything ranks must agree on, exactly (no hash: the failure message decodes it).
struct Signature {
  unsigned long long word;  // pattern | dtype << 8 | oneshot << 16 | fp32_acc << 17 |
                            // large_message << 18 |
                            // layout << 24 | block_quant_group_size << 32
  unsigned long long num_tokens;
  unsigned long long hidden_dim;
};

Signature signature_of(const fusedar_launch_args& a);

// Failures are recorded in the workspace's one failure record (watchdog::Record), which
// the kernel's own bounded waits share: kinds kMismatch, kTimeout, kOutOfStep.
using watchdog::kMismatch;
using watchdog::kNone;
using watchdog::kOutOfStep;
using watchdog::kTimeout;
using watchdog::Record;

// Allocates the counter (once) and records the settings.
int enable(fusedar_rank* r, bool enabled, double timeout_s);
// Zeroes the counter (from finalize; the area is zeroed with the flags).
cudaError_t reset(fusedar_rank* r);
void release(fusedar_rank* r, std::string* first_error);
// Launches the handshake on `stream` (the rank's device must be current).
cudaError_t launch(const fusedar_rank* r, const fusedar_launch_args& a, cudaStream_t stream);
// "" when no wait of this rank (handshake or fused kernel) timed out or failed the check,
// else the description. Reads pinned host memory only: works after the trap.
std::string failure(const fusedar_rank* r);

}  // namespace fusedar::handshake
