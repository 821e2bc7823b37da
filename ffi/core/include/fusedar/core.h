// jax_fusedar native core: a framework-neutral C API around FlashInfer's fused
// all-reduce (+ residual add + RMSNorm) kernel.
//
// Nothing here knows about JAX, XLA or torch. The XLA FFI handlers (ffi/xla) and the
// Python module (ffi/python, used by jax_fusedar and torch_compat) are thin callers.
// A C ABI (not C++) keeps the core usable from binaries built with other compilers:
// the heavy CUDA library is built once and the small Python-specific parts are
// built wherever they run.
//
// Error convention: every function returns 0 on success and a non-zero code on
// failure; fusedar_last_error() then returns a message for the calling thread.
#ifndef FUSEDAR_CORE_H_
#define FUSEDAR_CORE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// The library is built with hidden visibility; only this C API is exported.
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

// Bumped whenever the C API changes (functions or struct layouts); the nanobind module
// refuses a core whose fusedar_abi_version() differs from the header it was built with.
// 2 added the MoE entry points (fusedar_moe_launch_args, fusedar_check_moe_launch,
// fusedar_moe_launch); 3 replaced fusedar_launch_args.use_oneshot by `algorithm`
// (fusedar_algorithm, with the large-message algorithm); 4 added fusedar_moe_shape_check.
#define FUSEDAR_ABI_VERSION 4
#define FUSEDAR_IPC_HANDLE_BYTES 64
// Each rank shares three buffers with its peers: two-shot data, barrier flags and
// the Lamport (one-shot) triple buffer; the layout is in docs/architecture.md.
#define FUSEDAR_SHARED_BUFFERS 3

typedef enum {
  FUSEDAR_OK = 0,
  FUSEDAR_INVALID_ARGUMENT = 1,
  FUSEDAR_CUDA_ERROR = 2,
  FUSEDAR_UNSUPPORTED = 3,
  FUSEDAR_INTERNAL = 4,
} fusedar_status;

// Element types, numbered like the dtype switch of the kernel's own wrapper.
typedef enum {
  FUSEDAR_FLOAT32 = 0,
  FUSEDAR_FLOAT16 = 1,
  FUSEDAR_BFLOAT16 = 2,
} fusedar_dtype;

// Opaque per-rank state: the buffers this process owns for one TP rank on one
// device, the peer mappings, and the device-resident pointer table.
typedef struct fusedar_rank fusedar_rank;

typedef struct {
  int32_t world_size;
  int32_t max_token_num;
  int32_t hidden_dim;
  int32_t dtype;  // fusedar_dtype of the calls this workspace serves
  int64_t two_shot_buffer_bytes;
  int64_t flag_bytes;
  int64_t lamport_comm_bytes;    // stride between the three Lamport sub-buffers
  int64_t lamport_buffer_bytes;  // 3 * lamport_comm_bytes
} fusedar_workspace_info;

// How a call moves its data. 0 and 1 are FlashInfer's kernels; 2 runs reduce-scatter +
// epilogue + all-gather with copy engines (ffi/kernels/large_message.h): the two-shot math, bit
// for bit, faster for large messages.
typedef enum {
  FUSEDAR_ALGORITHM_TWOSHOT = 0,
  FUSEDAR_ALGORITHM_ONESHOT = 1,
  FUSEDAR_ALGORITHM_LARGE_MESSAGE = 2,
} fusedar_algorithm;

typedef struct {
  int32_t pattern;  // FlashInfer AllReduceFusionPattern code
  int32_t dtype;    // fusedar_dtype
  int64_t num_tokens;
  int64_t hidden_dim;
  const void* input;
  void* allreduce_out;
  const void* residual_in;
  void* residual_out;
  void* norm_out;
  void* quant_out;
  void* scale_out;
  const void* rms_gamma;
  const float* scale_factor;  // device pointer (static FP8 / NVFP4 only)
  float rms_eps;
  float weight_bias;  // 0: gamma; 1: (1 + gamma), Gemma style
  // FUSEDAR_ALGORITHM_*: the caller decides (choose_algorithm in
  // jax_fusedar/common/launch_mode.py), so that every rank runs the same algorithm.
  int32_t algorithm;
  int32_t fp32_acc;     // 1: sum ranks in fp32, round once; 0: round after each add
  int32_t layout;       // NVFP4 scale layout code
  int32_t block_quant_group_size;
  // Programmatic dependent launch. Safe either way (the kernel waits on its grid
  // dependency before reading inputs); the JAX path always sets 1.
  int32_t launch_with_pdl;
  // Fire PDL completion at the end of the kernel. 0 lets the next kernel start early,
  // which vLLM saw read unfinished Lamport buffers (NaNs); the JAX path always sets 1.
  int32_t trigger_completion_at_end;
} fusedar_launch_args;

const char* fusedar_last_error(void);
int fusedar_abi_version(void);

