// Small device queries the Python layers need without a CUDA binding of their own (the C
// API's fusedar_device_*; declared in fusedar/core.h).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "device_guard.h"
#include "fusedar/core.h"
#include "status.h"

using fusedar::fail;

extern "C" int fusedar_device_count(int32_t* count) {
  int c = 0;
  cudaError_t err = cudaGetDeviceCount(&c);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *count = 0;
    return fail(FUSEDAR_CUDA_ERROR, std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err));
  }
  *count = c;
  return FUSEDAR_OK;
}

extern "C" int fusedar_can_access_peer(int32_t device, int32_t peer, int32_t* can) {
  int c = 0;
  FUSEDAR_CUDA_TRY(cudaDeviceCanAccessPeer(&c, device, peer), "querying peer access", device);
  *can = c;
  return FUSEDAR_OK;
}

extern "C" int fusedar_device_compute_capability(int32_t device, int32_t* major, int32_t* minor) {
  FUSEDAR_CUDA_TRY(cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device),
                   "querying the compute capability", device);
  FUSEDAR_CUDA_TRY(cudaDeviceGetAttribute(minor, cudaDevAttrComputeCapabilityMinor, device),
                   "querying the compute capability", device);
  return FUSEDAR_OK;
}

extern "C" int fusedar_device_mem_info(int32_t device, uint64_t* free_bytes, uint64_t* total) {
  fusedar::DeviceGuard guard(device);
  FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", device);
  size_t f = 0, t = 0;
  FUSEDAR_CUDA_TRY(cudaMemGetInfo(&f, &t), "querying free memory", device);
  *free_bytes = f;
  *total = t;
  return FUSEDAR_OK;
}

extern "C" int fusedar_device_synchronize(int32_t device) {
  fusedar::DeviceGuard guard(device);
  FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", device);
  FUSEDAR_CUDA_TRY(cudaDeviceSynchronize(), "synchronising", device);
  return FUSEDAR_OK;
}
