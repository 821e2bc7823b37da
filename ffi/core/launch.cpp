// Validation and dispatch of one fused all-reduce call.
//
// The kernel knows nothing about the workspace's size: a call that is too large
// writes past the peers' buffers, and a missing or mismatched peer spins until the
// rank's timeout (watchdog.h) traps it. So every call is checked here against the
// workspace metadata before launch, and the one-shot/two-shot choice arrives already made
// (by the pure policy in jax_fusedar/common/launch_mode.py), so that every rank launches
// the same configuration. What each pattern reads and writes comes from the one table,
// fusedar/patterns.h.
#include <cstdint>
#include <optional>
#include <string>

#include "../kernels/compiled_patterns.h"
#include "../kernels/kernel_call.h"
#include "../kernels/large_message.h"
#include "fusedar/core.h"
#include "fusedar/patterns.h"
#include "launch_prelude.h"
#include "rank_state.h"
#include "status.h"
#include "world_sizes.h"

using fusedar::fail;

namespace {

// The trait table's dense patterns and the kernel instantiations name the same patterns.
constexpr bool table_matches_compiled_patterns() {
  for (const fusedar::PatternTraits& p : fusedar::kPatterns) {
    if (p.dense() != fusedar::kernels::is_compiled_pattern(p.code)) return false;
  }
  for (int code : fusedar::kernels::kCompiledPatterns) {
    if (fusedar::find_dense_pattern(code) == nullptr) return false;
  }
  return true;
}
static_assert(table_matches_compiled_patterns(),
              "fusedar/patterns.h and kernels/compiled_patterns.h disagree");

std::string dtype_name(int dtype) {
  switch (dtype) {
    case FUSEDAR_FLOAT32: return "float32";
    case FUSEDAR_FLOAT16: return "float16";
    case FUSEDAR_BFLOAT16: return "bfloat16";
  }
  return "dtype#" + std::to_string(dtype);
}

int check(const fusedar_rank* r, const fusedar_launch_args* a) {
  if (r == nullptr || a == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "null argument");
  if (r->table == nullptr) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "the workspace is not finalized");
  }
  const fusedar_workspace_info& ws = r->info;
  const int n = ws.world_size;
  if (a->dtype != FUSEDAR_FLOAT32 && a->dtype != FUSEDAR_FLOAT16 && a->dtype != FUSEDAR_BFLOAT16) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "unknown dtype code " + std::to_string(a->dtype));
  }
  if ((a->dtype == FUSEDAR_FLOAT32) != (ws.dtype == FUSEDAR_FLOAT32)) {
    // The Lamport sentinel is -0.0 at the workspace's element width.
    return fail(FUSEDAR_INVALID_ARGUMENT, "call dtype " + dtype_name(a->dtype) +
                                              " does not match the workspace dtype " +
                                              dtype_name(ws.dtype) +
                                              " (float32 needs a float32 workspace, 16-bit types a "
                                              "16-bit one)");
  }
  const fusedar::PatternTraits* traits = fusedar::find_dense_pattern(a->pattern);
  if (traits == nullptr || !fusedar::kernels::is_compiled_pattern(a->pattern)) {
    return fail(FUSEDAR_UNSUPPORTED, "pattern " + std::to_string(a->pattern) +
                                         " is not compiled into this build of jax_fusedar");
  }
  if (traits->needs_sm100()) {
    int major = 0, minor = 0;
    if (fusedar_device_compute_capability(r->device, &major, &minor)) return FUSEDAR_CUDA_ERROR;
    if (major < 10) {
      // On sm90 the NVFP4 epilogue compiles and runs but writes zeros and no scales.
      return fail(FUSEDAR_UNSUPPORTED,
                  "NVFP4 patterns (3, 5) need an sm100+ GPU (Blackwell); device " +
                      std::to_string(r->device) + " is sm" + std::to_string(major * 10 + minor));
    }
  }
  const int64_t m = a->num_tokens, h = a->hidden_dim;
  const int64_t e = a->dtype == FUSEDAR_FLOAT32 ? 4 : 2;
  const int64_t vec = 16 / e;
  if (m <= 0 || h <= 0) return fail(FUSEDAR_INVALID_ARGUMENT, "empty input");
  if (h % vec != 0) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "hidden_dim " + std::to_string(h) +
                                              " is not a multiple of " + std::to_string(vec) +
                                              " (16 bytes of " + dtype_name(a->dtype) + ")");
  }
  if (m * h > int64_t(ws.max_token_num) * ws.hidden_dim) {
    return fail(FUSEDAR_INVALID_ARGUMENT,
                "num_tokens*hidden_dim = " + std::to_string(m) + "*" + std::to_string(h) +
                    " exceeds the workspace (max_token_num*hidden_dim = " +
                    std::to_string(ws.max_token_num) + "*" + std::to_string(ws.hidden_dim) + ")");
  }
  if (a->algorithm != FUSEDAR_ALGORITHM_TWOSHOT && a->algorithm != FUSEDAR_ALGORITHM_ONESHOT &&
      a->algorithm != FUSEDAR_ALGORITHM_LARGE_MESSAGE) {
    return fail(FUSEDAR_INVALID_ARGUMENT, "unknown algorithm code " + std::to_string(a->algorithm));
  }
  if (a->algorithm == FUSEDAR_ALGORITHM_ONESHOT) {
    if (m * h * n * e > ws.lamport_comm_bytes) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "one-shot needs " + std::to_string(m * h * n * e) +
                                                " bytes of Lamport buffer, the workspace has " +
                                                std::to_string(ws.lamport_comm_bytes));
    }
  } else {
    if (m <= n) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "two-shot needs more tokens (" + std::to_string(m) +
                                                ") than ranks (" + std::to_string(n) + ")");
    }
    if (2 * m * h * e > ws.two_shot_buffer_bytes) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "two-shot buffer too small for this call");
    }
    if (a->algorithm == FUSEDAR_ALGORITHM_LARGE_MESSAGE) {
      if (!fusedar::kernels::large::compiled_for(int(e), n)) {
        return fail(FUSEDAR_UNSUPPORTED, fusedar::kernels::large::kNotCompiledMessage);
      }
      // N receive slots and N gather slots of ceil(M/N) rows in the two-shot buffer.
      const int64_t needed = fusedar::kernels::large::buffer_bytes_needed(m, h, n, int(e));
      if (needed > ws.two_shot_buffer_bytes) {
        return fail(FUSEDAR_INVALID_ARGUMENT,
                    "the large-message algorithm needs " + std::to_string(needed) +
                        " bytes of the two-shot buffer, the workspace has " +
                        std::to_string(ws.two_shot_buffer_bytes));
      }
      if (r->large == nullptr) {
        return fail(FUSEDAR_INTERNAL, "the workspace has no large-message resources");
      }
    }
  }
  if (a->input == nullptr) return fail(FUSEDAR_INVALID_ARGUMENT, "input is null");
  if (traits->allreduce_out()) {
    if (a->allreduce_out == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "pattern 0 needs allreduce_out");
    }
  } else {
    if (a->residual_in == nullptr || a->residual_out == nullptr || a->rms_gamma == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT, "pattern " + std::to_string(a->pattern) +
                                                " needs residual_in, residual_out and rms_gamma");
    }
    if (traits->norm_out && a->norm_out == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  "pattern " + std::to_string(a->pattern) + " needs norm_out");
    }
    if (traits->quant_out() && a->quant_out == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  "pattern " + std::to_string(a->pattern) + " needs quant_out");
    }
    if (traits->scale_out() && a->scale_out == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  "pattern " + std::to_string(a->pattern) + " needs scale_out");
    }
    if (traits->scale_factor() && a->scale_factor == nullptr) {
      return fail(FUSEDAR_INVALID_ARGUMENT,
                  "pattern " + std::to_string(a->pattern) + " needs scale_factor");
    }
  }
  return FUSEDAR_OK;
}

