// XLA FFI handler for the fused all-reduce family (all FlashInfer patterns).
//
// Operands, in order: x, then for residual patterns residual_in and rms_gamma, then
// scale_factor for static FP8 / NVFP4 (a device array, so command buffers stay valid).
// Results, in order: allreduce_out (pattern 0) or residual_out, then norm_out if the
// pattern writes it, then quant_out and scale_out for quantized patterns; which ones a
// pattern has comes from the native table (fusedar/patterns.h). The Python primitive
// (jax_fusedar/ops/dense.py) builds exactly this list from the Python table, which
// tests/native/test_contract.py holds equal to the native one, and this handler re-checks
// it: every operand, and every result's element type and count (result_check.h), so a
// mismatch is an FFI error, never a wild write. A failed launch returns the error code of
// its status (errors.h): the caller's mistakes are INVALID_ARGUMENT, not INTERNAL.
//
// Per-call protocol state (Lamport buffer index, barrier flags) lives on the device,
// so replaying a captured command buffer without running this host code is correct:
// the handler is marked command-buffer compatible.
#include <string>
#include <vector>

#include "errors.h"
#include "fusedar/core.h"
#include "fusedar/patterns.h"
#include "result_check.h"
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

Element element_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return Element::kFloat32;
    case ffi::DataType::F16: return Element::kFloat16;
    case ffi::DataType::BF16: return Element::kBFloat16;
    case ffi::DataType::U8: return Element::kUInt8;
    case ffi::DataType::F8E4M3FN: return Element::kFloat8E4M3FN;
    case ffi::DataType::S32: return Element::kInt32;
    default: return Element::kOther;
  }
}

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_fusedar: " + msg);
}

ffi::Error AllReduceFusionImpl(void* stream, int32_t device_ordinal, ffi::RemainingArgs args,
                               ffi::RemainingRets rets, int64_t workspace_id, int32_t pattern,
                               int32_t algorithm, bool fp32_acc, float rms_eps, float weight_bias,
                               int32_t layout, int32_t block_quant_group_size) {
  std::string why;
  fusedar_rank* rank = find_rank(workspace_id, device_ordinal, &why);
  if (rank == nullptr) return invalid(why);

  const PatternTraits* traits = find_dense_pattern(pattern);
  if (traits == nullptr) return invalid("unknown fusion pattern " + std::to_string(pattern));
  const size_t want_args = traits->operands();
  const size_t want_rets = traits->results();
  if (args.size() != want_args || rets.size() != want_rets) {
    return invalid("pattern " + std::to_string(pattern) + " expects " + std::to_string(want_args) +
                   " operands and " + std::to_string(want_rets) + " results, got " +
                   std::to_string(args.size()) + " and " + std::to_string(rets.size()));
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
  a.algorithm = algorithm;
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

  // Every result, checked against the pattern's list before anything is written.
  std::vector<void*> out;
  std::vector<GivenResult> given;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    out.push_back((*r)->untyped_data());
    given.push_back(
        {element_of((*r)->element_type()), static_cast<int64_t>((*r)->element_count())});
  }
  const std::string problem =
      results_problem(*traits, dtype, dims[0], dims[1], layout, block_quant_group_size, given);
  if (!problem.empty()) return invalid(problem);
  size_t next_ret = 0;
  if (traits->allreduce_out()) {
    a.allreduce_out = out[next_ret++];
  } else {
    a.residual_out = out[next_ret++];
  }
  if (traits->norm_out) a.norm_out = out[next_ret++];
  if (traits->quant_out()) a.quant_out = out[next_ret++];
  if (traits->scale_out()) a.scale_out = out[next_ret++];

  if (int status = fusedar_launch(rank, &a, stream)) return core_error(status);
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
                                  .Attr<int32_t>("algorithm")
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FusedarAllReduceFusionHostHandler, fusedar::xla::AllReduceFusionHostImpl,
    ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs<ffi::Dictionary>());
