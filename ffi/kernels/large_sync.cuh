// Cross-GPU flag helpers of the large-message algorithm (system-scope acquire/release).
#pragma once

#include "large_message.h"
#include "wait_hooks.cuh"

namespace fusedar::kernels::large {

__device__ __forceinline__ unsigned int load_acquire_sys(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_sys(unsigned int* p, unsigned int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Call numbers wrap after 2^32 calls; compare by signed difference.
__device__ __forceinline__ bool reached(unsigned int value, unsigned int target) {
  return static_cast<int>(value - target) >= 0;
}

// The shape fusedar_wait::spin expects of its context.
struct WaitCtx {
  const Watch& w;
  __device__ __forceinline__ watchdog::Control* control() const { return w.control; }
  __device__ __forceinline__ watchdog::CallInfo info() const { return w.call; }
};

// Spins until `flag` reaches `target` (peer `peer` raised it), bounded like FlashInfer's
// waits (ffi/kernels/wait_hooks.cuh): past the workspace's timeout the record names `site`,
// `peer` and `detail`, and the kernel traps. Only the flag is read: no data is touched.
__device__ __forceinline__ void wait_for(const Watch& watch, int site, int peer, int detail,
                                         const unsigned int* flag, unsigned int target) {
  fusedar_wait::spin(WaitCtx{watch}, site, peer, detail,
                     [&] { return !reached(load_acquire_sys(flag), target); });
}

}  // namespace fusedar::kernels::large
