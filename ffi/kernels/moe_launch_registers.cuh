// The MoE kernels (patterns 6, 7) with bounded waits occupy no more registers than
// FlashInfer's own.
//
// Unlike the dense launcher (launch_registers.cuh), FlashInfer's MoE launchers read no
// register count: the block size follows hidden_dim and the cluster size a 128-thread
// occupancy query that no register count lowers below 8. But the hooks (wait_hooks.cuh)
// raise the kernels' register counts (sm_90a, f16 x 16 ranks: pattern 7 158 -> 174), and a
// block that fits the unhooked count need not fit the hooked one (f16 x 16 ranks, pattern 7
// at hidden 24576: 384 threads per block, which 174 registers cannot launch). So each hooked
// MoE kernel is compiled with __maxnreg__(moe_register_cap), the unhooked kernel's count
// rounded up to the allocation unit (ffi/cmake/FlashInferHeaders.cmake patches it in): it
// launches wherever FlashInfer's build does. The unhooked counts come from the build:
// tools/launch_registers.py probe --moe takes them from ffi/core/unhooked_registers.json, or
// compiles the MoE translation unit once more from FlashInfer's header without the hooks,
// and writes them into moe_unhooked_registers_<dtype>_n<ranks>.h, included before this
// header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#ifndef FUSEDAR_MOE_UNHOOKED_REGISTERS_INCLUDED
#error \
    "include the generated moe_unhooked_registers_<dtype>_n<ranks>.h first \
(see ffi/kernels/moe_instance.cu.in)"
#endif

namespace fusedar_geometry {

// The generated table's kind dimension.
enum MoeKind : int { kMoeReduction = 0, kMoeFinalize = 1 };

// Registers are allocated per warp in units of 256, i.e. 8 per thread, at most 255 (as in
// launch_registers.cuh).
inline constexpr int kMoeRegisterAllocationUnit = 8;
inline constexpr int kMoeMaxRegistersPerThread = 255;

// The __maxnreg__ bound of a hooked MoE kernel for the architecture being compiled. Flags:
// the kernel's bool template parameters as bits, the first one highest (the table's index).
template <int K, class T, int NRanks, int Flags>
constexpr int moe_register_cap() {
#if defined(__CUDA_ARCH__)
  constexpr int dtype = std::is_same_v<T, half> ? 1 : 2;
  static_assert(dtype == moe_unhooked::kDtype && NRanks == moe_unhooked::kNRanks,
                "a translation unit may only instantiate the kernels its generated table covers");
  constexpr int regs = [] {
    for (int i = 0; i < moe_unhooked::kNumArchs; ++i) {
      if (moe_unhooked::kArchs[i] == __CUDA_ARCH__ / 10) {
        return int(moe_unhooked::kRegisters[i][K][Flags]);
      }
    }
    return 0;
  }();
  static_assert(regs > 0, "no unhooked register count for this MoE kernel on this architecture");
  constexpr int allocated = (regs + kMoeRegisterAllocationUnit - 1) / kMoeRegisterAllocationUnit *
                            kMoeRegisterAllocationUnit;
  return allocated < kMoeMaxRegistersPerThread ? allocated : kMoeMaxRegistersPerThread;
#else
  return kMoeMaxRegistersPerThread;  // host pass: the bound only matters to device code
#endif
}

}  // namespace fusedar_geometry
