// XLA FFI handler for FlashInfer's MoE epilogues (patterns 6 and 7) on the fused
// all-reduce workspace.
//
// Pattern 6 operands: expert_scales f32 [E, T], expert_outputs [E, T, H], token_input
//   [T, H], residual_in [T, H], rms_gamma [H]; results: residual_out, norm_out, then
//   allreduce_out when the attribute `allreduce_out` is set.
// Pattern 7 operands: permuted_input [P, H], expanded_idx_to_permuted_idx int32 [T, K],
//   residual_in [T, H], rms_gamma [H], then expert_scale_factor [T, K] (x's dtype) when
//   `has_expert_scale`, then shared_expert_output [T, H] when `has_shared_expert`;
//   results: residual_out, norm_out.
// The Python primitive (jax_fusedar/ops/moe.py) builds exactly these lists; this
// handler re-checks shapes and dtypes, so a mismatch is an FFI error, never a wild read.
// Per-call state lives on the device (as for the dense handler): command-buffer compatible.
#include <string>
#include <vector>

#include "errors.h"
#include "fusedar/core.h"
#include "fusedar/patterns.h"
#include "workspace_registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace fusedar::xla {
namespace {

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_fusedar: " + msg);
}

int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return FUSEDAR_FLOAT16;
    case ffi::DataType::BF16: return FUSEDAR_BFLOAT16;
    default: return -1;
  }
}

bool same_shape(const ffi::AnyBuffer& b, std::initializer_list<int64_t> want) {
  auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (d[i++] != w) return false;
  }
  return true;
}

