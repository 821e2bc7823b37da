// Device-side timestamps for benchmarks: a one-thread kernel that stores %globaltimer
// (nanoseconds) when the stream reaches it. Host clocks around a JAX program time the
// host's dispatch as much as the GPU; two stamps on the device's own stream, ordered by
// data dependencies in the program, time only what the device did between them.
#include <cstdint>
#include <string>

#include "fusedar/core.h"
#include "status.h"

namespace fusedar {
namespace {

__global__ void store_global_timer(uint32_t* out) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  out[0] = static_cast<uint32_t>(t);
  out[1] = static_cast<uint32_t>(t >> 32);
}

}  // namespace
}  // namespace fusedar

extern "C" int fusedar_device_timestamp(void* stream, uint32_t* out) {
  if (out == nullptr) return fusedar::fail(FUSEDAR_INVALID_ARGUMENT, "out is null");
  fusedar::store_global_timer<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(out);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return fusedar::fail(FUSEDAR_CUDA_ERROR,
                         std::string("launching the timestamp kernel: ") + cudaGetErrorString(err));
  }
  return FUSEDAR_OK;
}
