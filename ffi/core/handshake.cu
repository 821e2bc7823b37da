// The opt-in cross-rank handshake: handshake kernel, its host launch and the C API.
// Protocol and memory layout: handshake.h.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "device_guard.h"
#include "handshake.h"
#include "status.h"

namespace fusedar::handshake {
namespace {

using watchdog::kWaitTimeout;

struct Slot {
  unsigned long long seq;
  unsigned long long sig[3];
};
static_assert(sizeof(Slot) == kSlotBytes, "slot layout");

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void st_relaxed_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.global.relaxed.sys.b64 [%1], %0;" ::"l"(v), "l"(p) : "memory");
}

__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.global.release.sys.b64 [%1], %0;" ::"l"(v), "l"(p) : "memory");
}

__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.global.acquire.sys.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long ld_relaxed_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.global.relaxed.sys.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__host__ __device__ const char* dtype_name(unsigned code) {
  switch (code) {
    case FUSEDAR_FLOAT32: return "float32";
    case FUSEDAR_FLOAT16: return "float16";
    case FUSEDAR_BFLOAT16: return "bfloat16";
  }
  return "dtype?";
}

// The decoded fields of a signature, in the order the messages print them.
#define FUSEDAR_SIG_FMT                                                            \
  "{pattern=%u dtype=%s num_tokens=%llu hidden_dim=%llu %s fp32_acc=%u layout=%u " \
  "block_quant_group_size=%u}"
#define FUSEDAR_SIG_ARGS(s)                                                                      \
  unsigned((s)[0] & 0xff), dtype_name(unsigned(((s)[0] >> 8) & 0xff)), (s)[1], (s)[2],           \
      (((s)[0] >> 16) & 1) ? "one-shot" : ((((s)[0] >> 18) & 1) ? "large-message" : "two-shot"), \
      unsigned(((s)[0] >> 17) & 1), unsigned(((s)[0] >> 24) & 0xff), unsigned((s)[0] >> 32)

