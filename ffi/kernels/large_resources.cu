// Streams and events of the large-message algorithm (large_message.h), one set per rank, and
// its two flag kernels (compiled once here: they do not depend on the dtype or world size).
#include "large_message.h"
#include "large_sync.cuh"

namespace fusedar::kernels::large {

namespace {

// Step 1: bump the call number and meet every peer. Each peer is then inside this call, so
// its previous call (of any algorithm) has finished on its stream and nobody reads the slots
// we are about to write. The call is counted in the control block too (the call number of
// a failure record, shared with FlashInfer's kernels).
__global__ void enter_kernel(FlagsTable t, int rank, int nranks, Watch watch) {
  __shared__ unsigned int seq;
  Flags* own = t.rank[rank];
  if (threadIdx.x == 0) {
    seq = ++own->seq;
    atomicAdd(&watch.control->calls, 1ull);
  }
  // Clear the chunk flags of the previous call: every one was raised (we waited on each)
  // and no peer raises one for this call before it has seen our `entered` below.
  for (int i = threadIdx.x; i < kMaxRanks * kMaxChunks; i += blockDim.x) {
    (&own->scattered[0][0])[i] = 0;
    (&own->gathered[0][0])[i] = 0;
  }
  __threadfence_system();
  __syncthreads();
  int p = threadIdx.x;
  if (p < nranks && p != rank) {
    store_release_sys(&t.rank[p]->entered[rank], seq);
    wait_for(watch, watchdog::kLargeEnter, p, static_cast<int>(seq), &t.rank[rank]->entered[p],
             seq);
  }
}

// After the copies of one chunk have completed (stream order): tell every peer.
// kind 0: scattered, 1: gathered.
__global__ void signal_kernel(FlagsTable t, int rank, int nranks, int kind, int chunk) {
  int p = threadIdx.x;
  if (p < nranks && p != rank) {
    __threadfence_system();
    unsigned int* flag =
        kind == 0 ? &t.rank[p]->scattered[rank][chunk] : &t.rank[p]->gathered[rank][chunk];
    store_release_sys(flag, 1u);
  }
}

}  // namespace

cudaError_t launch_enter(const Resources& res, cudaStream_t stream, int rank, int nranks,
                         const Watch& watch) {
  enter_kernel<<<1, 32, 0, stream>>>(res.flags, rank, nranks, watch);
  return cudaGetLastError();
}

cudaError_t launch_signal(const Resources& res, cudaStream_t stream, int rank, int nranks, int kind,
                          int chunk) {
  signal_kernel<<<1, 32, 0, stream>>>(res.flags, rank, nranks, kind, chunk);
  return cudaGetLastError();
}

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
