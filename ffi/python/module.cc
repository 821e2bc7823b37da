// _fusedar: the Python face of the native core, shared by jax_fusedar and
// torch_compat. It exposes
//   - Rank: one TP rank's workspace on one device (create, exchange, finalize, destroy,
//     and a raw-pointer launch used by the torch layer and the GPU tests);
//   - registrations(): the XLA FFI handler capsules, one table for all targets (and
//     host_registrations(): the host twins multi-platform exports need);
//   - the workspace registry the XLA handlers consult;
//   - a few device queries;
//   - the native side of the contract tests/native/test_contract.py holds equal to the
//     Python one: the pattern table, the workspace sizes, the MoE shape rule and the FFI
//     target names.
// No JAX or torch headers: tensors arrive as integer device pointers and streams.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../xla/errors.h"
#include "../xla/handlers.h"
#include "../xla/result_check.h"
#include "../xla/workspace_registry.h"
#include "fusedar/core.h"
#include "fusedar/patterns.h"

namespace nb = nanobind;

namespace {

// The exception of a failed core call (one rule with the XLA handlers, errors.h): invalid
// arguments and unsupported configurations are the caller's to fix (ValueError); CUDA and
// internal failures, and any status this module does not know, are RuntimeError.
[[noreturn]] void raise_status(int rc, const std::string& msg) {
  if (fusedar::xla::is_callers_error(rc)) throw nb::value_error(msg.c_str());
  throw std::runtime_error(msg);
}

void check(int rc) {
  if (rc == FUSEDAR_OK) return;
  raise_status(rc, fusedar_last_error());
}

// The module's element-type names (numpy's) as result_check.h's Element.
fusedar::xla::Element element_named(const std::string& name) {
  using fusedar::xla::Element;
  for (Element e : {Element::kFloat32, Element::kFloat16, Element::kBFloat16, Element::kUInt8,
                    Element::kFloat8E4M3FN, Element::kInt32}) {
    if (name == fusedar::xla::element_name(e)) return e;
  }
  return Element::kOther;
}

const fusedar::PatternTraits& dense_pattern(int pattern) {
  const fusedar::PatternTraits* traits = fusedar::find_dense_pattern(pattern);
  if (traits == nullptr) {
    throw nb::value_error(("unknown fusion pattern " + std::to_string(pattern)).c_str());
  }
  return *traits;
}

// One row of fusedar/patterns.h, with the rules derived from it, under the names of
// jax_fusedar/common/patterns.py.
nb::dict traits_dict(const fusedar::PatternTraits& p) {
  nb::dict d;
  d["code"] = p.code;
  d["family"] = fusedar::family_name(p.family);
  d["has_allreduce_out"] = p.allreduce_out();
  d["has_residual"] = p.residual;
  d["has_norm_out"] = p.norm_out;
  if (p.quant_out()) {
    d["quant"] = fusedar::quant_kind_name(p.quant);
  } else {
    d["quant"] = nb::none();
  }
  d["uses_scale_factor"] = p.scale_factor();
  d["writes_scale_out"] = p.scale_out();
  d["needs_sm100"] = p.needs_sm100();
  d["operands"] = p.operands();
  d["results"] = p.results();
  d["compiled"] = fusedar_pattern_compiled(p.code) != 0;
  return d;
}

nb::dict info_dict(const fusedar_workspace_info& i) {
  nb::dict d;
  d["world_size"] = i.world_size;
  d["max_token_num"] = i.max_token_num;
  d["hidden_dim"] = i.hidden_dim;
  d["dtype"] = i.dtype;
  d["two_shot_buffer_bytes"] = i.two_shot_buffer_bytes;
  d["flag_bytes"] = i.flag_bytes;
  d["lamport_comm_bytes"] = i.lamport_comm_bytes;
  d["lamport_buffer_bytes"] = i.lamport_buffer_bytes;
  return d;
}

class Rank {
 public:
  Rank(int device, int world_size, int rank, int max_token_num, int hidden_dim, int dtype,
       bool handshake, double handshake_timeout_s, double timeout_s) {
    check(fusedar_rank_create(device, world_size, rank, max_token_num, hidden_dim, dtype, &r_));
    int rc = fusedar_rank_set_timeout(r_, timeout_s);
    if (rc == FUSEDAR_OK && handshake) rc = fusedar_rank_set_call_check(r_, 1, handshake_timeout_s);
    if (rc != FUSEDAR_OK) {
      std::string msg = fusedar_last_error();
      release();
      raise_status(rc, msg);
    }
  }
  ~Rank() { release(); }
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  fusedar_rank* get() const {
    if (r_ == nullptr) throw nb::value_error("this workspace rank was destroyed");
    return r_;
  }

