// Kernels and launch sequence of the large-message algorithm (see large_message.h).
//
// Included after FlashInfer's header: the per-row math reuses its allreduce_sum and FusedOp,
// and the launch shape (threads per block, cluster size) is computed exactly as its two-shot
// launcher does, so that the RMSNorm block reduction, and so every output bit, is the same.
#pragma once

#include <algorithm>
#include <array>
#include <string>

#include "flashinfer_kernel.cuh"
#include "large_message.h"
#include "large_sync.cuh"

namespace fusedar::kernels::large {

namespace fi = flashinfer::trtllm_allreduce_fusion;
using flashinfer::vec_t;

template <typename T>
struct RowArgs {
  FlagsTable flags;
  Watch watch;                // bounds the flag waits (control block, call signature)
  int rank;
  int nranks;
  Schedule schedule;
  int chunk;                  // reduce: which chunk of our slice
  int64_t rows;               // M
  const T* recv[kMaxRanks];   // our receive slot of each peer ([rank]: unused)
  T* sum[kMaxRanks];          // our gather slot of each rank's slice ([rank]: our own sums)
};

struct RowIndex {
  int token;   // first row handled by this cluster, relative to a range
  int access;  // this thread's 16-byte access within a row
  int stride;  // clusters in the grid
};

__device__ __forceinline__ RowIndex row_index() {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cg::grid_group grid = cg::this_grid();
  return RowIndex{static_cast<int>(grid.cluster_rank()), static_cast<int>(cluster.thread_rank()),
                  static_cast<int>(grid.num_clusters())};
}

// Step 3: reduce one chunk of our slice, keep the sum for the gather, apply the epilogue.
template <fi::AllReduceFusionPattern Pattern, typename T, int NRanks, bool Fp32Acc>
__global__ void __launch_bounds__(1024)
    reduce_chunk_kernel(fi::AllReduceFusionParams<T> params, RowArgs<T> a) {
  static constexpr int VEC = fi::details::kBytesPerAccess / sizeof(T);
  const int rank = a.rank;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int q = 0; q < NRanks; ++q) {
      if (q != rank) {
        wait_for(a.watch, watchdog::kLargeScatter, q, a.chunk,
                 &a.flags.rank[rank]->scattered[q][a.chunk], 1u);
      }
    }
  }
  __syncthreads();
  const RowIndex ix = row_index();
  const int vec_per_row = params.hidden_dim / VEC;
  const int64_t sb = slice_begin(a.rows, NRanks, rank), sr = slice_rows(a.rows, NRanks, rank);
  const int64_t begin = chunk_row(sb, sr, a.schedule, a.chunk);
  const int64_t end = chunk_row(sb, sr, a.schedule, a.chunk + 1);
  // Row 0's access is always in bounds; update() moves to the row actually handled.
  fi::FusedOp<Pattern, T> fused_op(params, ix.access, ix.access);
  for (int64_t row = begin + ix.token; row < end; row += ix.stride) {
    const int64_t idx = row * vec_per_row + ix.access;
    const int64_t local = (row - sb) * vec_per_row + ix.access;
    vec_t<T, VEC> vals[NRanks];
#pragma unroll
    for (int r = 0; r < NRanks; ++r) {
      if (r == rank) {
        vals[r].load(reinterpret_cast<const T*>(params.allreduce_in) + idx * VEC);
      } else {
        vals[r].load(a.recv[r] + local * VEC);
      }
    }
    vec_t<T, VEC> s = fi::allreduce_sum<T, VEC, NRanks, Fp32Acc>(vals);
    s.store(a.sum[rank] + local * VEC);
    fused_op.update(static_cast<int>(idx));
    fused_op(s, static_cast<int>(row));
  }
}

// Step 5: the epilogue for the peers' rows, chunk by chunk as their sums arrive.
template <fi::AllReduceFusionPattern Pattern, typename T, int NRanks, bool Fp32Acc>
__global__ void __launch_bounds__(1024)
    finish_kernel(fi::AllReduceFusionParams<T> params, RowArgs<T> a) {
  static constexpr int VEC = fi::details::kBytesPerAccess / sizeof(T);
  const int rank = a.rank;
  const RowIndex ix = row_index();
  const int vec_per_row = params.hidden_dim / VEC;
  fi::FusedOp<Pattern, T> fused_op(params, ix.access, ix.access);
  for (int k = 0; k < a.schedule.chunks; ++k) {
    for (int j = 1; j < NRanks; ++j) {
      const int q = (rank + j) % NRanks;
      if (threadIdx.x == 0) {
        wait_for(a.watch, watchdog::kLargeGather, q, k, &a.flags.rank[rank]->gathered[q][k], 1u);
      }
      __syncthreads();
      const int64_t sb = slice_begin(a.rows, NRanks, q), sr = slice_rows(a.rows, NRanks, q);
      const int64_t begin = chunk_row(sb, sr, a.schedule, k);
      const int64_t end = chunk_row(sb, sr, a.schedule, k + 1);
      for (int64_t row = begin + ix.token; row < end; row += ix.stride) {
        const int64_t idx = row * vec_per_row + ix.access;
        const int64_t local = (row - sb) * vec_per_row + ix.access;
        vec_t<T, VEC> s;
        s.load(a.sum[q] + local * VEC);
        fused_op.update(static_cast<int>(idx));
        fused_op(s, static_cast<int>(row));
      }
    }
  }
}

