// Validation and dispatch of FlashInfer's MoE epilogues (patterns 6 and 7).
//
// As for the dense kernel (launch.cpp), the kernels trust their arguments: a call larger
// than the workspace writes past the peers' Lamport buffers, and a partial warp per token
// computes wrong norms. So every rule the kernels rely on is checked here, before launch.
// A missing peer makes the kernels' bounded waits (watchdog.h) trap after the workspace's
// timeout; later launches are refused with the recorded text.
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "../kernels/moe_kernel_call.h"
#include "fusedar/core.h"
#include "launch_prelude.h"
#include "rank_state.h"
#include "status.h"
#include "world_sizes.h"

using fusedar::fail;

namespace {

constexpr int64_t kHiddenMultiple = 256;
constexpr int64_t kMaxClusterSize = 8;
constexpr int64_t kMaxThreadsPerBlock = 1024;

std::string pattern_name(int p) {
  return p == 6 ? "pattern 6 (kMoEReductionARResidualRMSNorm)"
                : "pattern 7 (kMoEFinalizeARResidualRMSNorm)";
}

// The shape rules (jax_fusedar/common/moe_limits.py is their Python side, held equal by
// tests/native/test_contract.py): what FlashInfer's MoE launcher and kernels need of a call
// of m tokens x h hidden on the workspace `ws`.
int shape_check(const fusedar_workspace_info& ws, int pattern, int dtype, int64_t m, int64_t h) {
  if (pattern != 6 && pattern != 7) {
    return fail(FUSEDAR_INVALID_ARGUMENT,
                "pattern " + std::to_string(pattern) + " is not an MoE pattern (6 or 7)");
  }
  const std::string what = pattern_name(pattern);
  if (dtype != FUSEDAR_FLOAT16 && dtype != FUSEDAR_BFLOAT16) {
    return fail(FUSEDAR_INVALID_ARGUMENT,
                what + " runs on float16 or bfloat16 only (FlashInfer instantiates no other)");
  }
  if (ws.dtype != FUSEDAR_FLOAT16 && ws.dtype != FUSEDAR_BFLOAT16) {
    // The Lamport sentinel is -0.0 at the workspace's element width.
    return fail(FUSEDAR_INVALID_ARGUMENT, what + " needs a 16-bit workspace");
  }
  const int64_t n = ws.world_size, e = 2;
  if (m <= 0 || h <= 0) return fail(FUSEDAR_INVALID_ARGUMENT, "empty input");
  // 8 elements per thread, whole warps per token: 256 elements.
  if (h % kHiddenMultiple != 0) {
    return fail(FUSEDAR_INVALID_ARGUMENT,
                what + ": hidden_dim " + std::to_string(h) +
                    " is not a multiple of 256; FlashInfer's MoE kernels give each token "
                    "whole warps of 8-element threads, and the spare threads of a partial "
                    "warp read the next token's row");
  }
  // A token's warps are spread over a cluster of the largest of 8, 4, 2, 1 CTAs dividing
  // their count; FlashInfer's launcher refuses a CTA above 1024 threads (its own check
  // would fail the launch after the handshake had already run on every rank).
  const int64_t warps = h / kHiddenMultiple;
  int64_t cluster = kMaxClusterSize;
  while (warps % cluster != 0) cluster /= 2;
  if (warps / cluster * 32 > kMaxThreadsPerBlock) {
    return fail(FUSEDAR_INVALID_ARGUMENT, what + ": hidden_dim " + std::to_string(h) + " needs " +
                                              std::to_string(warps / cluster * 32) +
                                              " threads per block, above the launch limit of 1024");
  }
  if (m * h > int64_t(ws.max_token_num) * ws.hidden_dim) {
    return fail(FUSEDAR_INVALID_ARGUMENT,
                "num_tokens*hidden_dim = " + std::to_string(m) + "*" + std::to_string(h) +
                    " exceeds the workspace (max_token_num*hidden_dim = " +
                    std::to_string(ws.max_token_num) + "*" + std::to_string(ws.hidden_dim) + ")");
  }
  if (m * h * n * e > ws.lamport_comm_bytes) {
    return fail(FUSEDAR_INVALID_ARGUMENT, what + " is one-shot only and needs " +
                                              std::to_string(m * h * n * e) +
                                              " bytes of Lamport buffer; the workspace has " +
                                              std::to_string(ws.lamport_comm_bytes));
  }
  return FUSEDAR_OK;
}

int check(const fusedar_rank* r, const fusedar_moe_launch_args* a) {
  if (r == nullptr || a == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  if (r->table == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "the workspace is not finalized");
  if (int rc = shape_check(r->info, a->pattern, a->dtype, a->num_tokens, a->hidden_dim)) {
    return rc;
  }
  const std::string what = pattern_name(a->pattern);
  if (a->residual_in == nullptr || a->rms_gamma == nullptr || a->norm_out == nullptr) {
    return fail(FUSEDAR_INVALID_ARGUMENT, what + " needs residual_in, rms_gamma and norm_out");
  }
  if (!std::isfinite(a->rms_eps) || !std::isfinite(a->weight_bias)) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "rms_eps and weight_bias must be finite");
  }
  if (a->pattern == 6) {
    if (a->num_experts < 1) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  what + " needs num_experts >= 1, got " + std::to_string(a->num_experts));
    }
    if (a->expert_scales == nullptr || a->expert_outputs == nullptr || a->token_input == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  what + " needs expert_scales, expert_outputs and token_input");
    }
  } else {
    if (a->top_k < 1) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  what + " needs top_k >= 1, got " + std::to_string(a->top_k));
    }
    if (a->num_permuted_rows < 1) {
      return fail(FUSEDAR_INVALID_ARGUMENT, what + " needs at least one permuted row");
    }
    if (a->permuted_input == nullptr || a->expanded_idx_to_permuted_idx == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  what + " needs permuted_input and expanded_idx_to_permuted_idx");
    }
    if (a->residual_out == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT, what + " needs residual_out");
    }
    if (!std::isfinite(a->routed_scaling_factor)) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "routed_scaling_factor must be finite");
    }
  }
  return FUSEDAR_OK;
}

