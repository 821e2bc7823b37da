// Fills FlashInfer's AllReduceFusionParams from a KernelCall and dispatches on the
// pattern. Included only by the generated per-(dtype, world size) translation units.
#pragma once

#include <exception>
#include <string>

#include "compiled_patterns.h"
#include "flashinfer_kernel.cuh"
#include "kernel_call.h"
#include "large_message.cuh"

namespace fusedar::kernels {

namespace fi = flashinfer::trtllm_allreduce_fusion;

template <typename T, int NRanks, bool Fp32Acc, fi::AllReduceFusionPattern Pattern>
std::string launch_pattern(const fi::AllReduceFusionParams<T>& params, bool launch_with_pdl,
                           const KernelCall& call) {
  constexpr bool kFp4 = fi::GetQuantType<Pattern> == fi::QuantType::kFP4;
  if constexpr (!is_compiled_pattern(static_cast<int>(Pattern))) {
    return "pattern " + std::to_string(static_cast<int>(Pattern)) +
           " is not compiled into this build of jax_fusedar";
  } else if constexpr (kFp4 && (std::is_same_v<T, float> || CUDA_VERSION < 12080)) {
    // As in FlashInfer's own dispatch: NVFP4 needs 16-bit inputs and CUDA 12.8+.
    return "NVFP4 patterns need bfloat16 or float16 inputs (and CUDA 12.8+)";
  } else if (call.args->algorithm == FUSEDAR_ALGORITHM_LARGE_MESSAGE) {
#ifdef FUSEDAR_UNHOOKED_PROBE
    // The register probe (launch_registers.cuh) reads only FlashInfer's one-shot and
    // two-shot kernels: the large-message kernels, a third of a 16-bit probe's code, would
    // only add compile time there.
    return large::kNotCompiledMessage;
#else
    if constexpr (!large::kCompiledFor<T, NRanks>) {
      return large::kNotCompiledMessage;
    } else {
      const int64_t rows = params.size / params.hidden_dim;
      cudaError_t err = large::launch_large<Pattern, T, NRanks, Fp32Acc>(
          params, *call.large, large::default_schedule(rows, NRanks));
      if (err != cudaSuccess) {
        return std::string("large-message launch failed: ") + cudaGetErrorString(err);
      }
      return {};
    }
#endif
  } else {
    cudaError_t err =
        fi::allreduce_fusion_kernel_launcher<Pattern, T, NRanks, Fp32Acc>(params, launch_with_pdl);
    if (err != cudaSuccess) {
      return std::string("kernel launch failed: ") + cudaGetErrorString(err);
    }
    return {};
  }
}

template <typename T, int NRanks, bool Fp32Acc>
std::string launch_typed(const KernelCall& call) {
  const fusedar_launch_args& a = *call.args;
  fi::AllReduceFusionParams<T> p{};
  p.nranks = NRanks;
  p.rank = call.rank;
  p.size = static_cast<int>(a.num_tokens * a.hidden_dim);
  p.hidden_dim = static_cast<int>(a.hidden_dim);
  p.workspace = call.workspace_table;
  // FlashInfer's params are non-const; the kernel only reads the inputs.
  p.allreduce_in = const_cast<void*>(a.input);
  p.allreduce_out = a.allreduce_out;
  p.residual_in = const_cast<void*>(a.residual_in);
  p.residual_out = a.residual_out;
  p.norm_out = a.norm_out;
  p.quant_out = a.quant_out;
  p.scale_out = a.scale_out;
  p.rms_gamma = const_cast<void*>(a.rms_gamma);
  p.rms_eps = a.rms_eps;
  p.weight_bias = a.weight_bias;
  p.scale_factor = const_cast<float*>(a.scale_factor);
  p.use_oneshot = a.algorithm == FUSEDAR_ALGORITHM_ONESHOT;
  p.layout = static_cast<flashinfer::QuantizationSFLayout>(a.layout);
  p.stream = call.stream;
  p.pattern = static_cast<fi::AllReduceFusionPattern>(a.pattern);
  p.trigger_completion_at_end = a.trigger_completion_at_end != 0;
  p.block_quant_group_size = a.block_quant_group_size;
  p.tma_aligned_mn = static_cast<int>((a.num_tokens + 3) / 4 * 4);

  using P = fi::AllReduceFusionPattern;
  try {
    const bool pdl = a.launch_with_pdl != 0;
    switch (p.pattern) {
#define FUSEDAR_PATTERN_CASE(name) \
  case P::name: return launch_pattern<T, NRanks, Fp32Acc, P::name>(p, pdl, call);
      FUSEDAR_PATTERN_CASE(kAllReduce)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNorm)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormFP8Quant)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormFP4Quant)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormOutFP8Quant)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormOutFP4Quant)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormPerTokenGroupFP8PackedQuant)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormOutPerTokenGroupFP8PackedQuant)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormDynamicFP8Quant)
      FUSEDAR_PATTERN_CASE(kARResidualRMSNormOutDynamicFP8Quant)
#undef FUSEDAR_PATTERN_CASE
      default:
        return "pattern " + std::to_string(a.pattern) +
               " is not compiled into this build of jax_fusedar";
    }
  } catch (const std::exception& e) {
    // FLASHINFER_CHECK throws; turn it into an error the bindings report.
    return std::string("FlashInfer kernel refused the launch: ") + e.what();
  }
}

// float inputs are summed in float either way (FlashInfer forces Fp32Acc=false for float,
// which then means "no extra conversion"); 16-bit inputs get both variants, so that
// FlashInfer's default (fp32_acc=False) and vLLM's choice (True) both run.
template <typename T, int NRanks>
std::string launch_dtype(const KernelCall& call) {
  if constexpr (std::is_same_v<T, float>) {
    return launch_typed<T, NRanks, false>(call);
  } else {
    if (call.args->fp32_acc) return launch_typed<T, NRanks, true>(call);
    return launch_typed<T, NRanks, false>(call);
  }
}

}  // namespace fusedar::kernels