// FlashInfer's two-shot launch shape for this call (the launcher's own computation, minus the
// FP4 special case, which has no two-shot-specific part): the RMSNorm's block reduction
// depends on it, so matching it makes norm_out bit-identical to the two-shot path.
struct Shape {
  int block = 0;
  int cluster = 0;
  int grid_limit = 0;  // clusters that may be resident while leaving SMs for the flag kernels
  size_t smem = 0;
};

template <fi::AllReduceFusionPattern Pattern, typename T, int NRanks, bool Fp32Acc>
Shape twoshot_shape(const fi::AllReduceFusionParams<T>& p, int sm_count) {
  static constexpr int VEC = fi::details::kBytesPerAccess / sizeof(T);
  const int tokens = p.size / p.hidden_dim;
  const int cluster_num = tokens / NRanks + (tokens % NRanks ? 1 : 0);
  const int threads_per_token = p.hidden_dim / VEC;
  static const int max_cluster_size = flashinfer::GetMaxClusterSize(
      reinterpret_cast<void const*>(
          fi::allreduce_fusion_kernel_oneshot_lamport<Pattern, T, NRanks, Fp32Acc>),
      128);
  int cluster = std::min(8, max_cluster_size);
  while (threads_per_token % cluster != 0 && cluster > 1) cluster /= 2;
  int tpb = threads_per_token / cluster;
  while (tpb < 128 && cluster >= 2) {
    tpb *= 2;
    cluster /= 2;
  }
  static const int regs = fi::get_registers_per_thread_twoshot<Pattern, T, NRanks, Fp32Acc>();
  static const int max_registers = fi::utils::getSMRegisters();
  const int max_tpb = std::min(max_registers / regs, 1024);
  while (cluster_num * cluster > sm_count && cluster > 1 && tpb <= max_tpb / 2) {
    tpb *= 2;
    cluster /= 2;
  }
  Shape s;
  if constexpr (fi::GetQuantType<Pattern> == fi::QuantType::kPerTokenGroupFP8Packed) {
    while (cluster > 1 && (tpb * VEC) % p.block_quant_group_size != 0) {
      tpb *= 2;
      cluster /= 2;
    }
    s.smem = size_t(tpb) * VEC / p.block_quant_group_size * sizeof(unsigned int);
  }
  s.block = tpb;
  s.cluster = cluster;
  // Our kernels wait on flags raised by the signal kernels of this and the peer GPU: keep a
  // few SMs free so that those one-block kernels always find room.
  s.grid_limit = std::max(1, (sm_count - 8) / cluster);
  return s;
}

template <typename Kernel, typename T>
cudaError_t launch_rows(Kernel kernel, const Shape& s, int clusters, cudaStream_t stream,
                        const fi::AllReduceFusionParams<T>& params, const RowArgs<T>& a) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3(clusters * s.cluster);
  cfg.blockDim = dim3(s.block);
  cfg.dynamicSmemBytes = s.smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = s.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, params, a);
}

#define FUSEDAR_LARGE_TRY(expr)                           \
  do {                                                    \
    cudaError_t fusedar_err_ = (expr);                    \
    if (fusedar_err_ != cudaSuccess) return fusedar_err_; \
  } while (0)

