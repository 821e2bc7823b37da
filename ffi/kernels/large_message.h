// The large-message algorithm: host-side resources and the layout it uses in the workspace.
//
// For messages where FlashInfer's SM-driven kernels leave NVLink under-used (prefill sizes),
// the fused all-reduce runs as reduce-scatter + fused epilogue + all-gather, with the copy
// engines moving the bytes (docs/large_messages.md):
//
//   1. enter:   a one-block kernel on the caller's stream bumps this rank's call number and
//               meets every peer (each peer has finished its previous call, so no one still
//               reads the buffers we are about to fill).
//   2. scatter: the copy stream pushes, chunk by chunk, the rows each peer owns from our
//               input into that peer's receive slot (cudaMemcpyAsync to peer pointers); after
//               each chunk the signal stream raises a flag in the peer.
//   3. reduce:  one kernel per chunk on the caller's stream waits for the chunk's flags, sums
//               the ranks' rows in rank order (FlashInfer's allreduce_sum), keeps the sum in
//               our gather slot and applies FlashInfer's FusedOp (residual add, RMSNorm,
//               quantisation) to our own rows.
//   4. gather:  the gather stream pushes each reduced chunk into every peer's gather slot;
//               the signal stream raises a flag per chunk.
//   5. finish:  one kernel applies FusedOp to the peers' rows as their chunks arrive.
//
// Link and compute overlap because the chunks pipeline; the side streams fork from and
// join back into the caller's stream with events, so the whole call is capturable into a
// CUDA graph (XLA command buffers, torch.cuda.graphs).
//
// Per-row math is FlashInfer's two-shot kernel's, with its launch shape (block size and
// cluster), so every output is bit-identical to the two-shot path.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../core/watchdog.h"

#if defined(__CUDACC__)
#define FUSEDAR_HOST_DEVICE __host__ __device__
#else
#define FUSEDAR_HOST_DEVICE
#endif

