// Includes FlashInfer's fused all-reduce header the way this project builds it.
//
// - The header comes from the flashinfer-python wheel (pinned in pyproject.toml); the
//   build copies it into the build tree and marks six free-function definitions
//   `inline` (get_sm_count, use_oneshot, four is_negative_zero specialisations) so
//   that several translation units can include it without duplicate strong symbols
//   (see ffi/cmake/FlashInferHeaders.cmake). The same patching bounds the kernel's wait
//   loops with the hooks of wait_hooks.cuh and keeps FlashInfer's launch geometry with
//   launch_registers.cuh, which are therefore included first. The build also compiles the
//   kernels once from the header without those patches (FUSEDAR_UNHOOKED_PROBE), only to
//   read their register counts: then neither is included.
// - FLASHINFER_LOGGING_H_ is pre-defined: logging.h only drags in spdlog (18 s per
//   TU) and the kernel never logs. The header uses std::array without including
//   <array>, which spdlog used to provide, so we include it here.
#pragma once

#include <array>

#ifndef FUSEDAR_UNHOOKED_PROBE
#include "launch_registers.cuh"
#include "wait_hooks.cuh"
#endif

#ifndef FLASHINFER_LOGGING_H_
#define FLASHINFER_LOGGING_H_
#endif

#include <flashinfer/comm/trtllm_allreduce_fusion.cuh>
