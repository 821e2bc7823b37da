// Every XLA FFI handler this package defines; ffi/python/module.cc turns this list
// into the registrations() table (one place, as in TransformerEngine's pybind.cpp).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedarAllReduceFusionHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedarDeviceTimestampHandler);
// Host twin of the fused target (never runs): see allreduce_fusion.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedarAllReduceFusionHostHandler);
// FlashInfer's MoE epilogues (patterns 6 and 7) and their host twin: moe_allreduce_fusion.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedarMoeAllReduceFusionHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedarMoeAllReduceFusionHostHandler);

// Stable, versioned target names: bump the suffix whenever operands, results or
// attributes change, so a serialized program never meets a handler it was not built for.
// v2: the attribute use_oneshot (bool) became algorithm (i32, fusedar_algorithm), so an
// artifact exported with v1 fails to find its handler instead of being misread.
#define FUSEDAR_TARGET_ALLREDUCE_FUSION "jax_fusedar_allreduce_fusion_v2"
#define FUSEDAR_TARGET_MOE_ALLREDUCE_FUSION "jax_fusedar_moe_allreduce_fusion_v1"
// Benchmark support: a device-clock stamp ordered by data dependencies (jax_fusedar/ops/timing.py).
#define FUSEDAR_TARGET_DEVICE_TIMESTAMP "jax_fusedar_device_timestamp_v1"
