// The layout of one rank's barrier-flags allocation (workspace slots [N, 2N), peer-mapped):
// FlashInfer's barrier flags and the handshake area (handshake.h), then the large-message
// algorithm's flags (ffi/kernels/large_message.h) at a 256-byte boundary. One definition for
// the workspace (workspace.cu) and the large-message harness (tools/large_message_bench.cu),
// which finds the flags of a workspace the C API created.
#pragma once

#include <cstdint>

#include "../kernels/large_message.h"
#include "fusedar/core.h"
#include "handshake.h"

namespace fusedar {

// Where the large-message flags start (cudaMalloc rounds every allocation up to 2 MiB anyway,
// so the few KiB cost nothing).
inline int64_t large_flags_offset(const fusedar_workspace_info& info) {
  return (handshake::flag_allocation_bytes(info) + 255) / 256 * 256;
}
inline int64_t flag_allocation_bytes(const fusedar_workspace_info& info) {
  return large_flags_offset(info) + int64_t(sizeof(kernels::large::Flags));
}

}  // namespace fusedar