// Fills *info with the buffer sizes a workspace of this shape needs.
int fusedar_workspace_sizes(int32_t world_size, int32_t max_token_num, int32_t hidden_dim,
                            int32_t dtype, fusedar_workspace_info* info);

// Allocates this rank's shared buffers and control block on `device`.
int fusedar_rank_create(int32_t device, int32_t world_size, int32_t rank, int32_t max_token_num,
                        int32_t hidden_dim, int32_t dtype, fusedar_rank** out);
// Device pointers of this rank's three shared buffers (for peers in this process).
int fusedar_rank_local_pointers(const fusedar_rank* r, uint64_t out[FUSEDAR_SHARED_BUFFERS]);
// CUDA IPC handles of the three shared buffers (for peers in other processes).
int fusedar_rank_export_ipc(const fusedar_rank* r,
                            uint8_t out[FUSEDAR_SHARED_BUFFERS * FUSEDAR_IPC_HANDLE_BYTES]);
// Peer `peer` lives in this process on device `peer_device`: enables peer access and
// records its raw pointers (cudaIpcOpenMemHandle does not work inside one process).
int fusedar_rank_set_peer_pointers(fusedar_rank* r, int32_t peer, int32_t peer_device,
                                   const uint64_t ptrs[FUSEDAR_SHARED_BUFFERS]);
// Peer `peer` lives in another process: opens its IPC handles.
int fusedar_rank_open_peer_ipc(
    fusedar_rank* r, int32_t peer,
    const uint8_t handles[FUSEDAR_SHARED_BUFFERS * FUSEDAR_IPC_HANDLE_BYTES]);
// Once every peer is known: uploads the 3N+1 pointer table, zeroes the flags, fills the
// Lamport buffers with -0.0 at the dtype's width and synchronises the device. The
// caller must then barrier the group before the first launch.
int fusedar_rank_finalize(fusedar_rank* r);
// Closes IPC mappings and frees this rank's memory. Safe on a partially built rank.
int fusedar_rank_destroy(fusedar_rank* r);

int fusedar_rank_device(const fusedar_rank* r);
int fusedar_rank_index(const fusedar_rank* r);
int fusedar_rank_info(const fusedar_rank* r, fusedar_workspace_info* info);
// Device pointer of the 3N+1 table the kernel reads (0 before finalize).
uint64_t fusedar_rank_workspace_table(const fusedar_rank* r);

// Opt-in cross-rank call check (off unless enabled). When on, every fusedar_launch first
// runs a one-block handshake kernel on the same stream: it advances a device-resident call
// counter (so CUDA-graph replays advance it too), writes {call number, signature} into
// every peer's metadata slot (an area after FlashInfer's barrier flags, allocated for every
// workspace whether checked or not), and waits until every rank's slot shows the same call
// number. A rank whose signature (pattern, dtype, num_tokens, hidden_dim, algorithm,
// fp32_acc, layout, block_quant_group_size) differs, or that does not arrive within
// `timeout_s`, makes the handshake printf a description and __trap(): the stream fails
// with a CUDA error instead of the fused kernel spinning forever. Costs one tiny kernel
// and a cross-GPU round trip per call. Must be set identically on every rank, before
// fusedar_rank_finalize; timeout_s in (0, 3600].
int fusedar_rank_set_call_check(fusedar_rank* r, int32_t enabled, double timeout_s);
int fusedar_rank_call_check(const fusedar_rank* r, int32_t* enabled, double* timeout_s);
// The same as fusedar_rank_failure (the call check and the bounded waits share one
// failure record); kept for existing callers.
int fusedar_rank_call_check_failure(const fusedar_rank* r, char* buf, size_t len);

// Bounded waits, always on: every wait loop of the fused kernel (Lamport polls, barrier
// flags, grid counters) reads the device clock every so many spins; a wait that lasts
// longer than the rank's timeout records what it waited for (call number, pattern, shape,
// the peer that did not arrive, rank, device) in the rank's failure record (pinned host
// memory) and traps, so the stream fails with a CUDA error instead of hanging, and every
// later fusedar_launch on this rank is refused with the recorded text
// (fusedar_rank_failure). Default FUSEDAR_DEFAULT_TIMEOUT_S; 0 waits forever (FlashInfer's
// behaviour). Settable at any time, also after finalize; timeout_s in [0,
// FUSEDAR_MAX_TIMEOUT_S].
#define FUSEDAR_DEFAULT_TIMEOUT_S 30.0
#define FUSEDAR_MAX_TIMEOUT_S 3600.0
int fusedar_rank_set_timeout(fusedar_rank* r, double timeout_s);
int fusedar_rank_timeout(const fusedar_rank* r, double* timeout_s);
// After a failed call: what failed (a timed-out wait of the kernel or a failed call-check
// handshake), written into `buf` (NUL-terminated, truncated to `len`); an empty string
// when nothing failed. Reads pinned host memory only, so it works after the trap has
// killed the CUDA context.
int fusedar_rank_failure(const fusedar_rank* r, char* buf, size_t len);

