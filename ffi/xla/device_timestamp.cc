// XLA FFI handler of jax_fusedar.timing.device_timestamp: stamps the device clock on the
// op's stream (see ffi/core/timestamp.cu). Operand: any array `dep`; results: the stamp
// (uint32[2], low and high words of %globaltimer in ns) and `dep` itself, aliased in place
// (the Python side declares the alias), so that the ops consuming the returned `dep` are
// ordered after the stamp, and the stamp after whatever produced `dep`.
#include <string>

#include "fusedar/core.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace fusedar::xla {
namespace {

ffi::Error DeviceTimestampImpl(void* stream, ffi::AnyBuffer dep, ffi::Result<ffi::AnyBuffer> stamp,
                               ffi::Result<ffi::AnyBuffer> dep_out) {
  if (stamp->element_type() != ffi::DataType::U32 || stamp->element_count() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_fusedar: the timestamp result must be uint32[2]");
  }
  if (dep_out->untyped_data() != dep.untyped_data()) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_fusedar: the timestamp's second result must alias its operand");
  }
  if (fusedar_device_timestamp(stream, static_cast<uint32_t*>(stamp->untyped_data())) !=
      FUSEDAR_OK) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_fusedar: ") + fusedar_last_error());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fusedar::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedarDeviceTimestampHandler, fusedar::xla::DeviceTimestampImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
