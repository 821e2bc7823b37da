// Which FlashInfer fusion patterns this build instantiates.
//
// Every pattern costs compile time for 3 dtypes x 4 world sizes x 2 GPU architectures,
// so the list is explicit: 0 (all-reduce) and 1 (all-reduce + residual + RMSNorm).
// The quantized epilogues (2/4 static FP8, 8/9 group FP8, 10/11 dynamic FP8, 3/5
// NVFP4) are added here when they are wired and tested end to end.
#pragma once

namespace fusedar::kernels {

inline constexpr int kCompiledPatterns[] = {0, 1};

constexpr bool is_compiled_pattern(int pattern) {
  for (int p : kCompiledPatterns) {
    if (p == pattern) return true;
  }
  return false;
}

}  // namespace fusedar::kernels
