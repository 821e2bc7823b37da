// Standalone check and timing of the large-message algorithm against FlashInfer's one-shot and
// two-shot kernels, two GPUs driven from one process (no Python, no core library): the quick
// loop for kernel work. Build here, run on a 2-GPU machine:
//
//   nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr \
//     -gencode=arch=compute_90a,code=sm_90a -DFLASHINFER_ENABLE_BF16 -DFLASHINFER_ENABLE_F16 \
//     -DFLASHINFER_ENABLE_FP8_E4M3 -DFLASHINFER_ENABLE_FP8_E5M2 -DFLASHINFER_ENABLE_FP4_E2M1 \
//     -Ithird_party/flashinfer/include -Iffi/kernels -Iffi/core/include \
//     tools/large_message_bench.cu ffi/kernels/large_resources.cu -o .carry/large_message_bench
//   .carry/large_message_bench [sweep|decode]
//
// Prints, per size: bit mismatches of the new path against FlashInfer's two-shot (residual_out,
// norm_out), whether both ranks agree bit for bit, and the median time per call (CUDA-graph
// replay of 20 calls, device events) of: the new path at several chunk counts, FlashInfer
// one-shot, two-shot, and the copy-engine floor (the same bytes as memcpys only).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "large_message.cuh"

namespace fi = flashinfer::trtllm_allreduce_fusion;
namespace lg = fusedar::kernels::large;
using T = __nv_bfloat16;
constexpr int N = 2;
constexpr auto kPattern = fi::AllReduceFusionPattern::kARResidualRMSNorm;

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

__global__ void fill_random(T* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; x *= 3266489917u; x ^= x >> 16;
    p[i] = __float2bfloat16((x & 0xffffff) / float(0x800000) - 1.0f);
  }
}
__global__ void fill_word(uint32_t* p, int64_t n, uint32_t w) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = w;
}
__global__ void count_diff(const uint16_t* a, const uint16_t* b, int64_t n,
                           unsigned long long* out) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    c += a[i] != b[i];
  atomicAdd(out, c);
}
__global__ void empty_kernel() {}

// One-way NVLink flag latency: rank 0 raises a flag in rank 1, which answers in rank 0, `rounds`
// times; the round trips over 2 * rounds give the time a peer takes to see a flag.
__global__ void ping_pong(unsigned int* mine, unsigned int* peer, int rounds, int first,
                          unsigned long long* elapsed_ns) {
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (int i = 1; i <= rounds; ++i) {
    if (first) {
      asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(peer), "r"(unsigned(i)) : "memory");
      while (fusedar::kernels::large::load_acquire_sys(mine) != unsigned(i)) {}
    } else {
      while (fusedar::kernels::large::load_acquire_sys(mine) != unsigned(i)) {}
      asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(peer), "r"(unsigned(i)) : "memory");
    }
  }
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  *elapsed_ns = t1 - t0;
}

constexpr int kMaxTok = 8192, kMaxHidden = 8192;

struct Rank {
  int dev;
  cudaStream_t s;
  T *in, *res, *gamma;
  T* out[4][2];  // algo x {residual_out, norm_out}
  char* twoshot;
  int* flags_fi;
  lg::Flags* flags_large;
  char* lamport;
  int* control;
  void** table;
  lg::Resources res_large;
  unsigned long long* diff;
};
Rank R[N];
int64_t lamport_comm_bytes;

