// The seam between the native core and the heavy kernel translation units.
//
// Each (dtype, world size) pair is instantiated in its own translation unit
// (generated from instance.cu.in) so they compile in parallel; the core only sees
// this declaration and never includes FlashInfer's 2,000-line header itself.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "fusedar/core.h"
#include "large_message.h"

namespace fusedar::kernels {

struct KernelCall {
  const fusedar_launch_args* args;
  int nranks;
  int rank;
  void** workspace_table;  // device pointer to the 3N+1 table
  cudaStream_t stream;
  // Streams, events and peer pointers of the large-message algorithm (algorithm 2 only).
  const large::Resources* large;
};

// Launches FlashInfer's fused kernel. Returns an empty string on success, else why not.
// DType is a fusedar_dtype code; defined once per (DType, NRanks) in a generated TU.
template <int DType, int NRanks>
std::string launch(const KernelCall& call);

}  // namespace fusedar::kernels
