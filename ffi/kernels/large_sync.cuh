// Cross-GPU flag helpers of the large-message algorithm (system-scope acquire/release).
#pragma once

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
__device__ __forceinline__ void wait_for(const unsigned int* flag, unsigned int target) {
  while (!reached(load_acquire_sys(flag), target)) {
  }
}

}  // namespace fusedar::kernels::large