void setup() {
  const int64_t maxe = int64_t(kMaxTok) * kMaxHidden;
  lamport_comm_bytes = N * maxe * 2;
  for (int r = 0; r < N; ++r) {
    Rank& k = R[r];
    k.dev = r;
    CK(cudaSetDevice(r));
    for (int p = 0; p < N; ++p)
      if (p != r) {
        cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
        if (e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
        (void)cudaGetLastError();
      }
    CK(cudaStreamCreateWithFlags(&k.s, cudaStreamNonBlocking));
    CK(cudaMalloc(&k.in, maxe * 2));
    CK(cudaMalloc(&k.res, maxe * 2));
    CK(cudaMalloc(&k.gamma, kMaxHidden * 2));
    for (auto& o : k.out)
      for (auto& x : o) CK(cudaMalloc(&x, maxe * 2));
    CK(cudaMalloc(&k.twoshot, N * maxe * 2));
    CK(cudaMalloc(&k.flags_fi, 256 * N * 4));
    CK(cudaMemset(k.flags_fi, 0, 256 * N * 4));
    CK(cudaMalloc(&k.flags_large, sizeof(lg::Flags)));
    CK(cudaMemset(k.flags_large, 0, sizeof(lg::Flags)));
    CK(cudaMalloc(&k.lamport, 3 * lamport_comm_bytes));
    fill_word<<<1024, 256>>>((uint32_t*)k.lamport, 3 * lamport_comm_bytes / 4, 0x80008000u);
    CK(cudaMalloc(&k.control, 5 * 4));
    int ctl[5] = {0, 0, 0, int(lamport_comm_bytes), 0};
    CK(cudaMemcpy(k.control, ctl, sizeof(ctl), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&k.table, (3 * N + 1) * sizeof(void*)));
    CK(cudaMalloc(&k.diff, 8));
    CK(lg::create_resources(&k.res_large, r));
  }
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    std::vector<void*> t(3 * N + 1);
    for (int p = 0; p < N; ++p) {
      t[p] = R[p].twoshot;
      t[N + p] = R[p].flags_fi;
      t[2 * N + p] = R[p].lamport;
      R[r].res_large.flags.rank[p] = R[p].flags_large;
      R[r].res_large.buffers[p] = R[p].twoshot;
    }
    t[3 * N] = R[r].control;
    CK(cudaMemcpy(R[r].table, t.data(), t.size() * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
  }
}

std::vector<int> g_weights = {1, 1, 1, 1};


// algo: 0 large-message, 1 FI one-shot, 2 FI two-shot,
// 3 copy-engine floor (memcpys only), 4 empty kernel
void launch(int algo, int r, int64_t M, int64_t H, int chunks) {
  Rank& k = R[r];
  fi::AllReduceFusionParams<T> p{};
  p.nranks = N;
  p.rank = r;
  p.size = int(M * H);
  p.hidden_dim = int(H);
  p.workspace = k.table;
  p.allreduce_in = k.in;
  p.residual_in = k.res;
  int o = algo == 0 ? 0 : algo;
  p.residual_out = k.out[o][0];
  p.norm_out = k.out[o][1];
  p.rms_gamma = k.gamma;
  p.rms_eps = 1e-6f;
  p.weight_bias = 0.f;
  p.use_oneshot = algo == 1;
  p.stream = k.s;
  p.pattern = kPattern;
  p.trigger_completion_at_end = true;
  if (algo == 0) {
    const lg::Resources& res = k.res_large;
    std::vector<int> w = g_weights;
    if (chunks > 0) w.assign(chunks, 1);
    lg::Schedule sched = lg::make_schedule(w.data(), int(w.size()));
    CK((lg::launch_large<kPattern, T, N, true>(p, res, sched)));
  } else if (algo == 3) {
    // The scatter and gather bytes of the new path, as plain peer copies on two streams.
    const int64_t half = M / N * H * 2;
    const lg::Resources& res = k.res_large;
    CK(cudaEventRecord(res.fork, k.s));
    CK(cudaStreamWaitEvent(res.copy, res.fork, 0));
    CK(cudaStreamWaitEvent(res.gather, res.fork, 0));
    for (int c = 0; c < chunks; ++c) {
      int64_t b = half * c / chunks, e = half * (c + 1) / chunks;
      CK(cudaMemcpyAsync(R[1 - r].twoshot + b, (char*)k.in + b, e - b, cudaMemcpyDeviceToDevice,
                         res.copy));
      CK(cudaMemcpyAsync(R[1 - r].twoshot + half + b, (char*)k.in + half + b, e - b,
                         cudaMemcpyDeviceToDevice, res.gather));
    }
    CK(cudaEventRecord(res.copy_done, res.copy));
    CK(cudaEventRecord(res.gather_done, res.gather));
    CK(cudaStreamWaitEvent(k.s, res.copy_done, 0));
    CK(cudaStreamWaitEvent(k.s, res.gather_done, 0));
  } else if (algo == 4) {
    empty_kernel<<<1, 32, 0, k.s>>>();
  } else if (algo == 8) {
    // One-shot without PDL (the default launches with it, as the JAX path does).
    CK((fi::allreduce_fusion_kernel_launcher<kPattern, T, N, true>(p, false)));
  } else {
    CK((fi::allreduce_fusion_kernel_launcher<kPattern, T, N, true>(p, true)));
  }
}

float time_algo(int algo, int64_t M, int64_t H, int chunks, int iters = 20, int reps = 7) {
  cudaGraphExec_t exec[N];
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(R[r].s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < iters; ++i) launch(algo, r, M, H, chunks);
    CK(cudaStreamEndCapture(R[r].s, &g));
    CK(cudaGraphInstantiate(&exec[r], g, 0));
    CK(cudaGraphDestroy(g));
  }
  std::vector<float> t;
  cudaEvent_t a[N], b[N];
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaEventCreate(&a[r]));
    CK(cudaEventCreate(&b[r]));
  }
  for (int rep = 0; rep < reps + 1; ++rep) {
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(r));
      CK(cudaEventRecord(a[r], R[r].s));
      CK(cudaGraphLaunch(exec[r], R[r].s));
      CK(cudaEventRecord(b[r], R[r].s));
    }
    float ms0 = 0;
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(r));
      CK(cudaEventSynchronize(b[r]));
      float ms;
      CK(cudaEventElapsedTime(&ms, a[r], b[r]));
      if (r == 0) ms0 = ms;
    }
    if (rep > 0) t.push_back(ms0 * 1000.f / iters);
  }
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaGraphExecDestroy(exec[r]));
    CK(cudaEventDestroy(a[r]));
    CK(cudaEventDestroy(b[r]));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Eager launches (no graph): shows whether the host keeps up.
