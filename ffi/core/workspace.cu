// Workspace of one TP rank: FlashInfer's `void* workspace[3N+1]` (docs/architecture.md).
//
//   [0, N)    two-shot data buffer of each rank       (peer-mapped)
//   [N, 2N)   barrier flags of each rank               (peer-mapped, zeroed), followed in
//             the same allocation by the opt-in handshake area (handshake.h) and the
//             large-message flags (flag_layout.h)
//   [2N, 3N)  Lamport triple buffer of each rank       (peer-mapped, filled with -0.0)
//   [3N]      this rank's control block {0,0,0,lamport_comm_bytes,0}, followed by the
//             bounded-wait settings (watchdog.h)                      (local only)
//
// Peers in this process are reached through peer access and raw pointers
// (cudaIpcOpenMemHandle refuses to open a handle in the process that exported it);
// peers in other processes through CUDA IPC handles. Never multicast.
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "device_guard.h"
#include "flag_layout.h"
#include "fusedar/core.h"
#include "handshake.h"
#include "rank_state.h"
#include "status.h"
#include "world_sizes.h"

namespace fusedar {
namespace {

constexpr int64_t kMaxCommSize = 2147483647LL & ~((1LL << 21) - 1);  // FlashInfer's cap
constexpr int64_t kBarrierFlagCount = 256;

int64_t round_up16(int64_t v) { return (v + 15) / 16 * 16; }

int element_size(int dtype) { return dtype == FUSEDAR_FLOAT32 ? 4 : 2; }

bool valid_dtype(int dtype) {
  return dtype == FUSEDAR_FLOAT32 || dtype == FUSEDAR_FLOAT16 || dtype == FUSEDAR_BFLOAT16;
}

// -0.0 is the "not arrived yet" sentinel of the Lamport protocol; its bit pattern
// depends on the element width (0x8000 for fp16/bf16, 0x80000000 for fp32), which is
// why a workspace serves only calls of its own width.
__global__ void fill_negative_zero(uint4* data, int64_t n_vec, uint32_t word) {
  uint4 v = make_uint4(word, word, word, word);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n_vec;
       i += int64_t(gridDim.x) * blockDim.x) {
    data[i] = v;
  }
}

}  // namespace
}  // namespace fusedar

using fusedar::DeviceGuard;
using fusedar::fail;