  std::vector<uint64_t> local_pointers() const {
    std::vector<uint64_t> out(FUSEDAR_SHARED_BUFFERS);
    check(fusedar_rank_local_pointers(get(), out.data()));
    return out;
  }
  nb::bytes export_ipc() const {
    uint8_t buf[FUSEDAR_SHARED_BUFFERS * FUSEDAR_IPC_HANDLE_BYTES];
    check(fusedar_rank_export_ipc(get(), buf));
    return nb::bytes(reinterpret_cast<const char*>(buf), sizeof(buf));
  }
  void set_peer_pointers(int peer, int peer_device, const std::vector<uint64_t>& ptrs) {
    if (ptrs.size() != FUSEDAR_SHARED_BUFFERS) throw nb::value_error("expected 3 pointers");
    check(fusedar_rank_set_peer_pointers(get(), peer, peer_device, ptrs.data()));
  }
  void open_peer_ipc(int peer, nb::bytes handles) {
    if (handles.size() != FUSEDAR_SHARED_BUFFERS * FUSEDAR_IPC_HANDLE_BYTES) {
      throw nb::value_error("expected 3 CUDA IPC handles (192 bytes)");
    }
    check(
        fusedar_rank_open_peer_ipc(get(), peer, reinterpret_cast<const uint8_t*>(handles.c_str())));
  }
  void finalize() { check(fusedar_rank_finalize(get())); }
  void destroy() {
    if (r_ == nullptr) return;
    fusedar::xla::unregister_rank(r_);
    {
      // Wait for the kernels in flight first, without the GIL (as the launches), and with
      // the rank still readable: a wait that times out writes its failure record only as
      // it traps, and the lost-trap watcher (jax_fusedar/common/lost_traps.py) reads the
      // record through failure() from another thread meanwhile. An error here is the
      // device's sticky one, which fusedar_rank_destroy reports again below.
      nb::gil_scoped_release release;
      fusedar_device_synchronize(fusedar_rank_device(r_));
    }
    // The record lives in memory fusedar_rank_destroy frees: keep its text for failure().
    failure_at_destroy_ = failure();
    fusedar_rank* r = r_;
    r_ = nullptr;
    int rc = FUSEDAR_OK;
    {
      nb::gil_scoped_release release;
      rc = fusedar_rank_destroy(r);
    }
    check(rc);  // the core's last error is per thread: this thread's
  }
  bool alive() const { return r_ != nullptr; }
  int device() const { return fusedar_rank_device(get()); }
  int rank() const { return fusedar_rank_index(get()); }
  uint64_t table() const { return fusedar_rank_workspace_table(get()); }
  bool handshake() const {
    int32_t on = 0;
    double t = 0;
    check(fusedar_rank_call_check(get(), &on, &t));
    return on != 0;
  }
  double handshake_timeout_s() const {
    int32_t on = 0;
    double t = 0;
    check(fusedar_rank_call_check(get(), &on, &t));
    return t;
  }
  double timeout_s() const {
    double t = 0;
    check(fusedar_rank_timeout(get(), &t));
    return t;
  }
  void set_timeout(double timeout_s) { check(fusedar_rank_set_timeout(get(), timeout_s)); }
  // "" unless a wait of this rank timed out or a handshake failed; readable
  // after the trap, and after destroy() (the text it had then).
  std::string failure() const {
    if (r_ == nullptr) return failure_at_destroy_;
    std::vector<char> buf(2048);
    check(fusedar_rank_failure(get(), buf.data(), buf.size()));
    return std::string(buf.data());
  }
  nb::dict info() const {
    fusedar_workspace_info i;
    check(fusedar_rank_info(get(), &i));
    return info_dict(i);
  }

