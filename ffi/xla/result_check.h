// The results a dense pattern writes (ffi/xla/allreduce_fusion.cc's result list): for each,
// its name, element type and element count, as jax_fusedar/common/results.py's
// result_specs gives them (their storage shapes). The handler checks every result against
// this list before the launch, so a program whose result list differs (a wrong shape, dtype
// or quantization layout) is an FFI error, never a write past a buffer.
// tests/native/test_contract.py holds it equal to the Python rule through the bound module
// (ext.expected_results, ext.results_problem). Header-only, no XLA types: the handler and
// the module translate their own element types to `Element`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fusedar/core.h"
#include "fusedar/patterns.h"

namespace fusedar::xla {

// Element types a result can have; names are numpy's (jnp.dtype(name), getattr(torch, name)).
enum class Element { kFloat32, kFloat16, kBFloat16, kUInt8, kFloat8E4M3FN, kInt32, kOther };

inline const char* element_name(Element e) {
  switch (e) {
    case Element::kFloat32: return "float32";
    case Element::kFloat16: return "float16";
    case Element::kBFloat16: return "bfloat16";
    case Element::kUInt8: return "uint8";
    case Element::kFloat8E4M3FN: return "float8_e4m3fn";
    case Element::kInt32: return "int32";
    case Element::kOther: break;
  }
  return "another type";
}

inline Element element_of_dtype(int dtype) {
  switch (dtype) {
    case FUSEDAR_FLOAT32: return Element::kFloat32;
    case FUSEDAR_FLOAT16: return Element::kFloat16;
    case FUSEDAR_BFLOAT16: return Element::kBFloat16;
  }
  return Element::kOther;
}

struct ResultLayout {
  std::string name;
  Element element;
  int64_t count;  // elements of the dense storage array
};

// NVFP4 scales: one e4m3 byte per 16 elements (quant_layouts.NVFP4_BLOCK).
inline constexpr int64_t kNvfp4Block = 16;
// NVFP4 scale layouts (QuantizationSFLayout): SWIZZLED_8x4 (1) writes nothing, refused.
inline constexpr int32_t kLayoutSwizzled128x4 = 0;
inline constexpr int32_t kLayoutLinear = 2;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The results of `traits` for a [m, h] input of `dtype` (fusedar_dtype), in the handler's
// order; false with *why set when the quantization parameters cannot describe any result
// (quant_layouts.py's rules: h % 16 for NVFP4, its layout, a group size dividing h).
inline bool expected_results(const PatternTraits& traits, int dtype, int64_t m, int64_t h,
                             int32_t layout, int32_t group_size, std::vector<ResultLayout>* out,
                             std::string* why) {
  const Element x = element_of_dtype(dtype);
  out->clear();
  if (traits.allreduce_out()) {
    out->push_back({"allreduce_out", x, m * h});
    return true;
  }
  out->push_back({"residual_out", x, m * h});
  if (traits.norm_out) out->push_back({"norm_out", x, m * h});
  switch (traits.quant) {
    case QuantKind::kNone: break;
    case QuantKind::kFp8: out->push_back({"quant_out", Element::kFloat8E4M3FN, m * h}); break;
    case QuantKind::kDynamicFp8:
      out->push_back({"quant_out", Element::kFloat8E4M3FN, m * h});
      out->push_back({"scale_out", Element::kFloat32, m});
      break;
    case QuantKind::kGroupFp8: {
      if (group_size <= 0 || h % group_size != 0) {
        *why = "block_quant_group_size " + std::to_string(group_size) +
               " does not divide hidden_dim " + std::to_string(h);
        return false;
      }
      // (K, T): K packs of 4 UE8M0 bytes per token, T = round_up(M, 4) (quant_layouts.py).
      const int64_t packs = (h / group_size + 3) / 4;
      out->push_back({"quant_out", Element::kFloat8E4M3FN, m * h});
      out->push_back({"scale_out", Element::kInt32, packs * round_up(m, 4)});
      break;
    }
    case QuantKind::kFp4: {
      if (h % kNvfp4Block != 0) {
        *why = "NVFP4 needs hidden_dim divisible by 16, got " + std::to_string(h);
        return false;
      }
      const int64_t blocks = h / kNvfp4Block;
      int64_t scales = 0;
      if (layout == kLayoutSwizzled128x4) {
        scales = round_up(m, 128) * round_up(blocks, 4);
      } else if (layout == kLayoutLinear) {
        scales = m * blocks;
      } else {
        *why = "unknown NVFP4 scale layout " + std::to_string(layout) +
               " (0: SWIZZLED_128x4, 2: LINEAR)";
        return false;
      }
      out->push_back({"quant_out", Element::kUInt8, m * (h / 2)});
      out->push_back({"scale_out", Element::kFloat8E4M3FN, scales});
      break;
    }
  }
  return true;
}

struct GivenResult {
  Element element;
  int64_t count;
};

// "" when `given` (the results of the call, in order) is exactly the list above, else what
// differs, naming the first result that does.
inline std::string results_problem(const PatternTraits& traits, int dtype, int64_t m, int64_t h,
                                   int32_t layout, int32_t group_size,
                                   const std::vector<GivenResult>& given) {
  std::vector<ResultLayout> want;
  std::string why;
  if (!expected_results(traits, dtype, m, h, layout, group_size, &want, &why)) return why;
  const std::string label = "pattern " + std::to_string(traits.code);
  if (given.size() != want.size()) {
    return label + " writes " + std::to_string(want.size()) + " results, the call has " +
           std::to_string(given.size());
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (given[i].element != want[i].element || given[i].count != want[i].count) {
      return label + ": result " + std::to_string(i) + " (" + want[i].name + ") must be " +
             std::to_string(want[i].count) + " elements of " + element_name(want[i].element) +
             " for " + std::to_string(m) + " x " + std::to_string(h) + ", got " +
             std::to_string(given[i].count) + " of " + element_name(given[i].element);
    }
  }
  return "";
}

}  // namespace fusedar::xla