extern "C" int fusedar_workspace_sizes(int32_t world_size, int32_t max_token_num,
                                       int32_t hidden_dim, int32_t dtype,
                                       fusedar_workspace_info* info) {
  if (info == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "info is null");
  if (!fusedar::supported_world_size(world_size)) {
    return fail(FUSEDAR_UNSUPPORTED, "world size " + std::to_string(world_size) +
                                         " is not supported by the kernel (" +
                                         fusedar::world_sizes_text() + ")");
  }
  if (max_token_num <= 0 || hidden_dim <= 0) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "max_token_num and hidden_dim must be positive");
  }
  if (!fusedar::valid_dtype(dtype)) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "unknown dtype code " + std::to_string(dtype));
  }
  const int64_t e = fusedar::element_size(dtype);
  const int64_t elems = int64_t(world_size) * max_token_num * hidden_dim;
  info->world_size = world_size;
  info->max_token_num = max_token_num;
  info->hidden_dim = hidden_dim;
  info->dtype = dtype;
  info->two_shot_buffer_bytes = fusedar::round_up16(elems * e);
  info->flag_bytes = fusedar::round_up16(int64_t(world_size) * fusedar::kBarrierFlagCount * 4);
  info->lamport_comm_bytes = fusedar::round_up16(std::min(elems * e, fusedar::kMaxCommSize));
  info->lamport_buffer_bytes = 3 * info->lamport_comm_bytes;
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_create(int32_t device, int32_t world_size, int32_t rank,
                                   int32_t max_token_num, int32_t hidden_dim, int32_t dtype,
                                   fusedar_rank** out) {
  if (out == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "out is null");
  *out = nullptr;
  fusedar_workspace_info info;
  if (int rc = fusedar_workspace_sizes(world_size, max_token_num, hidden_dim, dtype, &info)) {
    return rc;
  }
  if (rank < 0 || rank >= world_size) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "rank " + std::to_string(rank) +
                                              " is outside the group of size " +
                                              std::to_string(world_size));
  }
  DeviceGuard guard(device);
  FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", device);

  auto* r = new fusedar_rank();
  r->device = device;
  r->rank = rank;
  r->info = info;
  r->peers.assign(world_size, {});
  const int64_t sizes[FUSEDAR_SHARED_BUFFERS] = {
      info.two_shot_buffer_bytes, fusedar::flag_allocation_bytes(info), info.lamport_buffer_bytes};
  static const char* names[FUSEDAR_SHARED_BUFFERS] = {"two-shot buffer", "barrier flags",
                                                      "Lamport buffer"};
  for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) {
    // One cudaMalloc per buffer: an IPC handle always names a whole allocation.
    cudaError_t err = cudaMalloc(&r->local[b], sizes[b]);
    if (err != cudaSuccess) {
      fusedar_rank_destroy(r);
      return fusedar::fail_cuda(err,
                                std::string("allocating the ") + names[b] + " (" +
                                    std::to_string(sizes[b]) +
                                    " bytes) of the all-reduce workspace; if a framework "
                                    "preallocated the GPU, leave room for the workspace",
                                device);
    }
  }
  cudaError_t err = cudaMalloc(&r->control, sizeof(fusedar::watchdog::Control));
  if (err != cudaSuccess) {
    fusedar_rank_destroy(r);
    return fusedar::fail_cuda(err, "allocating the control block", device);
  }
  // The failure record: pinned host memory mapped into the device, so the host can read
  // it after a trap has made the CUDA context unusable.
  err = cudaHostAlloc(&r->record, sizeof(fusedar::watchdog::Record),
                      cudaHostAllocMapped | cudaHostAllocPortable);
  if (err == cudaSuccess) {
    std::memset(r->record, 0, sizeof(fusedar::watchdog::Record));
    err = cudaHostGetDevicePointer(&r->record_device, r->record, 0);
  }
  if (err != cudaSuccess) {
    fusedar_rank_destroy(r);
    return fusedar::fail_cuda(err, "allocating the failure record (pinned host memory)", device);
  }
  // Our own buffers are our own peer entry.
  for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) r->peers[rank].ptr[b] = r->local[b];
  r->peers[rank].known = true;
  *out = r;
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_local_pointers(const fusedar_rank* r,
                                           uint64_t out[FUSEDAR_SHARED_BUFFERS]) {
  if (r == nullptr || out == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) {
    out[b] = reinterpret_cast<uint64_t>(r->local[b]);
  }
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_export_ipc(
    const fusedar_rank* r, uint8_t out[FUSEDAR_SHARED_BUFFERS * FUSEDAR_IPC_HANDLE_BYTES]) {
  if (r == nullptr || out == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  DeviceGuard guard(r->device);
  FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", r->device);
  for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) {
    cudaIpcMemHandle_t h;
    FUSEDAR_CUDA_TRY(cudaIpcGetMemHandle(&h, r->local[b]), "exporting a CUDA IPC handle",
                     r->device);
    static_assert(sizeof(h) == FUSEDAR_IPC_HANDLE_BYTES, "unexpected cudaIpcMemHandle_t size");
    std::memcpy(out + b * FUSEDAR_IPC_HANDLE_BYTES, &h, sizeof(h));
  }
  return FUSEDAR_OK;
}

static int check_peer_slot(const fusedar_rank* r, int32_t peer) {
  if (r == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "rank is null");
  if (r->table != nullptr) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "the workspace is already finalized");
  }
  if (peer < 0 || peer >= r->info.world_size || peer == r->rank) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "peer " + std::to_string(peer) +
                                              " is not another rank of this group of " +
                                              std::to_string(r->info.world_size));
  }
  if (r->peers[peer].known) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "peer " + std::to_string(peer) + " was already set");
  }
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_set_peer_pointers(fusedar_rank* r, int32_t peer, int32_t peer_device,
                                              const uint64_t ptrs[FUSEDAR_SHARED_BUFFERS]) {
  if (int rc = check_peer_slot(r, peer)) return rc;
  DeviceGuard guard(r->device);
  FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", r->device);
  if (peer_device != r->device) {
    int can = 0;
    FUSEDAR_CUDA_TRY(cudaDeviceCanAccessPeer(&can, r->device, peer_device), "querying peer access",
                     r->device);
    if (!can) {
      return fail(FUSEDAR_UNSUPPORTED,
                  "device " + std::to_string(r->device) + " cannot access device " +
                      std::to_string(peer_device) +
                      " directly (no P2P over NVLink/PCIe); the trtllm backend needs it");
    }
    cudaError_t err = cudaDeviceEnablePeerAccess(peer_device, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();  // another workspace enabled it already: fine
    } else if (err != cudaSuccess) {
      return fusedar::fail_cuda(
          err, "enabling peer access to device " + std::to_string(peer_device), r->device);
    }
  }
  for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) {
    r->peers[peer].ptr[b] = reinterpret_cast<void*>(ptrs[b]);
  }
  r->peers[peer].known = true;
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_open_peer_ipc(
    fusedar_rank* r, int32_t peer,
    const uint8_t handles[FUSEDAR_SHARED_BUFFERS * FUSEDAR_IPC_HANDLE_BYTES]) {
  if (int rc = check_peer_slot(r, peer)) return rc;
  DeviceGuard guard(r->device);
  FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", r->device);
  for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles + b * FUSEDAR_IPC_HANDLE_BYTES, sizeof(h));
    void* p = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      return fusedar::fail_cuda(err,
                                "opening the CUDA IPC handle of peer " + std::to_string(peer) +
                                    " (a handle from this same process cannot be opened; "
                                    "use set_peer_pointers for local peers)",
                                r->device);
    }
    r->peers[peer].ptr[b] = p;
    r->peers[peer].ipc[b] = true;
  }
  r->peers[peer].known = true;
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_finalize(fusedar_rank* r) {
  if (r == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "rank is null");
  if (r->table != nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "already finalized");
  const int n = r->info.world_size;
  for (int p = 0; p < n; ++p) {
    if (!r->peers[p].known) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "rank " + std::to_string(r->rank) +
                                                " has no buffers for peer " + std::to_string(p) +
                                                "; set every peer before finalize");
    }
  }
  DeviceGuard guard(r->device);
  FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", r->device);
  std::vector<void*> host(3 * n + 1);
  for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) {
    for (int p = 0; p < n; ++p) host[b * n + p] = r->peers[p].ptr[b];
  }
  host[3 * n] = r->control;

  void* table = nullptr;
  FUSEDAR_CUDA_TRY(cudaMalloc(&table, host.size() * sizeof(void*)),
                   "allocating the workspace pointer table", r->device);
  r->table = static_cast<void**>(table);
  FUSEDAR_CUDA_TRY(
      cudaMemcpy(table, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice),
      "uploading the workspace pointer table", r->device);
  FUSEDAR_CUDA_TRY(cudaMemset(r->local[1], 0, fusedar::flag_allocation_bytes(r->info)),
                   "zeroing the barrier flags and the handshake area", r->device);
  FUSEDAR_CUDA_TRY(fusedar::handshake::reset(r), "resetting the handshake counter", r->device);
  std::memset(r->record, 0, sizeof(fusedar::watchdog::Record));
  fusedar::watchdog::Control control{};
  control.flashinfer[3] = static_cast<int>(r->info.lamport_comm_bytes);
  control.timeout_ns = r->timeout_ns;
  control.record = static_cast<fusedar::watchdog::Record*>(r->record_device);
  control.rank = r->rank;
  control.world = n;
  control.device = r->device;
  FUSEDAR_CUDA_TRY(cudaMemcpy(r->control, &control, sizeof(control), cudaMemcpyHostToDevice),
                   "initialising the control block", r->device);
  {
    auto* res = new fusedar::kernels::large::Resources();
    r->large = res;
    FUSEDAR_CUDA_TRY(fusedar::kernels::large::create_resources(res, r->device),
                     "creating the large-message streams and events", r->device);
    for (int p = 0; p < n; ++p) {
      res->buffers[p] = static_cast<char*>(r->peers[p].ptr[0]);
      res->flags.rank[p] = reinterpret_cast<fusedar::kernels::large::Flags*>(
          static_cast<char*>(r->peers[p].ptr[1]) + fusedar::large_flags_offset(r->info));
    }
    res->control = r->control;
  }
  const uint32_t word = r->info.dtype == FUSEDAR_FLOAT32 ? 0x80000000u : 0x80008000u;
  const int64_t n_vec = r->info.lamport_buffer_bytes / 16;
  fusedar::fill_negative_zero<<<1024, 256>>>(static_cast<uint4*>(r->local[2]), n_vec, word);
  FUSEDAR_CUDA_TRY(cudaGetLastError(), "launching the Lamport initialisation", r->device);
  // Everything must be in place before any peer's first launch can write to us.
  FUSEDAR_CUDA_TRY(cudaDeviceSynchronize(), "initialising the workspace", r->device);
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_destroy(fusedar_rank* r) {
  if (r == nullptr) return FUSEDAR_OK;
  DeviceGuard guard(r->device);
  std::string first_error;
  auto note = [&](cudaError_t err, const char* what) {
    if (err != cudaSuccess && first_error.empty()) {
      first_error = std::string(what) + ": " + cudaGetErrorString(err);
    }
  };
  if (guard.status() == cudaSuccess) {
    // Kernels still in flight may read peer memory: drain before unmapping.
    note(cudaDeviceSynchronize(), "synchronising before destroy");
    for (auto& peer : r->peers) {
      for (int b = 0; b < FUSEDAR_SHARED_BUFFERS; ++b) {
        if (peer.ipc[b]) note(cudaIpcCloseMemHandle(peer.ptr[b]), "closing an IPC mapping");
      }
    }
    for (void*& p : r->local) {
      if (p) note(cudaFree(p), "freeing a shared buffer");
    }
    if (r->control) note(cudaFree(r->control), "freeing the control block");
    if (r->table) note(cudaFree(r->table), "freeing the pointer table");
    if (r->large) {
      fusedar::kernels::large::destroy_resources(r->large);
      delete r->large;
      r->large = nullptr;
    }
    if (r->record) note(cudaFreeHost(r->record), "freeing the failure record");
    fusedar::handshake::release(r, &first_error);
  } else {
    first_error = "cannot select device " + std::to_string(r->device);
  }
  delete r;
  if (!first_error.empty()) return fail(FUSEDAR_CUDA_ERROR, "destroy: " + first_error);
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_device(const fusedar_rank* r) { return r ? r->device : -1; }
extern "C" int fusedar_rank_index(const fusedar_rank* r) { return r ? r->rank : -1; }
extern "C" uint64_t fusedar_rank_workspace_table(const fusedar_rank* r) {
  return r ? reinterpret_cast<uint64_t>(r->table) : 0;
}
extern "C" int fusedar_rank_info(const fusedar_rank* r, fusedar_workspace_info* info) {
  if (r == nullptr || info == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  *info = r->info;
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_set_timeout(fusedar_rank* r, double timeout_s) {
  if (r == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "rank is null");
  if (!(timeout_s >= 0.0 && timeout_s <= FUSEDAR_MAX_TIMEOUT_S)) {  // NaN fails too
    return fail(FUSEDAR_INVALID_ARGUMENT,
                "timeout_s must be in [0, " + std::to_string(int(FUSEDAR_MAX_TIMEOUT_S)) +
                    "] seconds (0: wait forever), got " + std::to_string(timeout_s));
  }
  r->timeout_ns = static_cast<uint64_t>(std::llround(timeout_s * 1e9));
  if (r->table != nullptr) {
    // Finalized: update the copy the kernels read. An aligned 8-byte store; a kernel
    // running meanwhile sees the old or the new value, either is fine.
    DeviceGuard guard(r->device);
    FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", r->device);
    FUSEDAR_CUDA_TRY(cudaMemcpy(&r->control->timeout_ns, &r->timeout_ns, sizeof(uint64_t),
                                cudaMemcpyHostToDevice),
                     "updating the timeout", r->device);
  }
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_timeout(const fusedar_rank* r, double* timeout_s) {
  if (r == nullptr || timeout_s == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  *timeout_s = r->timeout_ns * 1e-9;
  return FUSEDAR_OK;
}
