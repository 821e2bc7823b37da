// What the dense launch (launch.cpp) and the MoE launch (moe_launch.cpp) do alike: between
// checking their arguments and calling their kernel's launcher, and after it.
#pragma once

#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "device_guard.h"
#include "fusedar/core.h"

namespace fusedar {

// Before the kernel, in this order:
// 1. a wait on this workspace (a dense kernel's, an MoE kernel's or a handshake's) already
//    timed out and trapped: fail with its record (naming the peer that did not arrive)
//    instead of CUDA's generic error, before any CUDA call, which would only report the
//    dead context (one read of pinned host memory);
// 2. make the rank's device current (`guard`, for the caller's scope): FlashInfer's
//    launchers query the *current* device (SM count, cluster size);
// 3. with the handshake on, launch the handshake on `stream`, without PDL: it starts once
//    the previous kernel has completed, and the fused kernel (PDL or not) starts only after
//    it has exited. `signature` is what the ranks must agree on.
int launch_prelude(const fusedar_rank* r, const fusedar_launch_args& signature, cudaStream_t stream,
                   std::optional<DeviceGuard>& guard);

// After the kernel's launcher returned `error` ("" when it launched): the launch's status,
// with the launch counted (fusedar_launch_count) when it succeeded.
int launch_result(const fusedar_rank* r, const std::string& error);

}  // namespace fusedar