// Enqueues the whole call on `stream` (forking to and joining back from the side streams).
template <fi::AllReduceFusionPattern Pattern, typename T, int NRanks, bool Fp32Acc>
cudaError_t launch_large(const fi::AllReduceFusionParams<T>& params, const Resources& res,
                         const Schedule& sched) {
  const int rank = params.rank;
  const int64_t H = params.hidden_dim;
  const int64_t M = params.size / params.hidden_dim;
  const int64_t row_bytes = H * int64_t(sizeof(T));
  const int64_t slot_rows = (M + NRanks - 1) / NRanks;
  const int64_t slot_bytes = slot_rows * row_bytes;
  const int chunks = sched.chunks;
  cudaStream_t s = params.stream;
  const char* input = static_cast<const char*>(params.allreduce_in);
  // Slot q of rank p's buffer: [q] receive rows of p's slice sent by q, [N + q] q's sums.
  auto recv_slot = [&](int p, int q) { return res.buffers[p] + q * slot_bytes; };
  auto sum_slot = [&](int p, int q) { return res.buffers[p] + (NRanks + q) * slot_bytes; };

  RowArgs<T> a{};
  a.flags = res.flags;
  a.watch.control = res.control;
  a.watch.call = fusedar_wait::call_info<T>(params, false, Fp32Acc, true);
  a.rank = rank;
  a.nranks = NRanks;
  a.schedule = sched;
  a.rows = M;
  for (int q = 0; q < NRanks; ++q) {
    a.recv[q] = reinterpret_cast<const T*>(recv_slot(rank, q));
    a.sum[q] = reinterpret_cast<T*>(sum_slot(rank, q));
  }
  const Shape shape = twoshot_shape<Pattern, T, NRanks, Fp32Acc>(params, res.sm_count);

  FUSEDAR_LARGE_TRY(launch_enter(res, s, rank, NRanks, a.watch));
  FUSEDAR_LARGE_TRY(cudaEventRecord(res.fork, s));
  FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(res.copy, res.fork, 0));
  FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(res.gather, res.fork, 0));
  FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(res.signal, res.fork, 0));

  // 2. Scatter: chunk k of every peer's slice, peers in a rotating order so that at more
  // than two ranks each link starts busy.
  for (int k = 0; k < chunks; ++k) {
    for (int j = 1; j < NRanks; ++j) {
      const int p = (rank + j) % NRanks;
      const int64_t sb = slice_begin(M, NRanks, p), sr = slice_rows(M, NRanks, p);
      const int64_t b = chunk_row(sb, sr, sched, k), e = chunk_row(sb, sr, sched, k + 1);
      if (e > b) {
        FUSEDAR_LARGE_TRY(cudaMemcpyAsync(recv_slot(p, rank) + (b - sb) * row_bytes,
                                          input + b * row_bytes, (e - b) * row_bytes,
                                          cudaMemcpyDeviceToDevice, res.copy));
      }
    }
    // The flag goes out from the signal stream so that the copy stream never idles behind a
    // kernel launch between two copies.
    FUSEDAR_LARGE_TRY(cudaEventRecord(res.scattered[k], res.copy));
    FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(res.signal, res.scattered[k], 0));
    FUSEDAR_LARGE_TRY(launch_signal(res, res.signal, rank, NRanks, 0, k));
  }

  // 3. Reduce our slice chunk by chunk; 4. push each reduced chunk to every peer.
  const int64_t own_begin = slice_begin(M, NRanks, rank), own_rows = slice_rows(M, NRanks, rank);
  for (int k = 0; k < chunks; ++k) {
    a.chunk = k;
    const int64_t b = chunk_row(own_begin, own_rows, sched, k);
    const int64_t e = chunk_row(own_begin, own_rows, sched, k + 1);
    const int clusters =
        static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(e - b, shape.grid_limit)));
    FUSEDAR_LARGE_TRY(launch_rows(reduce_chunk_kernel<Pattern, T, NRanks, Fp32Acc>, shape, clusters,
                                  s, params, a));
    FUSEDAR_LARGE_TRY(cudaEventRecord(res.reduced[k], s));
    FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(res.gather, res.reduced[k], 0));
    for (int j = 1; j < NRanks; ++j) {
      const int p = (rank + j) % NRanks;
      if (e > b) {
        FUSEDAR_LARGE_TRY(cudaMemcpyAsync(sum_slot(p, rank) + (b - own_begin) * row_bytes,
                                          sum_slot(rank, rank) + (b - own_begin) * row_bytes,
                                          (e - b) * row_bytes, cudaMemcpyDeviceToDevice,
                                          res.gather));
      }
    }
    FUSEDAR_LARGE_TRY(cudaEventRecord(res.gathered[k], res.gather));
  }
  for (int k = 0; k < chunks; ++k) {
    FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(res.signal, res.gathered[k], 0));
    FUSEDAR_LARGE_TRY(launch_signal(res, res.signal, rank, NRanks, 1, k));
  }

  // 5. The peers' rows.
  int64_t peer_rows_per_chunk = 0;
  for (int q = 0; q < NRanks; ++q) {
    if (q != rank) {
      const int64_t sb = slice_begin(M, NRanks, q), sr = slice_rows(M, NRanks, q);
      for (int k = 0; k < chunks; ++k) {
        peer_rows_per_chunk = std::max(
            peer_rows_per_chunk, chunk_row(sb, sr, sched, k + 1) - chunk_row(sb, sr, sched, k));
      }
    }
  }
  const int clusters = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(peer_rows_per_chunk, shape.grid_limit)));
  FUSEDAR_LARGE_TRY(
      launch_rows(finish_kernel<Pattern, T, NRanks, Fp32Acc>, shape, clusters, s, params, a));

  // Join: the call ends on `stream` only when every copy and flag store has completed.
  FUSEDAR_LARGE_TRY(cudaEventRecord(res.copy_done, res.copy));
  FUSEDAR_LARGE_TRY(cudaEventRecord(res.gather_done, res.gather));
  FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(s, res.copy_done, 0));
  FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(s, res.gather_done, 0));
  FUSEDAR_LARGE_TRY(cudaEventRecord(res.signal_done, res.signal));
  FUSEDAR_LARGE_TRY(cudaStreamWaitEvent(s, res.signal_done, 0));
  return cudaSuccess;
}

#undef FUSEDAR_LARGE_TRY

}  // namespace fusedar::kernels::large