namespace fusedar::kernels::large {

inline constexpr int kMaxRanks = 16;

// Instantiated for 16-bit inputs at world sizes 2, 4 and 8: the sizes where prefill messages
// are large (float32 inputs and 16 ranks are rare there, and each instantiation costs compile
// time for every pattern). The policy (jax_fusedar/common/launch_mode.py) never picks it
// elsewhere and the launch check refuses it.
inline bool compiled_for(int dtype_bytes, int nranks) {
  return dtype_bytes == 2 && (nranks == 2 || nranks == 4 || nranks == 8);
}
template <typename T, int NRanks>
inline constexpr bool kCompiledFor = sizeof(T) == 2 && (NRanks == 2 || NRanks == 4 || NRanks == 8);
inline constexpr const char* kNotCompiledMessage =
    "the large-message algorithm is compiled for float16/bfloat16 at world sizes 2, 4 and 8";
inline constexpr int kMaxChunks = 16;

// Flags of one rank, in its peer-mapped barrier-flags allocation (after FlashInfer's flags and
// the call-check area). `entered` holds call numbers (device-resident `seq`, so CUDA-graph
// replays advance it). The per-chunk flags are 0/1: the enter kernel clears them before it
// tells the peers it has entered, and a peer raises them only after it has seen that.
struct Flags {
  unsigned int seq;                              // this rank's call number (only it writes)
  unsigned int entered[kMaxRanks];               // peer q has entered call `value`
  unsigned int scattered[kMaxRanks][kMaxChunks]; // 1: peer q's rows of chunk k are in slot q
  unsigned int gathered[kMaxRanks][kMaxChunks];  // 1: peer q's reduced chunk k is in our slot
};

struct FlagsTable {
  Flags* rank[kMaxRanks];  // every rank's flags (peer pointers), [own rank] local
};

// What the flag waits need to bound themselves (ffi/core/watchdog.h): the rank's control
// block (timeout, failure record) and the call's signature for the record.
struct Watch {
  watchdog::Control* control;
  watchdog::CallInfo call;
};

// Streams and events of one rank, created once per workspace (not under capture).
struct Resources {
  cudaStream_t copy = nullptr;    // scatter copies
  cudaStream_t gather = nullptr;  // gather copies
  cudaStream_t signal = nullptr;  // one-block kernels that raise the peers' flags
  cudaEvent_t fork = nullptr;
  cudaEvent_t scattered[kMaxChunks] = {};
  cudaEvent_t reduced[kMaxChunks] = {};
  cudaEvent_t gathered[kMaxChunks] = {};
  cudaEvent_t copy_done = nullptr, gather_done = nullptr, signal_done = nullptr;
  FlagsTable flags{};
  char* buffers[kMaxRanks] = {};  // every rank's two-shot data buffer (peer pointers)
  watchdog::Control* control = nullptr;  // this rank's control block (device memory)
  int sm_count = 0;
};

// Chunk boundaries within one slice, as cumulative weights: the first and last chunks are
// smaller so that the pipeline fills and drains quickly (the first reduction waits for the
// first scattered chunk, the last gather follows the last reduction).
struct Schedule {
  int chunks = 1;
  int cum[kMaxChunks + 1] = {};  // cum[0] = 0, cum[chunks] = total weight
};

cudaError_t create_resources(Resources* res, int device);
// Step 1 (enter) on `stream`: a one-block kernel (large_resources.cu). It counts the call in
// the control block (the record's call number) and waits for every peer, bounded by the
// workspace's timeout.
cudaError_t launch_enter(const Resources& res, cudaStream_t stream, int rank, int nranks,
                         const Watch& watch);
// After the copies of chunk `chunk` on `stream`: raise flag `kind` (0 scattered, 1 gathered)
// in every peer.
cudaError_t launch_signal(const Resources& res, cudaStream_t stream, int rank, int nranks, int kind,
                          int chunk);
void destroy_resources(Resources* res);

// Rows of the call that rank `r` owns: FlashInfer's two-shot split (the first M % N ranks
// take one row more), so the reduction matches the two-shot kernel row for row.
FUSEDAR_HOST_DEVICE inline int64_t slice_begin(int64_t rows, int nranks, int r) {
  int64_t per = rows / nranks, extra = rows % nranks;
  return r * per + (r < extra ? r : extra);
}
FUSEDAR_HOST_DEVICE inline int64_t slice_rows(int64_t rows, int nranks, int r) {
  return rows / nranks + (r < rows % nranks ? 1 : 0);
}

// Bytes of each rank's two-shot buffer the algorithm uses: N receive slots and N gather
// slots of ceil(M/N) rows each.
inline int64_t buffer_bytes_needed(int64_t rows, int64_t hidden, int nranks, int elem_bytes) {
  int64_t slot_rows = (rows + nranks - 1) / nranks;
  return 2 * int64_t(nranks) * slot_rows * hidden * elem_bytes;
}

FUSEDAR_HOST_DEVICE inline int64_t chunk_row(int64_t slice_begin_row, int64_t slice_row_count,
                                             const Schedule& s, int k) {
  return slice_begin_row + slice_row_count * s.cum[k] / s.cum[s.chunks];
}

// Four equal chunks per slice. Measured on 2 x H200 (tools/large_message_bench.cu, CUDA-graph
// replay, bf16): 4096 x 8192 takes 259.7 us with 4 chunks, 257.4 with 2, 300.4 with 8, 454 with
// 16, and weighted schedules with small first and last chunks were slower: every chunk adds
// copy-engine and cross-stream latency that outweighs the finer overlap.
inline constexpr int kDefaultChunks = 4;

inline Schedule make_schedule(const int* weights, int n);

inline Schedule default_schedule(int64_t rows, int nranks) {
  int64_t per_rank = rows / nranks;
  int chunks = per_rank < kDefaultChunks ? int(per_rank < 1 ? 1 : per_rank) : kDefaultChunks;
  int ones[kMaxChunks];
  for (int k = 0; k < chunks; ++k) ones[k] = 1;
  return make_schedule(ones, chunks);
}

inline Schedule make_schedule(const int* weights, int n) {
  Schedule s;
  s.chunks = n < 1 ? 1 : (n > kMaxChunks ? kMaxChunks : n);
  for (int k = 0; k < s.chunks; ++k) s.cum[k + 1] = s.cum[k] + (n < 1 ? 1 : weights[k]);
  return s;
}

}  // namespace fusedar::kernels::large
