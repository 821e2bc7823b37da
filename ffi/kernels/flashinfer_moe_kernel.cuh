// Includes FlashInfer's MoE all-reduce header the way this project builds it (see
// flashinfer_kernel.cuh for the dense one).
//
// - The build's copy marks the same six free functions `inline` as in the dense header
//   (get_sm_count, use_oneshot, four is_negative_zero specialisations), so the per-(dtype,
//   world size) translation units link together (ffi/cmake/FlashInferHeaders.cmake).
// - The same patching bounds the kernels' wait loops (Lamport polls, grid counter) with the
//   hooks of wait_hooks.cuh and holds each hooked kernel to the unhooked one's registers with
//   moe_launch_registers.cuh, which are therefore included first. The build also compiles
//   the kernels once from the header without those patches (FUSEDAR_UNHOOKED_PROBE), only
//   to read their register counts: then neither is included.
// - FLASHINFER_LOGGING_H_ is pre-defined (logging.h drags in spdlog). This header's
//   launchers log one warning (more than 128 tokens still run one-shot); without spdlog it
//   compiles to nothing, and the Python layers document the one-shot-only behaviour.
#pragma once

#include <array>

#ifndef FUSEDAR_UNHOOKED_PROBE
#include "moe_launch_registers.cuh"
#include "wait_hooks.cuh"
#endif

#ifndef FLASHINFER_LOGGING_H_
#define FLASHINFER_LOGGING_H_
#endif
#ifndef FLASHINFER_LOG_WARN
#define FLASHINFER_LOG_WARN(...) ((void)0)
#endif

#include <flashinfer/comm/trtllm_moe_allreduce_fusion.cuh>
