// Every XLA FFI handler this package defines; ffi/python/module.cc turns this list
// into the registrations() table (one place, as in TransformerEngine's pybind.cpp).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FusedarAllReduceFusionHandler);

// Stable, versioned target names: bump the suffix whenever operands, results or
// attributes change, so a serialized program never meets a handler it was not built for.
#define FUSEDAR_TARGET_ALLREDUCE_FUSION "jax_fusedar_allreduce_fusion_v1"
