// Which FlashInfer fusion patterns this build instantiates.
//
// Every pattern costs compile time for 3 dtypes x 4 world sizes x 2 accumulation modes x 2
// GPU architectures, so the list is explicit: all of FlashInfer's single-node patterns:
// 0 all-reduce, 1 + residual + RMSNorm, 2/4 static FP8, 3/5 NVFP4 (sm100+ only: on sm90
// the kernel runs and writes zeros, so the launch refuses it there), 8/9 per-token-group
// FP8, 10/11 dynamic per-token FP8.
#pragma once

namespace fusedar::kernels {

inline constexpr int kCompiledPatterns[] = {0, 1, 2, 3, 4, 5, 8, 9, 10, 11};

constexpr bool is_compiled_pattern(int pattern) {
  for (int p : kCompiledPatterns) {
    if (p == pattern) return true;
  }
  return false;
}

}  // namespace fusedar::kernels
