// Streams and events of the large-message algorithm (large_message.h), one set per rank.
#include "large_message.h"

namespace fusedar::kernels::large {

cudaError_t create_resources(Resources* res, int device) {
  cudaError_t err = cudaDeviceGetAttribute(&res->sm_count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  // Non-blocking: the side streams must not serialise with the legacy default stream.
  for (cudaStream_t* st : {&res->copy, &res->gather, &res->signal}) {
    err = cudaStreamCreateWithFlags(st, cudaStreamNonBlocking);
    if (err != cudaSuccess) return err;
  }
  auto make = [](cudaEvent_t* ev) { return cudaEventCreateWithFlags(ev, cudaEventDisableTiming); };
  if ((err = make(&res->fork)) != cudaSuccess) return err;
  if ((err = make(&res->copy_done)) != cudaSuccess) return err;
  if ((err = make(&res->gather_done)) != cudaSuccess) return err;
  if ((err = make(&res->signal_done)) != cudaSuccess) return err;
  for (int k = 0; k < kMaxChunks; ++k) {
    if ((err = make(&res->scattered[k])) != cudaSuccess) return err;
    if ((err = make(&res->reduced[k])) != cudaSuccess) return err;
    if ((err = make(&res->gathered[k])) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void destroy_resources(Resources* res) {
  for (cudaStream_t st : {res->copy, res->gather, res->signal}) {
    if (st) cudaStreamDestroy(st);
  }
  for (cudaEvent_t ev : {res->fork, res->copy_done, res->gather_done, res->signal_done}) {
    if (ev) cudaEventDestroy(ev);
  }
  for (int k = 0; k < kMaxChunks; ++k) {
    for (cudaEvent_t ev : {res->scattered[k], res->reduced[k], res->gathered[k]}) {
      if (ev) cudaEventDestroy(ev);
    }
  }
  *res = Resources{};
}

}  // namespace fusedar::kernels::large
