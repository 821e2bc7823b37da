// Bounded waits for FlashInfer's kernels: the device side of ffi/core/watchdog.h.
//
// Included before trtllm_allreduce_fusion.cuh and trtllm_moe_allreduce_fusion.cuh, whose
// wait loops the build patches (ffi/cmake/FlashInferHeaders.cmake) into calls of what is
// defined here:
//   - the one-shot Lamport polls get FUSEDAR_WAIT_STATE / FUSEDAR_WAIT_LAMPORT_TICK (dense)
//     or FUSEDAR_MOE_WAIT_LAMPORT_TICK (MoE patterns 6 and 7),
//   - the two-shot barrier and the grid-counter waits become fusedar_wait::spin(...),
//   - the comm constructors count calls (block 0, fusedar_wait::count_call).
// The large-message algorithm's flag waits use spin(...) too (large_sync.cuh wait_for).
// The hot path gains a counter increment and a branch taken once every kCheckEvery spins;
// only then is the clock read, and only past the timeout is the call described (from the
// kernel's params, by reference, so nothing is copied on the hot path) and the record
// written. The slow path makes no function call (see fail()). Nothing here touches the
// data the kernel sums, so outputs stay bit-identical.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#include <utility>

#include "../core/watchdog.h"

namespace fusedar_wait {

namespace wd = fusedar::watchdog;

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The element type of AllReduceFusionParams<T> (declared after this header).
template <template <class> class P, class T>
T element_of(const P<T>&);

template <class T>
__host__ __device__ __forceinline__ constexpr unsigned dtype_code() {
  if constexpr (std::is_same_v<T, float>)
    return 0;       // FUSEDAR_FLOAT32
  else if constexpr (std::is_same_v<T, half>)
    return 1;   // FUSEDAR_FLOAT16
  else
    return 2;                                          // FUSEDAR_BFLOAT16
}

using CallInfo = wd::CallInfo;

// The call's signature from the kernel's params and the compile-time choices, bit for bit
// as call_check::signature_of builds it from the launch arguments (the record's text
// decodes it). Host and device: the large-message launcher computes it once per call.
template <class T, class Params>
__host__ __device__ __forceinline__ CallInfo call_info(const Params& p, bool one_shot,
                                                       bool fp32_acc, bool large_message) {
  CallInfo c;
  c.sig[0] =
      (static_cast<unsigned long long>(p.pattern) & 0xff) |
      (static_cast<unsigned long long>(dtype_code<T>()) << 8) |
      (static_cast<unsigned long long>(one_shot ? 1 : 0) << 16) |
      (static_cast<unsigned long long>(fp32_acc ? 1 : 0) << 17) |
      (static_cast<unsigned long long>(large_message ? 1 : 0) << 18) |
      ((static_cast<unsigned long long>(p.layout) & 0xff) << 24) |
      (static_cast<unsigned long long>(static_cast<unsigned>(p.block_quant_group_size)) << 32);
  c.sig[1] = static_cast<unsigned long long>(p.size / p.hidden_dim);
  c.sig[2] = static_cast<unsigned long long>(p.hidden_dim);
  return c;
}

// What a wait site knows about its call: the kernel's params (a reference to the kernel
// parameter, as FlashInfer's FusedOp holds it) and the compile-time choices.
template <bool Fp32Acc, bool OneShot, class Params>
struct Ctx {
  const Params& p;
  __device__ __forceinline__ wd::Control* control() const {
    return static_cast<wd::Control*>(p.workspace[3 * p.nranks]);
  }
  __device__ __forceinline__ CallInfo info() const {
    using T = decltype(element_of(std::declval<Params>()));
    return call_info<T>(p, OneShot, Fp32Acc, false);
  }
};

// The same for FlashInfer's MoE kernels, whose params carry no pattern: pattern 7's
// (MoeFinalizeAllReduceFusionParams) has `top_k`, pattern 6's has not. The signature is the
// one the call check gives an MoE call (ffi/core/moe_launch.cpp): pattern, dtype, one-shot
// (the MoE kernels have no other mode), no fp32_acc, layout or block-quant group.
template <class P, class = void>
struct is_moe_finalize : std::false_type {};
template <class P>
struct is_moe_finalize<P, std::void_t<decltype(std::declval<const P&>().top_k)>> : std::true_type {
};

template <class Params>
struct MoeCtx {
  static constexpr bool kFinalize = is_moe_finalize<Params>::value;
  const Params& p;
  __device__ __forceinline__ wd::Control* control() const {
    return static_cast<wd::Control*>(p.workspace[3 * p.nranks]);
  }
  __device__ __forceinline__ CallInfo info() const {
    using T = decltype(element_of(std::declval<Params>()));
    CallInfo c;
    c.sig[0] = static_cast<unsigned long long>(kFinalize ? 7 : 6) |
               (static_cast<unsigned long long>(dtype_code<T>()) << 8) | (1ull << 16);
    c.sig[1] = static_cast<unsigned long long>(p.size / p.hidden_dim);
    c.sig[2] = static_cast<unsigned long long>(p.hidden_dim);
    return c;
  }
  // Both MoE kernels poll this rank's own Lamport buffer, as the dense kernel does (pattern
  // 7 after the build's fix of FlashInfer's peer-buffer race, ffi/cmake/FlashInferHeaders.cmake).
  static constexpr int kLamportSite = wd::kLamport;
};

// Starts the clock on its first call (t0 == 0) and says whether the workspace's timeout
// has passed since; never with a zero timeout (FlashInfer's wait-forever behaviour).
__device__ __forceinline__ bool expired(wd::Control* c, unsigned long long& t0) {
  const unsigned long long timeout =
      *reinterpret_cast<volatile unsigned long long*>(&c->timeout_ns);
  if (timeout == 0) return false;
  const unsigned long long now = now_ns();
  if (t0 == 0) {
    t0 = now;
    return false;
  }
  return now - t0 > timeout;
}

// The first thread past the timeout claims the record, fills it and traps; every other
// thread returns and keeps waiting until the trap ends the kernel (a second trap before
// the record is complete could lose it). Inlined and free of calls (no printf, no
// __noinline__): an ABI call in the kernel, even on this cold path, made ptxas keep
// values live across it and doubled the one-shot kernel's registers (56 -> 108, measured),
// which cost occupancy and ~40% at 1024-4096 tokens x 8192. The host reads the record
// (fusedar_rank_failure) and raises it.
__device__ __forceinline__ void fail(wd::Control* c, const CallInfo& info, int site, int peer,
                                     int detail, unsigned long long t0) {
  if (atomicCAS(&c->claimed, 0, 1) != 0) return;
  volatile wd::Record* d = c->record;
  d->rank = c->rank;
  d->world = c->world;
  d->device = c->device;
  d->peer = peer;
  d->failing_peers = 1;
  d->site = site;
  d->detail = detail;
  d->seq = *reinterpret_cast<volatile unsigned long long*>(&c->calls);
  d->peer_seq = 0;
  for (int i = 0; i < 3; ++i) {
    d->mine[i] = info.sig[i];
    d->theirs[i] = 0;
  }
  d->waited_ns = now_ns() - t0;
  d->timeout_ns = *reinterpret_cast<volatile unsigned long long*>(&c->timeout_ns);
  __threadfence_system();
  d->kind = wd::kWaitTimeout;
  __threadfence_system();
  __trap();
}

// `while (cond()) {}` with the clock checked every kCheckEvery spins.
template <class C, class Cond>
__device__ __forceinline__ void spin(const C& ctx, int site, int peer, int detail, Cond cond) {
  unsigned spins = 0;
  unsigned long long t0 = 0;
  while (cond()) {
    if (++spins == wd::kCheckEvery) {
      spins = 0;
      wd::Control* c = ctx.control();
      if (expired(c, t0)) fail(c, ctx.info(), site, peer, detail, t0);
    }
  }
}

// Block 0 counts the fused kernels started on this rank: the call number in the record.
__device__ __forceinline__ void count_call(int* counter_ptr) {
  if (blockIdx.x == 0) atomicAdd(&reinterpret_cast<wd::Control*>(counter_ptr)->calls, 1ull);
}

}  // namespace fusedar_wait

