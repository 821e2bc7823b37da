// DeviceGuard: makes a CUDA device current for one scope.
#pragma once

#include <cuda_runtime_api.h>

namespace fusedar {

// Makes `device` current for the scope and restores the caller's device afterwards,
// so that framework threads (XLA's, torch's) never see their current device change.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int current = -1;
    if (previous_ >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous_) {
      cudaSetDevice(previous_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace fusedar
