// Fills FlashInfer's MoE parameter structs from an MoeKernelCall and calls the launchers
// directly with the template flags this project serves (not FlashInfer's *_op wrappers,
// which instantiate every flag combination, FP4 output included, for every world size).
// The checks those wrappers make are made before this, in ffi/core/moe_launch.cpp.
// Included only by the generated per-(dtype, world size) translation units.
#pragma once

#include <exception>
#include <string>

#include "flashinfer_moe_kernel.cuh"
#include "moe_kernel_call.h"

namespace fusedar::kernels {

namespace fim = flashinfer::trtllm_moe_allreduce_fusion;

template <typename T, typename Params>
void fill_common(Params& p, const MoeKernelCall& call) {
  const fusedar_moe_launch_args& a = *call.args;
  p.nranks = call.nranks;
  p.rank = call.rank;
  p.size = static_cast<int>(a.num_tokens * a.hidden_dim);
  p.hidden_dim = static_cast<int>(a.hidden_dim);
  p.workspace = call.workspace_table;
  // FlashInfer's params are non-const; the kernels only read the inputs.
  p.residual_in = const_cast<void*>(a.residual_in);
  p.residual_out = a.residual_out;
  p.norm_out = a.norm_out;
  p.quant_out = nullptr;
  p.scale_out = nullptr;
  p.rms_gamma = const_cast<void*>(a.rms_gamma);
  p.rms_eps = a.rms_eps;
  p.weight_bias = a.weight_bias;
  // Read only by the FP4 epilogue, which is not instantiated; FlashInfer's unified API
  // passes 1.0 and SWIZZLED_128x4 here too.
  p.scale_factor = 1.0f;
  p.layout = flashinfer::QuantizationSFLayout::SWIZZLED_128x4;
  p.stream = call.stream;
}

template <typename T, int NRanks, bool AllReduceOut, bool ResidualOut>
cudaError_t launch_reduction(const fim::MoeReductionAllReduceFusionParams<T>& p, bool pdl) {
  // RMSNorm always (rms_gamma is required, as in FlashInfer), no FP4 output.
  return fim::moereduction_allreduce_fusion_kernel_launcher<T, NRanks, AllReduceOut, ResidualOut,
                                                            true, false>(p, pdl);
}

template <typename T, int NRanks>
std::string launch_moe_typed(const MoeKernelCall& call) {
  const fusedar_moe_launch_args& a = *call.args;
  const bool pdl = a.launch_with_pdl != 0;
  cudaError_t err = cudaSuccess;
  try {
    if (a.pattern == 6) {
      fim::MoeReductionAllReduceFusionParams<T> p{};
      fill_common<T>(p, call);
      p.allreduce_in = nullptr;  // pattern 6 reads its inputs from the fields below
      p.moe_allreduce_out = a.allreduce_out;
      p.moe_reduction_device_num_experts = a.num_experts;
      p.moe_reduction_scale_input = const_cast<float*>(a.expert_scales);
      p.moe_reduction_active_experts_token_input = const_cast<void*>(a.expert_outputs);
      p.moe_reduction_token_input = const_cast<void*>(a.token_input);
      const bool ar = a.allreduce_out != nullptr, res = a.residual_out != nullptr;
      if (ar && res)
        err = launch_reduction<T, NRanks, true, true>(p, pdl);
      else if (ar)
        err = launch_reduction<T, NRanks, true, false>(p, pdl);
      else if (res)
        err = launch_reduction<T, NRanks, false, true>(p, pdl);
      else
        err = launch_reduction<T, NRanks, false, false>(p, pdl);
    } else if (a.pattern == 7) {
      fim::MoeFinalizeAllReduceFusionParams<T> p{};
      fill_common<T>(p, call);
      p.allreduce_in = const_cast<void*>(a.permuted_input);
      p.top_k = a.top_k;
      p.expert_scale_factor = const_cast<void*>(a.expert_scale_factor);
      p.shared_expert_output = const_cast<void*>(a.shared_expert_output);
      p.expanded_idx_to_permuted_idx = const_cast<int32_t*>(a.expanded_idx_to_permuted_idx);
      p.routed_scaling_factor = a.routed_scaling_factor;
      // residual_out and norm_out always (FlashInfer's unified API allocates both), router
      // weights in the call's dtype (FlashInfer's ScaleType default, as its build uses).
      err = fim::moefinalize_allreduce_fusion_kernel_launcher<T, NRanks, true, true, false, T>(p,
                                                                                               pdl);
    } else {
      return "pattern " + std::to_string(a.pattern) + " is not an MoE pattern";
    }
  } catch (const std::exception& e) {
    // FLASHINFER_CHECK throws (e.g. a block size above 1024 for a very large hidden_dim).
    return std::string("FlashInfer's MoE kernel refused the launch: ") + e.what();
  }
  if (err != cudaSuccess) return std::string("kernel launch failed: ") + cudaGetErrorString(err);
  return {};
}

}  // namespace fusedar::kernels
