#include "launch_prelude.h"

#include <atomic>
#include <cstdint>

#include "handshake.h"
#include "rank_state.h"
#include "status.h"

namespace {
std::atomic<uint64_t> launches{0};
}  // namespace

namespace fusedar {

int launch_prelude(const fusedar_rank* r, const fusedar_launch_args& signature, cudaStream_t stream,
                   std::optional<DeviceGuard>& guard) {
  std::string failed = handshake::failure(r);
  if (!failed.empty()) return fail(FUSEDAR_CUDA_ERROR, failed);
  guard.emplace(r->device);
  FUSEDAR_CUDA_TRY(guard->status(), "selecting the device", r->device);
  if (r->handshake) {
    cudaError_t err = handshake::launch(r, signature, stream);
    if (err != cudaSuccess) {
      return fail_cuda(err, "launching the handshake", r->device);
    }
  }
  return FUSEDAR_OK;
}

int launch_result(const fusedar_rank* r, const std::string& error) {
  if (!error.empty()) {
    (void)cudaGetLastError();
    return fail(FUSEDAR_CUDA_ERROR, "device " + std::to_string(r->device) + ": " + error);
  }
  launches.fetch_add(1, std::memory_order_relaxed);
  return FUSEDAR_OK;
}

}  // namespace fusedar

// Host-side launches so far in this process, dense and MoE.
extern "C" uint64_t fusedar_launch_count(void) { return launches.load(std::memory_order_relaxed); }