  // Raw-pointer entry for frameworks without an XLA-style custom call (torch) and
  // for tests. Pointers are integers (tensor.data_ptr()), 0 meaning "absent".
  void launch(int pattern, int dtype, int64_t num_tokens, int64_t hidden_dim, uint64_t input,
              uint64_t allreduce_out, uint64_t residual_in, uint64_t residual_out,
              uint64_t norm_out, uint64_t quant_out, uint64_t scale_out, uint64_t rms_gamma,
              uint64_t scale_factor, float rms_eps, float weight_bias, int algorithm, bool fp32_acc,
              int layout, int block_quant_group_size, bool launch_with_pdl,
              bool trigger_completion_at_end, uint64_t stream, bool check_only) const {
    fusedar_launch_args a{};
    a.pattern = pattern;
    a.dtype = dtype;
    a.num_tokens = num_tokens;
    a.hidden_dim = hidden_dim;
    a.input = reinterpret_cast<const void*>(input);
    a.allreduce_out = reinterpret_cast<void*>(allreduce_out);
    a.residual_in = reinterpret_cast<const void*>(residual_in);
    a.residual_out = reinterpret_cast<void*>(residual_out);
    a.norm_out = reinterpret_cast<void*>(norm_out);
    a.quant_out = reinterpret_cast<void*>(quant_out);
    a.scale_out = reinterpret_cast<void*>(scale_out);
    a.rms_gamma = reinterpret_cast<const void*>(rms_gamma);
    a.scale_factor = reinterpret_cast<const float*>(scale_factor);
    a.rms_eps = rms_eps;
    a.weight_bias = weight_bias;
    a.algorithm = algorithm;
    a.fp32_acc = fp32_acc ? 1 : 0;
    a.layout = layout;
    a.block_quant_group_size = block_quant_group_size;
    a.launch_with_pdl = launch_with_pdl ? 1 : 0;
    a.trigger_completion_at_end = trigger_completion_at_end ? 1 : 0;
    if (check_only) {
      check(fusedar_check_launch(get(), &a));
      return;
    }
    nb::gil_scoped_release release;
    int rc = fusedar_launch(get(), &a, reinterpret_cast<void*>(stream));
    nb::gil_scoped_acquire acquire;
    check(rc);
  }

  // Raw-pointer entry for FlashInfer's MoE patterns 6 and 7 (fusedar_moe_launch_args);
  // pointers are integers, 0 meaning "absent".
  void moe_launch(int pattern, int dtype, int64_t num_tokens, int64_t hidden_dim, int num_experts,
                  uint64_t expert_scales, uint64_t expert_outputs, uint64_t token_input,
                  uint64_t allreduce_out, uint64_t permuted_input, int64_t num_permuted_rows,
                  uint64_t expanded_idx_to_permuted_idx, int top_k, uint64_t expert_scale_factor,
                  uint64_t shared_expert_output, float routed_scaling_factor, uint64_t residual_in,
                  uint64_t residual_out, uint64_t norm_out, uint64_t rms_gamma, float rms_eps,
                  float weight_bias, bool launch_with_pdl, uint64_t stream, bool check_only) const {
    fusedar_moe_launch_args a{};
    a.pattern = pattern;
    a.dtype = dtype;
    a.num_tokens = num_tokens;
    a.hidden_dim = hidden_dim;
    a.num_experts = num_experts;
    a.expert_scales = reinterpret_cast<const float*>(expert_scales);
    a.expert_outputs = reinterpret_cast<const void*>(expert_outputs);
    a.token_input = reinterpret_cast<const void*>(token_input);
    a.allreduce_out = reinterpret_cast<void*>(allreduce_out);
    a.permuted_input = reinterpret_cast<const void*>(permuted_input);
    a.num_permuted_rows = num_permuted_rows;
    a.expanded_idx_to_permuted_idx = reinterpret_cast<const int32_t*>(expanded_idx_to_permuted_idx);
    a.top_k = top_k;
    a.expert_scale_factor = reinterpret_cast<const void*>(expert_scale_factor);
    a.shared_expert_output = reinterpret_cast<const void*>(shared_expert_output);
    a.routed_scaling_factor = routed_scaling_factor;
    a.residual_in = reinterpret_cast<const void*>(residual_in);
    a.residual_out = reinterpret_cast<void*>(residual_out);
    a.norm_out = reinterpret_cast<void*>(norm_out);
    a.rms_gamma = reinterpret_cast<const void*>(rms_gamma);
    a.rms_eps = rms_eps;
    a.weight_bias = weight_bias;
    a.launch_with_pdl = launch_with_pdl ? 1 : 0;
    if (check_only) {
      check(fusedar_check_moe_launch(get(), &a));
      return;
    }
    nb::gil_scoped_release release;
    int rc = fusedar_moe_launch(get(), &a, reinterpret_cast<void*>(stream));
    nb::gil_scoped_acquire acquire;
    check(rc);
  }