ffi::Error MoeAllReduceFusionImpl(void* stream, int32_t device_ordinal, ffi::RemainingArgs args,
                                  ffi::RemainingRets rets, int64_t workspace_id, int32_t pattern,
                                  float rms_eps, float weight_bias, float routed_scaling_factor,
                                  bool has_expert_scale, bool has_shared_expert,
                                  bool allreduce_out) {
  std::string why;
  fusedar_rank* rank = find_rank(workspace_id, device_ordinal, &why);
  if (rank == nullptr) return invalid(why);
  // The counts of the pattern table (fusedar/patterns.h), plus what this call adds.
  const fusedar::PatternTraits* traits = fusedar::find_pattern(pattern);
  if (traits == nullptr || traits->dense()) return invalid("not an MoE pattern");
  const bool finalize = traits->family == fusedar::Family::kMoeFinalize;
  const size_t want_args = traits->operands() + (finalize && has_expert_scale ? 1 : 0) +
                           (finalize && has_shared_expert ? 1 : 0);
  const size_t want_rets = traits->results() + (!finalize && allreduce_out ? 1 : 0);
  if (args.size() != want_args || rets.size() != want_rets) {
    return invalid("pattern " + std::to_string(pattern) + " expects " + std::to_string(want_args) +
                   " operands and " + std::to_string(want_rets) + " results, got " +
                   std::to_string(args.size()) + " and " + std::to_string(rets.size()));
  }
  std::vector<ffi::AnyBuffer> in;
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    in.push_back(*b);
  }
  // residual_in is operand 3 for pattern 6, 2 for pattern 7; it fixes T, H and the dtype.
  const ffi::AnyBuffer& residual = in[pattern == 6 ? 3 : 2];
  const ffi::AnyBuffer& gamma = in[pattern == 6 ? 4 : 3];
  auto rd = residual.dimensions();
  if (rd.size() != 2) return invalid("residual_in must be 2-D [tokens, hidden]");
  const int64_t t = rd[0], h = rd[1];
  const ffi::DataType dt = residual.element_type();
  const int dtype = dtype_code(dt);
  if (dtype < 0) return invalid("the MoE patterns take float16 or bfloat16");
  if (gamma.element_type() != dt || !same_shape(gamma, {h})) {
    return invalid("rms_gamma must be [hidden] with residual_in's dtype");
  }

  fusedar_moe_launch_args a{};
  a.pattern = pattern;
  a.dtype = dtype;
  a.num_tokens = t;
  a.hidden_dim = h;
  a.residual_in = residual.untyped_data();
  a.rms_gamma = gamma.untyped_data();
  a.rms_eps = rms_eps;
  a.weight_bias = weight_bias;
  a.routed_scaling_factor = routed_scaling_factor;
  // PDL is safe with XLA's ordinary kernels (the kernel waits on its grid dependency first).
  a.launch_with_pdl = 1;
  if (pattern == 6) {
    auto ed = in[1].dimensions();
    if (ed.size() != 3) return invalid("expert_outputs must be 3-D [experts, tokens, hidden]");
    const int64_t e = ed[0];
    if (in[0].element_type() != ffi::DataType::F32 || !same_shape(in[0], {e, t})) {
      return invalid("expert_scales must be float32 [experts, tokens]");
    }
    if (in[1].element_type() != dt || !same_shape(in[1], {e, t, h})) {
      return invalid("expert_outputs must be [experts, tokens, hidden] in residual_in's dtype");
    }
    if (in[2].element_type() != dt || !same_shape(in[2], {t, h})) {
      return invalid("token_input must have residual_in's shape and dtype");
    }
    a.num_experts = static_cast<int32_t>(e);
    a.expert_scales = static_cast<const float*>(in[0].untyped_data());
    a.expert_outputs = in[1].untyped_data();
    a.token_input = in[2].untyped_data();
  } else {
    auto pd = in[0].dimensions();
    if (pd.size() != 2 || pd[1] != h || in[0].element_type() != dt) {
      return invalid("permuted_input must be [rows, hidden] in residual_in's dtype");
    }
    auto id = in[1].dimensions();
    if (id.size() != 2 || id[0] != t || in[1].element_type() != ffi::DataType::S32) {
      return invalid("expanded_idx_to_permuted_idx must be int32 [tokens, top_k]");
    }
    a.permuted_input = in[0].untyped_data();
    a.num_permuted_rows = pd[0];
    a.expanded_idx_to_permuted_idx = static_cast<const int32_t*>(in[1].untyped_data());
    a.top_k = static_cast<int32_t>(id[1]);
    size_t next = 4;
    if (has_expert_scale) {
      const ffi::AnyBuffer& s = in[next++];
      if (s.element_type() != dt || !same_shape(s, {t, id[1]})) {
        return invalid("expert_scale_factor must be [tokens, top_k] in residual_in's dtype");
      }
      a.expert_scale_factor = s.untyped_data();
    }
    if (has_shared_expert) {
      const ffi::AnyBuffer& s = in[next++];
      if (s.element_type() != dt || !same_shape(s, {t, h})) {
        return invalid("shared_expert_output must have residual_in's shape and dtype");
      }
      a.shared_expert_output = s.untyped_data();
    }
  }
  void* out[3] = {};
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    if ((*r)->element_type() != dt || (*r)->element_count() != static_cast<size_t>(t * h)) {
      return invalid("every result must have residual_in's shape and dtype");
    }
    out[i] = (*r)->untyped_data();
  }
  a.residual_out = out[0];
  a.norm_out = out[1];
  a.allreduce_out = out[2];

  // The error code of the status (errors.h): the caller's mistakes are not INTERNAL.
  if (int status = fusedar_moe_launch(rank, &a, stream)) return core_error(status);
  return ffi::Error::Success();
}

// The host twin (never runs): see FusedarAllReduceFusionHostHandler.
ffi::Error MoeAllReduceFusionHostImpl(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "jax_fusedar: the MoE all-reduce kernels run on CUDA GPUs only; CPU "
                    "programs use the reference lowering, so this call comes from a program "
                    "lowered for cuda alone");
}

}  // namespace
}  // namespace fusedar::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedarMoeAllReduceFusionHandler,
                              fusedar::xla::MoeAllReduceFusionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("workspace_id")
                                  .Attr<int32_t>("pattern")
                                  .Attr<float>("rms_eps")
                                  .Attr<float>("weight_bias")
                                  .Attr<float>("routed_scaling_factor")
                                  .Attr<bool>("has_expert_scale")
                                  .Attr<bool>("has_shared_expert")
                                  .Attr<bool>("allreduce_out"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FusedarMoeAllReduceFusionHostHandler, fusedar::xla::MoeAllReduceFusionHostImpl,
    ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs<ffi::Dictionary>());
