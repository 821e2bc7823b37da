// FlashInfer's launch geometry for the hooked kernels.
//
// FlashInfer's launcher derives the block size and cluster size from the kernel's
// register count (max threads per block = min(65536 / registers, 1024); it doubles the
// block and halves the cluster while the block stays at most half that maximum). The
// block/cluster split decides how RMSNorm's sum of squares is reduced, so a different
// split gives different output bits. The bounded waits (wait_hooks.cuh) change each
// kernel's register count by a few registers, which would move many kernels to another
// split. Two patches of the header (ffi/cmake/FlashInferHeaders.cmake) prevent that:
//   - get_registers_per_thread_{oneshot,twoshot}() return the register count of the
//     UNHOOKED kernel (registers_for_geometry), so the launcher computes exactly the
//     geometry FlashInfer's own build computes;
//   - each hooked kernel is compiled with __maxnreg__(register_cap), the unhooked count
//     rounded up to the hardware's allocation unit, so it occupies no more registers per
//     thread than the unhooked kernel and every block size the launcher picks still fits.
// The unhooked counts come from the build: tools/launch_registers.py probe takes them from
// ffi/core/unhooked_registers.json when it holds them for exactly this input, else compiles
// every kernel once more from FlashInfer's header without the hooks, and writes the counts
// into a header per translation unit (unhooked_registers_<dtype>_n<ranks>.h), included
// before this one. tools/launch_registers.py check verifies a built library against them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#ifndef FUSEDAR_UNHOOKED_REGISTERS_INCLUDED
#error \
    "include the generated unhooked_registers_<dtype>_n<ranks>.h first (see ffi/kernels/instance.cu.in)"
#endif

namespace fusedar_geometry {

// Which kernel of a (pattern, dtype, world size, accumulation) instance: the indices of the
// generated table's second dimension.
enum Kind : int { kOneShotNoTrigger = 0, kOneShotTrigger = 1, kTwoShot = 2 };

// Registers are allocated per warp in units of 256, i.e. 8 per thread, at most 255.
inline constexpr int kRegisterAllocationUnit = 8;
inline constexpr int kMaxRegistersPerThread = 255;

template <class T>
constexpr int dtype_code() {
  if constexpr (std::is_same_v<T, float>)
    return 0;
  else if constexpr (std::is_same_v<T, half>)
    return 1;
  else
    return 2;
}

// The unhooked kernel's registers per thread on `arch` (major * 10 + minor), 0 where this
// build has no kernel for that architecture.
template <int K, auto Pattern, class T, int NRanks, bool Fp32Acc>
constexpr int unhooked_registers(int arch) {
  static_assert(dtype_code<T>() == unhooked::kDtype && NRanks == unhooked::kNRanks,
                "a translation unit may only instantiate the kernels its generated table covers");
  for (int i = 0; i < unhooked::kNumArchs; ++i) {
    if (unhooked::kArchs[i] == arch) {
      return unhooked::kRegisters[i][K][static_cast<int>(Pattern)][Fp32Acc ? 1 : 0];
    }
  }
  return 0;
}

// The __maxnreg__ bound of a hooked kernel for the architecture being compiled.
template <int K, auto Pattern, class T, int NRanks, bool Fp32Acc>
constexpr int register_cap() {
#if defined(__CUDA_ARCH__)
  constexpr int regs = unhooked_registers<K, Pattern, T, NRanks, Fp32Acc>(__CUDA_ARCH__ / 10);
  static_assert(regs > 0, "no unhooked register count for this kernel on this architecture");
  constexpr int allocated =
      (regs + kRegisterAllocationUnit - 1) / kRegisterAllocationUnit * kRegisterAllocationUnit;
  return allocated < kMaxRegistersPerThread ? allocated : kMaxRegistersPerThread;
#else
  return kMaxRegistersPerThread;  // host pass: the bound only matters to device code
#endif
}

// What FlashInfer's launcher reads as the kernel's register count (it asks
// cudaFuncGetAttributes): the unhooked kernel's count on the current device.
template <int K, auto Pattern, class T, int NRanks, bool Fp32Acc>
int registers_for_geometry(const void* kernel) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess) {
    const int regs = unhooked_registers<K, Pattern, T, NRanks, Fp32Acc>(major * 10 + minor);
    if (regs > 0) return regs;
  }
  // No kernel of this build runs on this device (the launch itself will fail with
  // "no kernel image"): answer as FlashInfer does.
  cudaFuncAttributes attr{};
  cudaFuncGetAttributes(&attr, kernel);
  return attr.numRegs;
}

}  // namespace fusedar_geometry