template <int DType>
std::string launch_for_world(const fusedar::kernels::MoeKernelCall& call) {
  return fusedar::dispatch_world_size(
      call.nranks,
      [&](auto n) { return fusedar::kernels::launch_moe<DType, decltype(n)::value>(call); },
      fusedar::WorldSizes{});
}

}  // namespace

extern "C" int fusedar_moe_shape_check(const fusedar_workspace_info* ws, int32_t pattern,
                                       int32_t dtype, int64_t num_tokens, int64_t hidden_dim) {
  if (ws == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  return shape_check(*ws, pattern, dtype, num_tokens, hidden_dim);
}

extern "C" int fusedar_check_moe_launch(const fusedar_rank* r, const fusedar_moe_launch_args* a) {
  return check(r, a);
}

extern "C" int fusedar_moe_launch(const fusedar_rank* r, const fusedar_moe_launch_args* a,
                                  void* stream) {
  if (int rc = check(r, a)) return rc;
  // The ranks must agree on what the all-reduce moves: pattern, dtype and the token block
  // (per-rank expert counts and top_k may differ, e.g. under expert parallelism).
  fusedar_launch_args signature{};
  signature.pattern = a->pattern;
  signature.dtype = a->dtype;
  signature.num_tokens = a->num_tokens;
  signature.hidden_dim = a->hidden_dim;
  signature.algorithm = FUSEDAR_ALGORITHM_ONESHOT;  // the MoE kernels' only mode
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  std::optional<fusedar::DeviceGuard> guard;
  if (int rc = fusedar::launch_prelude(r, signature, s, guard)) return rc;
  fusedar::kernels::MoeKernelCall call{a, r->info.world_size, r->rank, r->table, s};
  return fusedar::launch_result(r, a->dtype == FUSEDAR_FLOAT16
                                       ? launch_for_world<FUSEDAR_FLOAT16>(call)
                                       : launch_for_world<FUSEDAR_BFLOAT16>(call));
}