__global__ void __launch_bounds__(32)
    handshake_kernel(void* const* table, int n, int rank, int device, long long offset,
                     unsigned long long* seq_ptr, Signature mine, unsigned long long timeout_ns,
                     Record* diag) {
  __shared__ unsigned long long s_seq;
  __shared__ int s_abort;
  __shared__ int s_kind[kMaxWorld];
  __shared__ unsigned long long s_seen[kMaxWorld];
  __shared__ unsigned long long s_waited[kMaxWorld];
  __shared__ unsigned long long s_theirs[kMaxWorld][3];
  const int p = threadIdx.x;
  if (p == 0) {
    s_seq = *seq_ptr + 1;
    *seq_ptr = s_seq;
    s_abort = 0;
  }
  __syncthreads();
  const unsigned long long seq = s_seq;
  const long long bank = static_cast<long long>(seq & 1);
  const unsigned long long my_sig[3] = {mine.word, mine.num_tokens, mine.hidden_dim};
  if (p < n) {
    const unsigned long long t0 = global_timer_ns();
    // Our slot in peer p's area (p == rank: our own area).
    Slot* dst =
        reinterpret_cast<Slot*>(static_cast<char*>(table[n + p]) + offset) + bank * n + rank;
    for (int i = 0; i < 3; ++i) st_relaxed_sys(&dst->sig[i], my_sig[i]);
    st_release_sys(&dst->seq, seq);
    // Peer p's slot in our area.
    Slot* base = reinterpret_cast<Slot*>(static_cast<char*>(table[n + rank]) + offset);
    const Slot* src = base + bank * n + p;
    int kind = kNone;
    unsigned long long seen = 0, now = t0;
    while (true) {
      seen = ld_acquire_sys(&src->seq);
      if (seen == seq) break;
      if (seen > seq) {
        kind = kOutOfStep;
        break;
      }
      now = global_timer_ns();
      if (now - t0 > timeout_ns) {
        kind = kTimeout;
        // The latest call number this peer reached: the other bank may be one ahead.
        const unsigned long long other = ld_acquire_sys(&(base + (bank ^ 1) * n + p)->seq);
        seen = other > seen ? other : seen;
        break;
      }
      if (*static_cast<volatile int*>(&s_abort)) {
        kind = -1;  // another peer already failed: stop waiting, report that one
        break;
      }
      __nanosleep(200);
    }
    for (int i = 0; i < 3; ++i) s_theirs[p][i] = 0;
    if (kind == kNone) {
      for (int i = 0; i < 3; ++i) {
        s_theirs[p][i] = ld_relaxed_sys(&src->sig[i]);
        if (s_theirs[p][i] != my_sig[i]) kind = kMismatch;
      }
    }
    if (kind > 0) *static_cast<volatile int*>(&s_abort) = 1;
    s_kind[p] = kind;
    s_seen[p] = seen;
    s_waited[p] = now - t0;
  }
  __syncthreads();
  if (p != 0 || s_abort == 0) return;
  int first = -1, failing = 0;
  for (int q = 0; q < n; ++q) {
    if (s_kind[q] <= 0) continue;
    ++failing;
    if (first < 0) first = q;
    if (s_kind[q] == kMismatch) {
      printf(
          "jax_fusedar handshake FAILED on rank %d of %d (device %d), call #%llu: rank %d "
          "called " FUSEDAR_SIG_FMT " but rank %d called " FUSEDAR_SIG_FMT
          ". Every rank must make the same sequence of fused all-reduce calls (same "
          "pattern, dtype, shape and one-shot choice). Trapping so that the stream fails "
          "instead of hanging.\n",
          rank, n, device, seq, q, FUSEDAR_SIG_ARGS(s_theirs[q]), rank, FUSEDAR_SIG_ARGS(my_sig));
    } else if (s_kind[q] == kTimeout) {
      printf(
          "jax_fusedar handshake FAILED on rank %d of %d (device %d), call #%llu " FUSEDAR_SIG_FMT
          ": rank %d did not make its call #%llu within %.1f s (the last call seen from it is "
          "#%llu). A rank skipped or added a call, stopped, or created the workspace without "
          "handshake. Trapping so that the stream fails instead of hanging.\n",
          rank, n, device, seq, FUSEDAR_SIG_ARGS(my_sig), q, seq, timeout_ns * 1e-9, s_seen[q]);
    } else {
      printf(
          "jax_fusedar handshake FAILED on rank %d of %d (device %d): rank %d is at call "
          "#%llu while this rank is at #%llu; the ranks' call counts diverged. Trapping.\n",
          rank, n, device, q, s_seen[q], seq);
    }
  }
  volatile Record* d = diag;
  d->site = watchdog::kHandshake;
  d->detail = 0;
  d->rank = rank;
  d->world = n;
  d->device = device;
  d->peer = first;
  d->failing_peers = failing;
  d->seq = seq;
  d->peer_seq = s_seen[first];
  for (int i = 0; i < 3; ++i) {
    d->mine[i] = my_sig[i];
    d->theirs[i] = s_theirs[first][i];
  }
  d->waited_ns = s_waited[first];
  d->timeout_ns = timeout_ns;
  __threadfence_system();
  d->kind = s_kind[first];
  __threadfence_system();
  __trap();
}

std::string describe_signature(const unsigned long long s[3]) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), FUSEDAR_SIG_FMT, FUSEDAR_SIG_ARGS(s));
  return buf;
}

// What the peer (or this rank's own grid) did not deliver, with the site's detail.
std::string site_text(int site, int detail) {
  const std::string d = std::to_string(detail);
  switch (site) {
    case watchdog::kLamport:
      return "its one-shot data in this rank's Lamport buffer (token " + d + ")";
    case watchdog::kBarrier: return "its two-shot barrier flag (thread block " + d + ")";
    case watchdog::kGrid: return "this rank's own thread blocks (grid counter)";
    case watchdog::kLargeEnter:
      return "its large-message entry flag (large-message call " + d + " of this rank)";
    case watchdog::kLargeScatter:
      return "its large-message chunk " + d +
             " scatter flag (its input rows of this rank's "
             "slice)";
    case watchdog::kLargeGather:
      return "its large-message chunk " + d + " gather flag (its reduced rows)";
  }
  return "an unknown wait (site " + std::to_string(site) + ")";
}