// Checks a call against the workspace without launching (same checks as launch).
int fusedar_check_launch(const fusedar_rank* r, const fusedar_launch_args* args);
// Launches the fused kernel on `stream` (a cudaStream_t).
int fusedar_launch(const fusedar_rank* r, const fusedar_launch_args* args, void* stream);

// FlashInfer's MoE epilogues (trtllm_moe_allreduce_fusion.cuh) on the same workspace:
//   pattern 6 (kMoEReductionARResidualRMSNorm): per token, the weighted sum of this rank's
//     `num_experts` expert rows plus `token_input`, then all-reduce, residual add, RMSNorm;
//   pattern 7 (kMoEFinalizeARResidualRMSNorm): per token, the gather of its top_k rows of
//     the permuted expert output (index -1 = dropped), each scaled by its router weight,
//     summed, times `routed_scaling_factor`, plus `shared_expert_output`, then all-reduce,
//     residual add, RMSNorm.
// Both are one-shot (Lamport) only, 16-bit only, and need hidden_dim to fill whole warps
// (a multiple of 256 elements): the kernels give each token hidden_dim/8 threads rounded up
// to whole warps, and the spare threads of a partial warp read the next token's row.
// Index values are not read by the core: an index outside [-1, num_permuted_rows) reads
// outside `permuted_input` (the Python layers check them).
typedef struct {
  int32_t pattern;  // 6 or 7
  int32_t dtype;    // FUSEDAR_FLOAT16 or FUSEDAR_BFLOAT16
  int64_t num_tokens;
  int64_t hidden_dim;
  // Pattern 6.
  int32_t num_experts;          // moe_reduction_device_num_experts (>= 1)
  const float* expert_scales;   // [num_experts, num_tokens] float32
  const void* expert_outputs;   // [num_experts, num_tokens, hidden_dim]
  const void* token_input;      // [num_tokens, hidden_dim]
  void* allreduce_out;          // optional [num_tokens, hidden_dim]: the all-reduced sum
  // Pattern 7.
  const void* permuted_input;                   // [num_permuted_rows, hidden_dim]
  int64_t num_permuted_rows;
  const int32_t* expanded_idx_to_permuted_idx;  // [num_tokens, top_k]
  int32_t top_k;
  const void* expert_scale_factor;   // optional [num_tokens, top_k], the call's dtype
  const void* shared_expert_output;  // optional [num_tokens, hidden_dim]
  float routed_scaling_factor;       // 1: not applied
  // Both.
  const void* residual_in;
  void* residual_out;  // optional for pattern 6, required for 7
  void* norm_out;
  const void* rms_gamma;
  float rms_eps;
  float weight_bias;
  int32_t launch_with_pdl;
} fusedar_moe_launch_args;

// The shape rules of an MoE call of `num_tokens` x `hidden_dim` of `dtype` (pattern 6 or 7)
// on a workspace described by `ws` (fusedar_workspace_sizes), without a rank: the 16-bit
// dtypes, a hidden size of whole warps that FlashInfer's launcher can place in one CTA, the
// workspace's element count and the one-shot Lamport buffer. FUSEDAR_OK, or
// FUSEDAR_INVALID_ARGUMENT with the reason in fusedar_last_error(). The launch checks the same
// rules (jax_fusedar/common/moe_limits.py is the Python side, held equal by a test).
int fusedar_moe_shape_check(const fusedar_workspace_info* ws, int32_t pattern, int32_t dtype,
                            int64_t num_tokens, int64_t hidden_dim);
// Checks an MoE call against the workspace without launching (same checks as the launch).
int fusedar_check_moe_launch(const fusedar_rank* r, const fusedar_moe_launch_args* args);
// Launches FlashInfer's MoE kernel for args->pattern on `stream` (a cudaStream_t).
int fusedar_moe_launch(const fusedar_rank* r, const fusedar_moe_launch_args* args, void* stream);

// Host-side launches so far in this process. Under CUDA-graph replay (XLA command
// buffers) kernels run without a host launch, which is how tests see that capture works.
uint64_t fusedar_launch_count(void);

// Whether pattern `pattern` was compiled into this library (for every dtype and both
// accumulation modes).
int fusedar_pattern_compiled(int32_t pattern);

// Small device queries the Python layers need without a CUDA binding of their own.
int fusedar_device_count(int32_t* count);
int fusedar_can_access_peer(int32_t device, int32_t peer, int32_t* can);
int fusedar_device_compute_capability(int32_t device, int32_t* major, int32_t* minor);
int fusedar_device_mem_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes);
int fusedar_device_synchronize(int32_t device);

// Enqueues on `stream` a store of the device's %globaltimer (ns) into out[0] (low 32 bits)
// and out[1] (high 32 bits), a device pointer. For benchmarks (jax_fusedar/timing.py).
int fusedar_device_timestamp(void* stream, uint32_t* out);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FUSEDAR_CORE_H_
