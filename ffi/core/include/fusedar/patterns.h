// The native side's one table of FlashInfer's fusion patterns: per pattern code, what a call
// reads and writes and which family serves it (the dense kernel, or one of the MoE
// epilogues). The core's launch checks (ffi/core/launch.cpp) and the XLA handlers' operand
// and result counts (ffi/xla/allreduce_fusion.cc, moe_allreduce_fusion.cc) read it; the
// Python table (jax_fusedar/common/patterns.py, TRAITS) must equal it, which
// tests/native/test_contract.py checks through the bound module (ext.pattern_table()).
// C++ only and header-only: no ABI; no kernel translation unit includes it.
#ifndef FUSEDAR_PATTERNS_H_
#define FUSEDAR_PATTERNS_H_

#include <stddef.h>
#include <stdint.h>

namespace fusedar {

// How a pattern quantizes norm_out (the names are jax_fusedar/common/patterns.py's).
enum class QuantKind : int32_t {
  kNone = 0,
  kFp8 = 1,         // static per-tensor FP8 (reads scale_factor)
  kFp4 = 2,         // NVFP4 with block scales (reads scale_factor, writes scale_out)
  kGroupFp8 = 3,    // per-token-group FP8, packed UE8M0 scales (writes scale_out)
  kDynamicFp8 = 4,  // dynamic per-token FP8 (writes scale_out)
};

constexpr const char* quant_kind_name(QuantKind q) {
  switch (q) {
    case QuantKind::kNone: return "";
    case QuantKind::kFp8: return "fp8";
    case QuantKind::kFp4: return "fp4";
    case QuantKind::kGroupFp8: return "group_fp8";
    case QuantKind::kDynamicFp8: return "dynamic_fp8";
  }
  return "?";
}

// Which entry point serves a pattern (the names are jax_fusedar/common/patterns.py's
// FAMILIES): the dense kernel (fusedar_launch, the dense XLA handler) or one of FlashInfer's
// MoE epilogues (fusedar_moe_launch, the MoE handler).
enum class Family : int32_t {
  kDense = 0,
  kMoeReduction = 1,  // pattern 6: the expert-weighted sum of the local experts' rows
  kMoeFinalize = 2,   // pattern 7: the gather of the permuted expert rows
};

constexpr const char* family_name(Family f) {
  switch (f) {
    case Family::kDense: return "dense";
    case Family::kMoeReduction: return "moe_reduction";
    case Family::kMoeFinalize: return "moe_finalize";
  }
  return "?";
}

struct PatternTraits {
  int32_t code;  // FlashInfer's AllReduceFusionPattern
  // Reads residual_in and rms_gamma and writes residual_out; without it the pattern is the
  // plain all-reduce and writes allreduce_out.
  bool residual;
  bool norm_out;
  QuantKind quant;
  Family family = Family::kDense;

  constexpr bool dense() const { return family == Family::kDense; }
  constexpr bool allreduce_out() const { return !residual; }
  constexpr bool quant_out() const { return quant != QuantKind::kNone; }
  // Static FP8 and NVFP4 read a float32 scale_factor (a device scalar).
  constexpr bool scale_factor() const {
    return quant == QuantKind::kFp8 || quant == QuantKind::kFp4;
  }
  constexpr bool scale_out() const {
    return quant == QuantKind::kFp4 || quant == QuantKind::kGroupFp8 ||
           quant == QuantKind::kDynamicFp8;
  }
  // On sm90 the NVFP4 epilogue compiles and runs but writes zeros and no scales.
  constexpr bool needs_sm100() const { return quant == QuantKind::kFp4; }
  // XLA operand and result counts, in the order of ffi/xla/allreduce_fusion.cc; for the
  // MoE families the operands every call has (ffi/xla/moe_allreduce_fusion.cc: the finalize
  // may add expert_scale_factor and shared_expert_output) and the results without the
  // reduction's optional allreduce_out.
  constexpr int operands() const {
    switch (family) {
      case Family::kMoeReduction: return 5;  // scales, expert rows, token input, residual, gamma
      case Family::kMoeFinalize: return 4;   // permuted rows, index map, residual, gamma
      case Family::kDense: break;
    }
    return 1 + (residual ? 2 : 0) + (scale_factor() ? 1 : 0);
  }
  constexpr int results() const {
    return 1 + (norm_out ? 1 : 0) + (quant_out() ? 1 : 0) + (scale_out() ? 1 : 0);
  }
};

inline constexpr PatternTraits kPatterns[] = {
    {0, false, false, QuantKind::kNone},         // kAllReduce
    {1, true, true, QuantKind::kNone},           // kARResidualRMSNorm
    {2, true, false, QuantKind::kFp8},           // kARResidualRMSNormFP8Quant
    {3, true, false, QuantKind::kFp4},           // kARResidualRMSNormFP4Quant
    {4, true, true, QuantKind::kFp8},            // kARResidualRMSNormOutFP8Quant
    {5, true, true, QuantKind::kFp4},            // kARResidualRMSNormOutFP4Quant
    {8, true, false, QuantKind::kGroupFp8},      // ...PerTokenGroupFP8PackedQuant
    {9, true, true, QuantKind::kGroupFp8},       // ...OutPerTokenGroupFP8PackedQuant
    {10, true, false, QuantKind::kDynamicFp8},   // kARResidualRMSNormDynamicFP8Quant
    {11, true, true, QuantKind::kDynamicFp8},    // kARResidualRMSNormOutDynamicFP8Quant
    {6, true, true, QuantKind::kNone, Family::kMoeReduction},  // kMoEReductionARResidualRMSNorm
    {7, true, true, QuantKind::kNone, Family::kMoeFinalize},   // kMoEFinalizeARResidualRMSNorm
};

inline constexpr size_t kPatternCount = sizeof(kPatterns) / sizeof(kPatterns[0]);

// The row of `code`, or nullptr for a code this table does not serve.
constexpr const PatternTraits* find_pattern(int32_t code) {
  for (const PatternTraits& p : kPatterns) {
    if (p.code == code) return &p;
  }
  return nullptr;
}

// The row of `code` where the dense kernel serves it, else nullptr (the dense launch and
// handler refuse the MoE codes: those have their own).
constexpr const PatternTraits* find_dense_pattern(int32_t code) {
  const PatternTraits* p = find_pattern(code);
  return p != nullptr && p->dense() ? p : nullptr;
}

}  // namespace fusedar

#endif  // FUSEDAR_PATTERNS_H_