// A wait of the fused kernel (FlashInfer's or the large-message algorithm's, bounded by the
// workspace's timeout) expired.
std::string wait_timeout_text(const Record& d, const unsigned long long mine[3]) {
  char secs[64];
  std::snprintf(secs, sizeof(secs), "%.1f s (timeout %.1f s)", d.waited_ns * 1e-9,
                d.timeout_ns * 1e-9);
  std::string who = d.peer >= 0 ? "rank " + std::to_string(d.peer) : std::string("no peer");
  const std::string where = site_text(d.site, d.detail);
  return "jax_fusedar kernel wait timed out on rank " + std::to_string(d.rank) + " of " +
         std::to_string(d.world) + " (device " + std::to_string(d.device) + "), call #" +
         std::to_string(d.seq) + " " + describe_signature(mine) + ": waited " + secs + " for " +
         who + " to deliver " + where + ". " +
         (d.peer >= 0 ? "Rank " + std::to_string(d.peer) + " did not arrive: it" : "A rank") +
         " skipped or added a call, stopped or died, or called with another pattern, shape "
         "or algorithm (one-shot, two-shot, large-message). The kernel trapped, so this "
         "device's CUDA context is unusable: restart the process. (timeout_s on the workspace "
         "or $JAX_FUSEDAR_TIMEOUT_S sets the limit; 0 waits forever.)";
}

}  // namespace

Signature signature_of(const fusedar_launch_args& a) {
  Signature s;
  s.word = (static_cast<unsigned long long>(a.pattern) & 0xff) |
           ((static_cast<unsigned long long>(a.dtype) & 0xff) << 8) |
           (static_cast<unsigned long long>(a.algorithm == FUSEDAR_ALGORITHM_ONESHOT) << 16) |
           (static_cast<unsigned long long>(a.algorithm == FUSEDAR_ALGORITHM_LARGE_MESSAGE) << 18) |
           (static_cast<unsigned long long>(a.fp32_acc ? 1 : 0) << 17) |
           ((static_cast<unsigned long long>(a.layout) & 0xff) << 24) |
           (static_cast<unsigned long long>(static_cast<uint32_t>(a.block_quant_group_size)) << 32);
  s.num_tokens = static_cast<unsigned long long>(a.num_tokens);
  s.hidden_dim = static_cast<unsigned long long>(a.hidden_dim);
  return s;
}

int enable(fusedar_rank* r, bool enabled, double timeout_s) {
  if (enabled) {
    if (!(timeout_s > 0.0 && timeout_s <= 3600.0)) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "handshake timeout must be in (0, 3600] seconds, got " +
                                                std::to_string(timeout_s));
    }
    DeviceGuard guard(r->device);
    FUSEDAR_CUDA_TRY(guard.status(), "selecting the device", r->device);
    if (r->check_seq == nullptr) {
      FUSEDAR_CUDA_TRY(cudaMalloc(&r->check_seq, sizeof(unsigned long long)),
                       "allocating the handshake counter", r->device);
    }
    r->handshake_timeout_ns = static_cast<uint64_t>(std::llround(timeout_s * 1e9));
  }
  r->handshake = enabled;
  return FUSEDAR_OK;
}

cudaError_t reset(fusedar_rank* r) {
  if (!r->handshake) return cudaSuccess;
  return cudaMemset(r->check_seq, 0, sizeof(unsigned long long));
}

void release(fusedar_rank* r, std::string* first_error) {
  auto note = [&](cudaError_t err, const char* what) {
    if (err != cudaSuccess && first_error->empty()) {
      *first_error = std::string(what) + ": " + cudaGetErrorString(err);
    }
  };
  if (r->check_seq) note(cudaFree(r->check_seq), "freeing the handshake counter");
  r->check_seq = nullptr;
}

