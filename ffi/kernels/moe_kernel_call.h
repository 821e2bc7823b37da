// The seam between the native core and the MoE kernel translation units.
//
// FlashInfer's MoE epilogues (patterns 6 and 7) live in their own header,
// trtllm_moe_allreduce_fusion.cuh, with their own parameter structs; each
// (dtype, world size) pair is instantiated in a TU generated from moe_instance.cu.in, and
// the core only sees this declaration.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "fusedar/core.h"

namespace fusedar::kernels {

struct MoeKernelCall {
  const fusedar_moe_launch_args* args;
  int nranks;
  int rank;
  void** workspace_table;  // device pointer to the 3N+1 table (the dense kernels' table)
  cudaStream_t stream;
};

// Launches FlashInfer's MoE kernel for call.args->pattern. Returns an empty string on
// success, else why not. DType is FUSEDAR_FLOAT16 or FUSEDAR_BFLOAT16.
template <int DType, int NRanks>
std::string launch_moe(const MoeKernelCall& call);

}  // namespace fusedar::kernels