float time_eager(int algo, int64_t M, int64_t H, int chunks, int iters = 20) {
  cudaEvent_t a[N], b[N];
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaEventCreate(&a[r]));
    CK(cudaEventCreate(&b[r]));
    CK(cudaEventRecord(a[r], R[r].s));
  }
  for (int i = 0; i < iters; ++i)
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(r));
      launch(algo, r, M, H, chunks);
    }
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaEventRecord(b[r], R[r].s));
  }
  float ms;
  CK(cudaSetDevice(0));
  CK(cudaEventSynchronize(b[0]));
  CK(cudaEventElapsedTime(&ms, a[0], b[0]));
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    CK(cudaStreamSynchronize(R[r].s));
  }
  return ms * 1000.f / iters;
}

unsigned long long diff(int r, const T* x, const T* y, int64_t n) {
  CK(cudaSetDevice(R[r].dev));
  CK(cudaMemset(R[r].diff, 0, 8));
  count_diff<<<1024, 256>>>((const uint16_t*)x, (const uint16_t*)y, n, R[r].diff);
  unsigned long long h;
  CK(cudaMemcpy(&h, R[r].diff, 8, cudaMemcpyDeviceToHost));
  return h;
}

void check(int64_t M, int64_t H, int chunks, uint32_t seed) {
  for (int r = 0; r < N; ++r) {
    CK(cudaSetDevice(r));
    fill_random<<<1024, 256>>>(R[r].in, M * H, seed + 17 * r);
    fill_random<<<1024, 256>>>(R[r].res, M * H, seed + 1000);  // replicated residual
    fill_random<<<64, 256>>>(R[r].gamma, H, seed + 2000);
    for (int a = 0; a < 3; ++a)
      for (int x = 0; x < 2; ++x) CK(cudaMemset(R[r].out[a][x], 0xff, M * H * 2));  // NaN poison
    CK(cudaDeviceSynchronize());
  }
  for (int algo : {0, 2, 1}) {
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(r));
      launch(algo, r, M, H, chunks);
    }
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(r));
      CK(cudaStreamSynchronize(R[r].s));
    }
  }
  // Rank agreement of the new path: copy rank 1's outputs to rank 0 and compare.
  CK(cudaSetDevice(0));
  T* tmp;
  CK(cudaMalloc(&tmp, M * H * 2 * 2));
  CK(cudaMemcpyPeer(tmp, 0, R[1].out[0][0], 1, M * H * 2));
  CK(cudaMemcpyPeer(tmp + M * H, 0, R[1].out[0][1], 1, M * H * 2));
  unsigned long long ranks = diff(0, tmp, R[0].out[0][0], M * H) + diff(0, tmp + M * H, R[0].out[0][1], M * H);
  CK(cudaFree(tmp));
  printf("check M=%lld H=%lld chunks=%d: vs two-shot res %llu norm %llu | vs one-shot res %llu norm %llu | "
         "two-shot vs one-shot norm %llu | rank1 vs rank0 %llu\n",
         (long long)M, (long long)H, chunks, diff(0, R[0].out[0][0], R[0].out[2][0], M * H),
         diff(0, R[0].out[0][1], R[0].out[2][1], M * H) + diff(1, R[1].out[0][1], R[1].out[2][1], M * H),
         diff(0, R[0].out[0][0], R[0].out[1][0], M * H), diff(0, R[0].out[0][1], R[0].out[1][1], M * H),
         diff(0, R[0].out[2][1], R[0].out[1][1], M * H), ranks);
}

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "sweep";
  setup();
  if (mode == "decode") {
    // Where the time of a decode-size call goes (CUDA-graph replay of 50 back-to-back calls).
    for (int64_t H : {4096, 8192}) {
      for (int64_t M : {1, 16, 128}) {
        printf("decode M=%lld H=%lld: one-shot %.2f us (no PDL %.2f), two-shot %.2f us, empty kernel "
               "%.2f us\n",
               (long long)M, (long long)H, time_algo(1, M, H, 0, 50), time_algo(8, M, H, 0, 50),
               M > N ? time_algo(2, M, H, 0, 50) : 0.f, time_algo(4, M, H, 0, 50));
      }
    }
    unsigned int* flag[N];
    unsigned long long* ns[N];
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(r));
      CK(cudaMalloc(&flag[r], 4));
      CK(cudaMemset(flag[r], 0, 4));
      CK(cudaMalloc(&ns[r], 8));
      CK(cudaDeviceSynchronize());
    }
    const int rounds = 1000;
    for (int r = 0; r < N; ++r) {
      CK(cudaSetDevice(r));
      ping_pong<<<1, 1, 0, R[r].s>>>(flag[r], flag[1 - r], rounds, r == 0, ns[r]);
    }
    unsigned long long h = 0;
    CK(cudaSetDevice(0));
    CK(cudaStreamSynchronize(R[0].s));
    CK(cudaMemcpy(&h, ns[0], 8, cudaMemcpyDeviceToHost));
    printf("NVLink flag one-way latency (ping-pong, %d round trips): %.2f us\n", rounds,
           h / 1000.0 / (2.0 * rounds));
    return 0;
  }
  check(4096, 8192, 8, 1);
  check(4096, 8192, 3, 2);
  check(1000, 4096, 4, 3);
  check(8191, 8192, 16, 4);
  g_weights = {1, 2, 4, 4, 2, 1};
  check(1024, 7168, 0, 5);
  printf("eager large 4096x8192 U4 kernel flags: %.1f us/call\n", time_eager(0, 4096, 8192, 4));
  struct V { const char* name; int algo; std::vector<int> w; };
  const std::vector<V> vs = {
      {"U4", 0, {1, 1, 1, 1}}, {"U2", 0, {1, 1}}, {"U3", 0, {1, 1, 1}}, {"U8", 0, {1, 1, 1, 1, 1, 1, 1, 1}}};
  printf("%6s %6s |", "M", "H");
  for (auto& v : vs) printf(" %7s", v.name);
  printf(" | %7s %7s | %7s\n", "oneshot", "twoshot", "CEfloor");
  for (int64_t H : {4096, 8192}) {
    for (int64_t M : {1024, 2048, 4096, 8192}) {
      printf("%6lld %6lld |", (long long)M, (long long)H);
      for (auto& v : vs) {
        g_weights = v.w;
        printf(" %7.1f", time_algo(v.algo, M, H, 0));
        fflush(stdout);
      }
      printf(" | %7.1f %7.1f | %7.1f\n", time_algo(1, M, H, 0), time_algo(2, M, H, 0), time_algo(3, M, H, 1));
      fflush(stdout);
    }
  }
  return 0;
}
