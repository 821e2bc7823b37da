// XLA FFI handler for the fused all-reduce family (all FlashInfer patterns).
//
// Operands, in order: x, then for residual patterns residual_in and rms_gamma, then
// scale_factor for static FP8 / NVFP4 (a device array, so command buffers stay valid).
// Results, in order: allreduce_out (pattern 0) or residual_out, then norm_out if the
// pattern writes it, then quant_out and scale_out for quantized patterns; which ones a
// pattern has comes from the native table (fusedar/patterns.h). The Python primitive
// (jax_fusedar/primitive.py) builds exactly this list from the Python table, which
// tests/native/test_contract.py holds equal to the native one, and this handler re-checks it, so a mismatch is an FFI error, never
// a wild write.
//
// Per-call protocol state (Lamport buffer index, barrier flags) lives on the device,
// so replaying a captured command buffer without running this host code is correct:
// the handler is marked command-buffer compatible.
#include <string>

#include "fusedar/core.h"
#include "fusedar/patterns.h"
#include "workspace_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace fusedar::xla {
namespace {

int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return FUSEDAR_FLOAT32;
    case ffi::DataType::F16: return FUSEDAR_FLOAT16;
    case ffi::DataType::BF16: return FUSEDAR_BFLOAT16;
    default: return -1;
  }
}

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_fusedar: " + msg);
}

ffi::Error AllReduceFusionImpl(void* stream, int32_t device_ordinal, ffi::RemainingArgs args,
                               ffi::RemainingRets rets, int64_t workspace_id, int32_t pattern,
                               bool use_oneshot, bool fp32_acc, float rms_eps, float weight_bias,
                               int32_t layout, int32_t block_quant_group_size) {
  std::string why;
  fusedar_rank* rank = find_rank(workspace_id, device_ordinal, &why);
  if (rank == nullptr) return invalid(why);

  const PatternTraits* traits = find_pattern(pattern);
  if (traits == nullptr) return invalid("unknown fusion pattern " + std::to_string(pattern));
  const size_t want_args = traits->operands();
  const size_t want_rets = traits->results();
  if (args.size() != want_args || rets.size() != want_rets) {
    return invalid("pattern " + std::to_string(pattern) + " expects " +
                   std::to_string(want_args) + " operands and " + std::to_string(want_rets) +
                   " results, got " + std::to_string(args.size()) + " and " +
                   std::to_string(rets.size()));
  }
  auto x = args.get<ffi::AnyBuffer>(0);
  if (x.has_error()) return x.error();
  auto dims = x->dimensions();
  if (dims.size() != 2) return invalid("x must be 2-D [tokens, hidden]");
  const int dtype = dtype_code(x->element_type());
  if (dtype < 0) return invalid("x must be float32, float16 or bfloat16");

  fusedar_launch_args a{};
  a.pattern = pattern;
  a.dtype = dtype;
  a.num_tokens = dims[0];
  a.hidden_dim = dims[1];
  a.input = x->untyped_data();
  a.rms_eps = rms_eps;
  a.weight_bias = weight_bias;
  a.use_oneshot = use_oneshot ? 1 : 0;
  a.fp32_acc = fp32_acc ? 1 : 0;
  a.layout = layout;
  a.block_quant_group_size = block_quant_group_size;
  // XLA neighbours are ordinary kernels: PDL is safe (the kernel waits on its grid
  // dependency first) and the completion trigger stays at the end (vLLM saw NaNs
  // with an early trigger, flashinfer #1223).
  a.launch_with_pdl = 1;
  a.trigger_completion_at_end = 1;

  size_t next_arg = 1;
  if (traits->residual) {
    auto residual = args.get<ffi::AnyBuffer>(next_arg++);
    auto gamma = args.get<ffi::AnyBuffer>(next_arg++);
    if (residual.has_error()) return residual.error();
    if (gamma.has_error()) return gamma.error();
    if (residual->element_type() != x->element_type() ||
        residual->element_count() != x->element_count()) {
      return invalid("residual must have x's shape and dtype");
    }
    if (gamma->element_type() != x->element_type() ||
        gamma->element_count() != static_cast<size_t>(dims[1])) {
      return invalid("rms_gamma must be [hidden] with x's dtype");
    }
    a.residual_in = residual->untyped_data();
    a.rms_gamma = gamma->untyped_data();
  }
  if (traits->scale_factor()) {
    auto scale = args.get<ffi::AnyBuffer>(next_arg++);
    if (scale.has_error()) return scale.error();
    if (scale->element_type() != ffi::DataType::F32 || scale->element_count() != 1) {
      return invalid("scale_factor must be a float32 scalar");
    }
    a.scale_factor = static_cast<const float*>(scale->untyped_data());
  }

  size_t next_ret = 0;
  auto out0 = rets.get<ffi::AnyBuffer>(next_ret++);
  if (out0.has_error()) return out0.error();
  if ((*out0)->element_count() != x->element_count()) {
    return invalid("the first result must have x's shape");
  }
  if (traits->allreduce_out()) {
    a.allreduce_out = (*out0)->untyped_data();
  } else {
    a.residual_out = (*out0)->untyped_data();
  }
  if (traits->norm_out) {
    auto norm = rets.get<ffi::AnyBuffer>(next_ret++);
    if (norm.has_error()) return norm.error();
    a.norm_out = (*norm)->untyped_data();
  }
  if (traits->quant_out()) {
    auto quant = rets.get<ffi::AnyBuffer>(next_ret++);
    if (quant.has_error()) return quant.error();
    a.quant_out = (*quant)->untyped_data();
  }
  if (traits->scale_out()) {
    auto scale_out = rets.get<ffi::AnyBuffer>(next_ret++);
    if (scale_out.has_error()) return scale_out.error();
    a.scale_out = (*scale_out)->untyped_data();
  }

  if (fusedar_launch(rank, &a, stream) != FUSEDAR_OK) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("jax_fusedar: ") + fusedar_last_error());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fusedar::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedarAllReduceFusionHandler, fusedar::xla::AllReduceFusionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int32_t>("pattern")
                                  .Attr<bool>("use_oneshot")
                                  .Attr<bool>("fp32_acc")
                                  .Attr<float>("rms_eps")
                                  .Attr<float>("weight_bias")
                                  .Attr<int32_t>("layout")
                                  .Attr<int32_t>("block_quant_group_size"),
                              {ffi::Traits::kCmdBufferCompatible});

// The same target on the host platform. A program exported for ("cpu", "cuda") holds both
// platforms' branches in one module; on CPU the reference branch runs, but XLA:CPU still
// resolves every custom call of the module when it compiles it, the unreachable cuda
// branch's included. This handler makes that resolution succeed; it never runs (the CPU
// lowering never emits the custom call), and says so if it ever did.
namespace fusedar::xla {
namespace {
ffi::Error AllReduceFusionHostImpl(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "jax_fusedar: the fused all-reduce kernel runs on CUDA GPUs only; on CPU "
                    "programs use the reference lowering (psum + RMSNorm), so this call "
                    "comes from a program lowered for cuda alone");
}
}  // namespace
}  // namespace fusedar::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedarAllReduceFusionHostHandler,
                              fusedar::xla::AllReduceFusionHostImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs<ffi::Dictionary>());