// Used inside FlashInfer's kernels, where `params` and `Fp32Acc` are in scope.
#define FUSEDAR_WAIT_CTX(oneshot) (::fusedar_wait::Ctx<Fp32Acc, oneshot, decltype(params)>{params})

#define FUSEDAR_WAIT_STATE    \
  unsigned fusedar_spins = 0; \
  unsigned long long fusedar_t0 = 0;

// At the end of one Lamport poll: the peer still missing is the first whose slot still
// holds the -0.0 sentinel (vals[r] is what rank r delivered to this call). `ctx` is the
// call's context (Ctx or MoeCtx), `site` the watchdog::Site of the poll.
#define FUSEDAR_WAIT_LAMPORT_TICK_AT(ctx, site)                                                  \
  if (!done && ++fusedar_spins == ::fusedar::watchdog::kCheckEvery) {                            \
    fusedar_spins = 0;                                                                           \
    const auto fusedar_ctx = ctx;                                                                \
    ::fusedar::watchdog::Control* fusedar_c = fusedar_ctx.control();                             \
    if (::fusedar_wait::expired(fusedar_c, fusedar_t0)) {                                        \
      int fusedar_peer = -1;                                                                     \
      _Pragma("unroll") for (int fusedar_r = NRanks - 1; fusedar_r >= 0; --fusedar_r) {          \
        if (has_neg_zero<T, VEC_SIZE>(vals[fusedar_r])) fusedar_peer = fusedar_r;                \
      }                                                                                          \
      ::fusedar_wait::fail(fusedar_c, fusedar_ctx.info(), site, fusedar_peer, tidx, fusedar_t0); \
    }                                                                                            \
  }

// The dense one-shot kernel (this rank's Lamport buffer).
#define FUSEDAR_WAIT_LAMPORT_TICK \
  FUSEDAR_WAIT_LAMPORT_TICK_AT(FUSEDAR_WAIT_CTX(true), ::fusedar::watchdog::kLamport)

// Used inside FlashInfer's MoE kernels, where `params` is in scope.
#define FUSEDAR_MOE_WAIT_CTX (::fusedar_wait::MoeCtx<decltype(params)>{params})

// The MoE kernels (patterns 6 and 7): the site follows the kernel (MoeCtx::kLamportSite).
#define FUSEDAR_MOE_WAIT_LAMPORT_TICK \
  FUSEDAR_WAIT_LAMPORT_TICK_AT(FUSEDAR_MOE_WAIT_CTX, decltype(FUSEDAR_MOE_WAIT_CTX)::kLamportSite)
