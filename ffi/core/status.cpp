#include "status.h"

#include <utility>

namespace fusedar {

namespace {
thread_local std::string last_error;
}

int fail(int code, std::string message) {
  last_error = std::move(message);
  return code;
}

int fail_cuda(cudaError_t err, const std::string& what, int device) {
  (void)cudaGetLastError();  // clear sticky-free errors so the next call starts clean
  return fail(FUSEDAR_CUDA_ERROR, what + " on device " + std::to_string(device) + ": " +
                                      cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace fusedar

extern "C" const char* fusedar_last_error(void) { return fusedar::last_error.c_str(); }
extern "C" int fusedar_abi_version(void) { return FUSEDAR_ABI_VERSION; }
