// How a core status (fusedar_status) reaches the caller: the XLA FFI error code the
// handlers return (ffi/xla/*.cc) and the Python exception the module raises
// (ffi/python/module.cc). One table for both faces, read back by
// tests/native/test_contract.py through the module (ext.status_codes, ext.ffi_error_code,
// ext.raise_status). The caller's mistakes (INVALID_ARGUMENT) and what this build or device
// cannot do (UNSUPPORTED) are the caller's to fix; CUDA and internal failures are not.
#pragma once

#include <string>

#include "fusedar/core.h"
#include "xla/ffi/api/ffi.h"

namespace fusedar::xla {

inline ::xla::ffi::ErrorCode error_code(int status) {
  using ::xla::ffi::ErrorCode;
  switch (status) {
    case FUSEDAR_OK: return ErrorCode::kOk;
    case FUSEDAR_INVALID_ARGUMENT: return ErrorCode::kInvalidArgument;
    case FUSEDAR_UNSUPPORTED: return ErrorCode::kUnimplemented;
    case FUSEDAR_CUDA_ERROR: return ErrorCode::kInternal;
    case FUSEDAR_INTERNAL: return ErrorCode::kInternal;
  }
  return ErrorCode::kUnknown;
}

// The name XLA prints before the message ("INVALID_ARGUMENT: jax_fusedar: ...").
inline const char* error_code_name(::xla::ffi::ErrorCode code) {
  using ::xla::ffi::ErrorCode;
  switch (code) {
    case ErrorCode::kOk: return "OK";
    case ErrorCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case ErrorCode::kUnimplemented: return "UNIMPLEMENTED";
    case ErrorCode::kInternal: return "INTERNAL";
    case ErrorCode::kUnknown: return "UNKNOWN";
    default: return "OTHER";
  }
}

// Whether Python sees the status as the caller's to fix (ValueError) or not (RuntimeError).
inline bool is_callers_error(int status) {
  return status == FUSEDAR_INVALID_ARGUMENT || status == FUSEDAR_UNSUPPORTED;
}

// The FFI error of a failed core call, with the core's message for this thread.
inline ::xla::ffi::Error core_error(int status) {
  return ::xla::ffi::Error(error_code(status), std::string("jax_fusedar: ") + fusedar_last_error());
}

}  // namespace fusedar::xla