cudaError_t launch(const fusedar_rank* r, const fusedar_launch_args& a, cudaStream_t stream) {
  handshake_kernel<<<1, 32, 0, stream>>>(
      r->table, r->info.world_size, r->rank, r->device, area_offset(r->info), r->check_seq,
      signature_of(a), r->handshake_timeout_ns, static_cast<Record*>(r->record_device));
  return cudaGetLastError();
}

std::string failure(const fusedar_rank* r) {
  if (r->record == nullptr) return {};
  const volatile Record* d = static_cast<const volatile Record*>(r->record);
  const int kind = d->kind;
  if (kind == kNone) return {};
  std::atomic_thread_fence(std::memory_order_acquire);
  unsigned long long mine[3], theirs[3];
  for (int i = 0; i < 3; ++i) {
    mine[i] = d->mine[i];
    theirs[i] = d->theirs[i];
  }
  if (kind == kWaitTimeout) return wait_timeout_text(*const_cast<const Record*>(d), mine);
  const std::string head = "jax_fusedar handshake failed on rank " + std::to_string(d->rank) +
                           " of " + std::to_string(d->world) + " (device " +
                           std::to_string(d->device) + "), call #" + std::to_string(d->seq) + ": ";
  std::string msg;
  if (kind == kMismatch) {
    msg = head + "rank " + std::to_string(d->peer) + " called " + describe_signature(theirs) +
          " but rank " + std::to_string(d->rank) + " called " + describe_signature(mine) +
          "; every rank must make the same sequence of fused all-reduce calls (same pattern, "
          "dtype, shape and one-shot choice)";
  } else if (kind == kTimeout) {
    char secs[32];
    std::snprintf(secs, sizeof(secs), "%.1f", d->timeout_ns * 1e-9);
    msg = head + "rank " + std::to_string(d->peer) + " did not make its call #" +
          std::to_string(d->seq) + " " + describe_signature(mine) + " within " + secs +
          " s (the last call seen from it is #" + std::to_string(d->peer_seq) +
          "); a rank skipped or added a call, stopped, or created the workspace without "
          "handshake";
  } else {
    msg = head + "rank " + std::to_string(d->peer) + " is at call #" + std::to_string(d->peer_seq) +
          "; the ranks' call counts diverged";
  }
  if (d->failing_peers > 1) {
    msg += " (" + std::to_string(d->failing_peers) +
           " ranks failed the check; see the "
           "device printf output for each)";
  }
  return msg +
         ". The handshake trapped, so this device's CUDA context is unusable: restart "
         "the process.";
}

}  // namespace fusedar::handshake

using fusedar::fail;

extern "C" int fusedar_rank_set_call_check(fusedar_rank* r, int32_t enabled, double timeout_s) {
  if (r == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "rank is null");
  if (r->table != nullptr) {
    return fail(FUSEDAR_INVALID_ARGUMENT,
                "the handshake must be set before the workspace is finalized");
  }
  return fusedar::handshake::enable(r, enabled != 0, timeout_s);
}

extern "C" int fusedar_rank_call_check(const fusedar_rank* r, int32_t* enabled, double* timeout_s) {
  if (r == nullptr || enabled == nullptr || timeout_s == nullptr) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  }
  *enabled = r->handshake ? 1 : 0;
  *timeout_s = r->handshake ? r->handshake_timeout_ns * 1e-9 : 0.0;
  return FUSEDAR_OK;
}

extern "C" int fusedar_rank_call_check_failure(const fusedar_rank* r, char* buf, size_t len) {
  return fusedar_rank_failure(r, buf, len);
}

extern "C" int fusedar_rank_failure(const fusedar_rank* r, char* buf, size_t len) {
  if (r == nullptr || buf == nullptr || len == 0) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  }
  const std::string msg = fusedar::handshake::failure(r);
  const size_t n = std::min(msg.size(), len - 1);
  std::memcpy(buf, msg.data(), n);
  buf[n] = '\0';
  return FUSEDAR_OK;
}
