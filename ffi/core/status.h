// Thread-local error reporting for the C API (fusedar_last_error).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "fusedar/core.h"

namespace fusedar {

// Records `message` as the calling thread's last error and returns `code`.
int fail(int code, std::string message);

// Formats a CUDA failure: what we were doing, on which device, and CUDA's own words.
int fail_cuda(cudaError_t err, const std::string& what, int device);

}  // namespace fusedar

#define FUSEDAR_CUDA_TRY(expr, what, device)                       \
  do {                                                             \
    cudaError_t fusedar_err_ = (expr);                             \
    if (fusedar_err_ != cudaSuccess) {                             \
      return ::fusedar::fail_cuda(fusedar_err_, (what), (device)); \
    }                                                              \
  } while (0)