 private:
  void release() {
    if (r_ != nullptr) {
      fusedar::xla::unregister_rank(r_);
      fusedar_rank_destroy(r_);
      r_ = nullptr;
    }
  }
  fusedar_rank* r_ = nullptr;
  std::string failure_at_destroy_;
};

template <typename T>
nb::capsule encapsulate(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn), "xla._CUSTOM_CALL_TARGET");
}

}  // namespace

NB_MODULE(_fusedar, m) {
  m.doc() = "jax_fusedar native core bindings (shared by the JAX and torch layers)";
  // The core is a separate library (a prebuilt one can be swapped in, see
  // JAX_FUSEDAR_PREBUILT_CORE): refuse one built from another C API than this module's
  // header, whose structs it would misread.
  if (fusedar_abi_version() != FUSEDAR_ABI_VERSION) {
    throw std::runtime_error(
        "jax_fusedar: the native core has ABI version " + std::to_string(fusedar_abi_version()) +
        ", this module was built "
        "for " +
        std::to_string(FUSEDAR_ABI_VERSION) + ": rebuild both from the same source");
  }
  m.attr("ABI_VERSION") = fusedar_abi_version();
  m.attr("FLOAT32") = int(FUSEDAR_FLOAT32);
  m.attr("FLOAT16") = int(FUSEDAR_FLOAT16);
  m.attr("BFLOAT16") = int(FUSEDAR_BFLOAT16);

  m.def("registrations", []() {
    nb::dict d;
    d[FUSEDAR_TARGET_ALLREDUCE_FUSION] = encapsulate(FusedarAllReduceFusionHandler);
    d[FUSEDAR_TARGET_MOE_ALLREDUCE_FUSION] = encapsulate(FusedarMoeAllReduceFusionHandler);
    d[FUSEDAR_TARGET_DEVICE_TIMESTAMP] = encapsulate(FusedarDeviceTimestampHandler);
    return d;
  });
  // Targets registered for the host platform (jax_fusedar/ops/family.py, register_ffi_targets).
  m.def("host_registrations", []() {
    nb::dict d;
    d[FUSEDAR_TARGET_ALLREDUCE_FUSION] = encapsulate(FusedarAllReduceFusionHostHandler);
    d[FUSEDAR_TARGET_MOE_ALLREDUCE_FUSION] = encapsulate(FusedarMoeAllReduceFusionHostHandler);
    return d;
  });

  m.def("workspace_sizes", [](int world_size, int max_token_num, int hidden_dim, int dtype) {
    fusedar_workspace_info i;
    check(fusedar_workspace_sizes(world_size, max_token_num, hidden_dim, dtype, &i));
    return info_dict(i);
  });
  // The MoE shape rule (fusedar_moe_shape_check) of a call of num_tokens x hidden_dim of
  // `dtype` on a workspace created with these arguments: None, or why it is refused.
  m.def("moe_shape_problem",
        [](int world_size, int max_token_num, int workspace_hidden_dim, int workspace_dtype,
           int pattern, int dtype, int64_t num_tokens, int64_t hidden_dim) -> nb::object {
          fusedar_workspace_info i;
          check(fusedar_workspace_sizes(world_size, max_token_num, workspace_hidden_dim,
                                        workspace_dtype, &i));
          if (fusedar_moe_shape_check(&i, pattern, dtype, num_tokens, hidden_dim) == FUSEDAR_OK) {
            return nb::none();
          }
          return nb::str(fusedar_last_error());
        });
  m.def("pattern_compiled", [](int pattern) { return fusedar_pattern_compiled(pattern) != 0; });
  // Every pattern the native table serves: {code: traits}.
  m.def("pattern_table", []() {
    nb::dict d;
    for (const fusedar::PatternTraits& p : fusedar::kPatterns) d[nb::int_(p.code)] = traits_dict(p);
    return d;
  });
  m.def("ffi_target_names", []() {
    nb::dict d;
    d["allreduce_fusion"] = FUSEDAR_TARGET_ALLREDUCE_FUSION;
    d["moe_allreduce_fusion"] = FUSEDAR_TARGET_MOE_ALLREDUCE_FUSION;
    d["device_timestamp"] = FUSEDAR_TARGET_DEVICE_TIMESTAMP;
    return d;
  });

  // The error rule (errors.h), for the contract test: the core's status codes, the XLA FFI
  // error code each becomes in a handler, and the exception each raises here.
  m.def("status_codes", []() {
    nb::dict d;
    d["OK"] = int(FUSEDAR_OK);
    d["INVALID_ARGUMENT"] = int(FUSEDAR_INVALID_ARGUMENT);
    d["CUDA_ERROR"] = int(FUSEDAR_CUDA_ERROR);
    d["UNSUPPORTED"] = int(FUSEDAR_UNSUPPORTED);
    d["INTERNAL"] = int(FUSEDAR_INTERNAL);
    return d;
  });
  m.def(
      "ffi_error_code",
      [](int status) {
        return std::string(fusedar::xla::error_code_name(fusedar::xla::error_code(status)));
      },
      nb::arg("status"));
  m.def(
      "raise_status",
      [](int status, const std::string& message) {
        if (status != FUSEDAR_OK) raise_status(status, message);
      },
      nb::arg("status"), nb::arg("message"));
  // The dense handler's result rule (result_check.h): [(name, element type, count)], and
  // what it reports for a call's results [(element type, count)] ("" when they match).
  m.def(
      "expected_results",
      [](int pattern, int dtype, int64_t tokens, int64_t hidden, int layout,
         int block_quant_group_size) {
        std::vector<fusedar::xla::ResultLayout> want;
        std::string why;
        if (!fusedar::xla::expected_results(dense_pattern(pattern), dtype, tokens, hidden, layout,
                                            block_quant_group_size, &want, &why)) {
          throw nb::value_error(why.c_str());
        }
        std::vector<std::tuple<std::string, std::string, int64_t>> out;
        for (const auto& r : want) {
          out.emplace_back(r.name, fusedar::xla::element_name(r.element), r.count);
        }
        return out;
      },
      nb::arg("pattern"), nb::arg("dtype"), nb::arg("tokens"), nb::arg("hidden"),
      nb::arg("layout") = 0, nb::arg("block_quant_group_size") = 0);
  m.def(
      "results_problem",
      [](int pattern, int dtype, int64_t tokens, int64_t hidden, int layout,
         int block_quant_group_size, const std::vector<std::tuple<std::string, int64_t>>& results) {
        std::vector<fusedar::xla::GivenResult> given;
        for (const auto& [name, count] : results) given.push_back({element_named(name), count});
        return fusedar::xla::results_problem(dense_pattern(pattern), dtype, tokens, hidden, layout,
                                             block_quant_group_size, given);
      },
      nb::arg("pattern"), nb::arg("dtype"), nb::arg("tokens"), nb::arg("hidden"), nb::arg("layout"),
      nb::arg("block_quant_group_size"), nb::arg("results"));

  m.def("device_count", []() {
    int32_t c = 0;
    check(fusedar_device_count(&c));
    return c;
  });
  m.def("can_access_peer", [](int device, int peer) {
    int32_t can = 0;
    check(fusedar_can_access_peer(device, peer, &can));
    return can != 0;
  });
  m.def("compute_capability", [](int device) {
    int32_t major = 0, minor = 0;
    check(fusedar_device_compute_capability(device, &major, &minor));
    return std::make_tuple(major, minor);
  });
  m.def("mem_info", [](int device) {
    uint64_t f = 0, t = 0;
    check(fusedar_device_mem_info(device, &f, &t));
    return std::make_tuple(f, t);
  });
  m.def("synchronize", [](int device) { check(fusedar_device_synchronize(device)); });
  m.def("launch_count", []() { return fusedar_launch_count(); });

  m.def("register_rank", [](int64_t workspace_id, int device_ordinal, const Rank& rank) {
    fusedar::xla::register_rank(workspace_id, device_ordinal, rank.get());
  });

  nb::class_<Rank>(m, "Rank", nb::is_weak_referenceable())  // watched by lost_traps
      .def(nb::init<int, int, int, int, int, int, bool, double, double>(), nb::arg("device"),
           nb::arg("world_size"), nb::arg("rank"), nb::arg("max_token_num"), nb::arg("hidden_dim"),
           nb::arg("dtype"), nb::arg("handshake") = false, nb::arg("handshake_timeout_s") = 30.0,
           nb::arg("timeout_s") = FUSEDAR_DEFAULT_TIMEOUT_S)
      .def("local_pointers", &Rank::local_pointers)
      .def("export_ipc", &Rank::export_ipc)
      .def("set_peer_pointers", &Rank::set_peer_pointers, nb::arg("peer"), nb::arg("peer_device"),
           nb::arg("pointers"))
      .def("open_peer_ipc", &Rank::open_peer_ipc, nb::arg("peer"), nb::arg("handles"))
      .def("finalize", &Rank::finalize)
      .def("destroy", &Rank::destroy)
      .def_prop_ro("alive", &Rank::alive)
      .def_prop_ro("device", &Rank::device)
      .def_prop_ro("rank", &Rank::rank)
      .def_prop_ro("table", &Rank::table)
      .def("info", &Rank::info)
      .def_prop_ro("handshake", &Rank::handshake)
      .def_prop_ro("handshake_timeout_s", &Rank::handshake_timeout_s)
      .def_prop_ro("timeout_s", &Rank::timeout_s)
      .def("set_timeout", &Rank::set_timeout, nb::arg("timeout_s"))
      .def("failure", &Rank::failure)
      .def("launch", &Rank::launch, nb::arg("pattern"), nb::arg("dtype"), nb::arg("num_tokens"),
           nb::arg("hidden_dim"), nb::arg("input"), nb::arg("allreduce_out") = 0,
           nb::arg("residual_in") = 0, nb::arg("residual_out") = 0, nb::arg("norm_out") = 0,
           nb::arg("quant_out") = 0, nb::arg("scale_out") = 0, nb::arg("rms_gamma") = 0,
           nb::arg("scale_factor") = 0, nb::arg("rms_eps") = 1e-6f, nb::arg("weight_bias") = 0.0f,
           nb::arg("algorithm") = int(FUSEDAR_ALGORITHM_ONESHOT), nb::arg("fp32_acc") = true,
           nb::arg("layout") = 0, nb::arg("block_quant_group_size") = 0,
           nb::arg("launch_with_pdl") = true, nb::arg("trigger_completion_at_end") = true,
           nb::arg("stream") = 0, nb::arg("check_only") = false)
      .def("moe_launch", &Rank::moe_launch, nb::arg("pattern"), nb::arg("dtype"),
           nb::arg("num_tokens"), nb::arg("hidden_dim"), nb::arg("num_experts") = 0,
           nb::arg("expert_scales") = 0, nb::arg("expert_outputs") = 0, nb::arg("token_input") = 0,
           nb::arg("allreduce_out") = 0, nb::arg("permuted_input") = 0,
           nb::arg("num_permuted_rows") = 0, nb::arg("expanded_idx_to_permuted_idx") = 0,
           nb::arg("top_k") = 0, nb::arg("expert_scale_factor") = 0,
           nb::arg("shared_expert_output") = 0, nb::arg("routed_scaling_factor") = 1.0f,
           nb::arg("residual_in") = 0, nb::arg("residual_out") = 0, nb::arg("norm_out") = 0,
           nb::arg("rms_gamma") = 0, nb::arg("rms_eps") = 1e-6f, nb::arg("weight_bias") = 0.0f,
           nb::arg("launch_with_pdl") = true, nb::arg("stream") = 0, nb::arg("check_only") = false);
}