template <int DType>
std::string launch_for_world(const fusedar::kernels::KernelCall& call) {
  return fusedar::dispatch_world_size(
      call.nranks,
      [&](auto n) { return fusedar::kernels::launch<DType, decltype(n)::value>(call); },
      fusedar::WorldSizes{});
}

}  // namespace

#ifndef FUSEDAR_WORLD_SIZE_LIST
#error "FUSEDAR_WORLD_SIZE_LIST is set by ffi/core/CMakeLists.txt (from common/limits.py)"
#endif

bool fusedar::supported_world_size(int n) {
  for (int w : {FUSEDAR_WORLD_SIZE_LIST}) {
    if (w == n) return true;
  }
  return false;
}

std::string fusedar::world_sizes_text() {
  constexpr int sizes[] = {FUSEDAR_WORLD_SIZE_LIST};
  constexpr int count = sizeof(sizes) / sizeof(sizes[0]);
  std::string out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) out += i + 1 == count ? " or " : ", ";
    out += std::to_string(sizes[i]);
  }
  return out;
}

extern "C" int fusedar_pattern_compiled(int32_t pattern) {
  return fusedar::kernels::is_compiled_pattern(pattern) ? 1 : 0;
}

extern "C" int fusedar_check_launch(const fusedar_rank* r, const fusedar_launch_args* a) {
  return check(r, a);
}

extern "C" int fusedar_launch(const fusedar_rank* r, const fusedar_launch_args* a, void* stream) {
  if (int rc = check(r, a)) return rc;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  std::optional<fusedar::DeviceGuard> guard;
  if (int rc = fusedar::launch_prelude(r, *a, s, guard)) return rc;
  fusedar::kernels::KernelCall call{a, r->info.world_size, r->rank, r->table, s, r->large};
  std::string err;
  switch (a->dtype) {
    case FUSEDAR_FLOAT32: err = launch_for_world<FUSEDAR_FLOAT32>(call); break;
    case FUSEDAR_FLOAT16: err = launch_for_world<FUSEDAR_FLOAT16>(call); break;
    case FUSEDAR_BFLOAT16: err = launch_for_world<FUSEDAR_BFLOAT16>(call); break;
  }
  return fusedar::launch_result(r, err);
}
