"""torch_compat.library (custom ops + fake impls) and torch_compat.fusion_pass on CPU. The real
kernels are CUDA-only: where an op must run on CPU tensors (opcheck, torch.compile, a
rewritten graph's numerics) a test registers, for its duration only, a CPU reference with
world-size-1 semantics (the sum is the input). It checks the plumbing, not the kernel
(tests/gpu/test_torch.py)."""

import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torch_compat
from torch_compat import fusion_pass, library

from tests.torch import fakes
from tests.torch import rounding_check as rc
from tests.torch.fakes import AR, FUSED, QUANT, registered
from tests.torch.rounding_check import ref_fused as _ref_fused  # world size 1: sum = input

# Also in the oldest-versions lane (./dev oldest).
pytestmark = pytest.mark.oldest

EPS = 1e-6
FLAGS = (EPS, 0.0, None, False)  # the fused op's eps, weight_bias, use_oneshot, fp32_acc
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
# A one-member group of bfloat16, 64 tokens x 256 (tests/torch/fakes.py).
fake_workspace = functools.partial(
    fakes.fake_workspace, max_tokens=64, hidden=256, global_ranks=(0,)
)
# Every opcheck test but autograd (the ops are forward-only collectives, with no derivative
# registered; they run in inference graphs).
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
OPCHECK_UTILS += ("test_aot_dispatch_dynamic",)


def _ref_ar(input, use_oneshot, fp32_acc, handle):
    library.lookup_workspace(handle)
    return input.clone()


@pytest.fixture
def cpu_kernels():
    """CPU reference kernels for the two ops, registered for this test only."""
    with torch.library._scoped_library("torch_compat", "IMPL") as lib:
        lib.impl("allreduce_residual_rmsnorm", _ref_fused, "CPU")
        lib.impl("allreduce", _ref_ar, "CPU")
        yield


def _inputs(m=8, h=256, dtype=BF16, seed=0, device=None):
    """(input, residual, gamma): random CPU tensors, or empty ones on ``device`` (under
    FakeTensorMode, fake CUDA tensors: no GPU needed)."""
    if device is not None:
        x, res = (torch.empty(m, h, dtype=dtype, device=device) for _ in range(2))
        return x, res, torch.empty(h, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*s, generator=g).to(dtype) for s in ((m, h), (m, h), (h,)))


def test_registry_roundtrip_and_errors():
    ws = fake_workspace()
    h = library.register_workspace(ws)
    try:
        assert isinstance(h, int)
        assert library.register_workspace(ws) == h  # idempotent
        assert library.lookup_workspace(h) is ws
        h2 = library.register_workspace(fake_workspace())
        assert h2 != h
        library.unregister_workspace(h2)
        with pytest.raises(KeyError, match="no all-reduce fusion workspace"):
            library.lookup_workspace(h2)
        ws.destroy()
        with pytest.raises(RuntimeError, match="destroyed"):
            library.lookup_workspace(h)
    finally:
        library.unregister_workspace(h)
    with pytest.raises(TypeError):
        library.register_workspace(object())


def test_exports_and_schemas():
    assert torch_compat.library is library
    assert torch_compat.register_workspace is library.register_workspace
    assert torch_compat.fuse_allreduce_rmsnorm is fusion_pass.fuse_allreduce_rmsnorm
    assert str(FUSED._schema) == (
        "torch_compat::allreduce_residual_rmsnorm(Tensor input, Tensor residual, Tensor gamma, "
        "float eps, float weight_bias, bool? use_oneshot, bool fp32_acc, SymInt workspace_handle)"
        " -> (Tensor, Tensor)"
    )
    assert str(AR._schema) == (
        "torch_compat::allreduce(Tensor input, bool? use_oneshot, "
        "bool fp32_acc, SymInt workspace_handle) -> Tensor"
    )
    assert str(QUANT._schema) == (
        "torch_compat::allreduce_residual_rmsnorm_quant(Tensor input, Tensor residual, "
        "Tensor gamma, float eps, float weight_bias, SymInt pattern, Tensor? scale_factor, "
        "SymInt? block_quant_group_size, SymInt? layout_code, bool? use_oneshot, "
        "bool fp32_acc, SymInt workspace_handle) -> (Tensor, Tensor, Tensor, Tensor)"
    )
    assert not any(op._schema.is_mutable for op in (FUSED, AR, QUANT))
    assert library.QUANT_PATTERNS == (2, 3, 4, 5, 8, 9, 10, 11)


# --- the real (CUDA) implementation's wiring, through a FakeRank
def test_real_impl_launches_pattern1_through_the_workspace(cpu_stream):
    ws = fake_workspace(global_ranks=(0, 1))
    with registered(ws) as h:
        x, res, g = _inputs()
        r, n = library.allreduce_residual_rmsnorm._init_fn(x, res, g, 1e-5, 1.0, None, True, h)
        assert r.shape == n.shape == x.shape and r.dtype == n.dtype == x.dtype
        ((args, kw),) = ws.native_rank().launches
        assert args[0] == 1 and args[2:4] == (8, 256) and args[4] == x.data_ptr()
        assert kw["residual_in"] == res.data_ptr() and kw["rms_gamma"] == g.data_ptr()
        assert kw["residual_out"] == r.data_ptr() and kw["norm_out"] == n.data_ptr()
        assert kw["rms_eps"] == 1e-5 and kw["weight_bias"] == 1.0 and kw["fp32_acc"] is True
        assert kw["stream"] == 0xC0FFEE
        out = library.allreduce._init_fn(x, False, False, h)
        (args, kw) = ws.native_rank().launches[-1]
        assert args[0] == 0 and kw["allreduce_out"] == out.data_ptr()
        assert kw["algorithm"] == 0  # two-shot (forced)


def test_op_on_cpu_tensors_has_no_kernel(handle):
    with pytest.raises(NotImplementedError):
        FUSED(*_inputs(), *FLAGS, handle)


# --- fake tensors, opcheck, torch.compile
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_fake_tensor_mode_shapes_and_dtypes(dtype):
    # A workspace of the inputs' element width: the fake impls check it as the eager op does.
    with registered(fake_workspace(dtype=dtype)) as handle, FakeTensorMode() as mode:
        x, res, g = _inputs(5, dtype=dtype, device="cuda")
        r, n = FUSED(x, res, g, *FLAGS, handle)
        o = AR(x, None, False, handle)
    for t in (r, n, o):
        assert t.fake_mode is mode
        assert t.shape == (5, 256) and t.dtype == dtype and t.device.type == "cuda"
        assert t.is_contiguous()


def test_fake_impls_check_shapes_and_patterns(handle):
    """The eager op's own checks and messages (ops.check_call); the handle's workspace is a
    bfloat16 one."""
    with FakeTensorMode():
        x = torch.empty(5, 256, dtype=BF16)
        with pytest.raises(ValueError, match=r"rms_gamma must have shape \[hidden_dim\]"):
            FUSED(x, torch.empty(5, 256, dtype=BF16), torch.empty(128, dtype=BF16), *FLAGS, handle)
        with pytest.raises(ValueError, match="residual_in must have the input's shape"):
            FUSED(x, torch.empty(4, 256, dtype=BF16), torch.empty(256, dtype=BF16), *FLAGS, handle)
        for p in (0, 1):
            with pytest.raises(RuntimeError, match="quantized patterns"):
                QUANT(*_quant_args(p, None, handle=handle))
        args = list(_quant_args(10, None, handle=handle))
        args[1] = torch.empty(4, 256)
        with pytest.raises(ValueError, match="residual_in must have the input's shape"):
            QUANT(*args)


def test_opcheck(cpu_kernels, handle):
    x, res, g = _inputs()
    torch.library.opcheck(FUSED, (x, res, g, *FLAGS, handle), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(AR, (x, None, False, handle), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(cpu_kernels, handle, fresh_dynamo, backend):
    def f(x, res, g):
        r, n = FUSED(AR(x, None, False, handle), res, g, *FLAGS, handle)
        return r * 2, n + 1

    x, res, g = _inputs()
    for a, b in zip(torch.compile(f, fullgraph=True, backend=backend)(x, res, g), f(x, res, g)):
        torch.testing.assert_close(a, b)


def test_torch_compile_fake_only_trace_with_dynamo_explain(handle, fresh_dynamo):
    # No kernel anywhere: dynamo + fake impls alone must produce one graph, no breaks.
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(lambda *a: FUSED(*a, *FLAGS, handle), fullgraph=True, backend=backend)
    with pytest.raises(Exception):
        compiled(*_inputs())  # the graph runs the op on CPU, which has no kernel
    assert len(backend.graphs) == 1
    fused = (FUSED, torch.ops.torch_compat.allreduce_residual_rmsnorm)
    assert sum(n.target in fused for n in backend.graphs[0].graph.nodes) == 1


# --- the fusion pass
def _rms_fn(x, g):
    return F.rms_norm(x, (x.shape[-1],), g, EPS)


def _rms_manual(x, g):  # rounds before gamma, as vLLM's and Hugging Face's norms do
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * g


def _rms_one_rounding(x, g):  # gamma in float32, one rounding: the fused op's order
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * g).to(x.dtype)


def _rms_in_the_activation_dtype(x, g):  # no rounding the fused op could reproduce
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g


def _trace(group, norm, m=8, hidden=256, blocks=4, dtype=BF16):
    """``blocks`` x (all-reduce, + residual, ``norm``) traced with make_fx; (gm, args)."""
    from torch.distributed import _functional_collectives as funcol

    def f(h, residual, *gammas):
        for i in range(blocks):
            residual = funcol.all_reduce(h * (i + 1), "sum", group) + residual
            h = norm(residual, gammas[i])
        return h, residual

    x, res, _ = _inputs(m, hidden, dtype)
    args = (x, res, *[torch.randn(hidden).to(dtype) for _ in range(blocks)])
    return make_fx(f, tracing_mode="fake")(*args), args


def _count(gm, target):
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


def _not_fused(gm, ws, **kw):
    """The pass fuses no block of ``gm`` and leaves its code as written."""
    before = gm.code
    assert fusion_pass.fuse_allreduce_rmsnorm(gm, ws, **kw) == 0
    assert gm.code == before


@pytest.mark.parametrize("norm", [_rms_fn, _rms_one_rounding], ids=["F.rms_norm", "one rounding"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_pass_fuses_every_block_bit_exactly(gloo_world1, cpu_kernels, norm, dtype):
    # Forms that round where the fused op does: fused by default, and the rewritten graph
    # gives the original's bits (the CPU stand-in computes the kernel's formula with torch's
    # own float32 ops, in the same order as the graph's norm).
    ws = fake_workspace(dtype=dtype)
    gm, args = _trace(gloo_world1, norm, dtype=dtype)
    want = gm(*args)
    ar = torch.ops._c10d_functional.all_reduce.default
    assert _count(gm, ar) == 4
    blocks = []
    n = torch_compat.fuse_allreduce_rmsnorm(gm, ws, report=blocks)
    assert n == 4, [b.line() for b in blocks]
    assert [(b.fused, b.rounding_change) for b in blocks] == [(True, None)] * 4
    assert _count(gm, FUSED) == 4 and _count(gm, ar) == 0
    assert _count(gm, torch.ops.aten.rsqrt.default) == 0
    for g_, w_ in zip(gm(*args), want):
        assert g_.dtype == w_.dtype and g_.shape == w_.shape
        assert torch.equal(g_, w_)
    library.unregister_workspace(library.register_workspace(ws))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_pass_leaves_a_rounding_change_alone_unless_asked(gloo_world1, cpu_kernels, dtype):
    # Rounding before gamma (16-bit): not the fused op's rounding, so left as written by
    # default, with the reason; fused with allow_rounding_change=True, each block naming it.
    gm, args = _trace(gloo_world1, _rms_manual, dtype=dtype)
    blocks = []
    _not_fused(gm, fake_workspace(dtype=dtype), report=blocks)
    name = str(dtype).replace("torch.", "")
    change = f"gamma multiplied in {name} after the norm is rounded to {name}"
    assert [b.fused for b in blocks] == [False] * 4
    for b in blocks:
        assert change in b.reason and "allow_rounding_change=True" in b.reason
    blocks = []
    ws = fake_workspace(dtype=dtype)
    n = torch_compat.fuse_allreduce_rmsnorm(gm, ws, allow_rounding_change=True, report=blocks)
    assert n == 4
    assert [(b.fused, b.rounding_change) for b in blocks] == [(True, change)] * 4
    assert "rounding change: gamma multiplied" in blocks[0].line()


def test_pass_allow_rounding_change_is_a_bool(gloo_world1):
    gm, _ = _trace(gloo_world1, _rms_fn)
    with pytest.raises(TypeError, match="allow_rounding_change must be True or False"):
        fusion_pass.fuse_allreduce_rmsnorm(gm, fake_workspace(), allow_rounding_change="yes")


def test_pass_never_fuses_a_norm_computed_in_the_activation_dtype(gloo_world1):
    for allow in (False, True):  # opt-in or not
        gm, _ = _trace(gloo_world1, _rms_in_the_activation_dtype)
        blocks = []
        _not_fused(gm, fake_workspace(), allow_rounding_change=allow, report=blocks)
        assert all("RMSNorm computed in bfloat16, not float32" in b.reason for b in blocks)


def test_pass_leaves_graph_untouched_when_workspace_too_small(gloo_world1):
    gm, _ = _trace(gloo_world1, _rms_fn, m=8, hidden=256)
    _not_fused(gm, fake_workspace(max_tokens=4, hidden=256))  # 4*256 < 8*256 elements


def test_pass_refuses_dtype_width_mismatch(gloo_world1):
    gm, _ = _trace(gloo_world1, _rms_fn, dtype=torch.float32)
    _not_fused(gm, fake_workspace(dtype=BF16))


def test_pass_only_fuses_the_workspaces_group(gloo_world1):
    gm, _ = _trace(gloo_world1, _rms_fn)
    other = fake_workspace(global_ranks=(0, 1))  # another group than WORLD = [0]
    _not_fused(gm, other)
    _not_fused(gm, fake_workspace(), group_name="not-this-group")
    assert fusion_pass.fuse_allreduce_rmsnorm(gm, other, group_name=gloo_world1.group_name) == 4


def test_pass_skips_blocks_whose_allreduce_output_is_used_elsewhere(gloo_world1):
    # The plain sum is needed too: pattern 1 cannot give it.
    f = rc.block_fn(gloo_world1, lambda t, res, g: (_rms_fn(t + res, g), t * 3), residual_arg=True)
    _not_fused(make_fx(f, tracing_mode="fake")(*_inputs()), fake_workspace())


def test_pass_skips_norm_without_weight_and_rmsnorm_of_other_things(gloo_world1):
    f = rc.block_fn(gloo_world1, lambda r, g: F.rms_norm(r, (r.shape[-1],), None, EPS))
    gm = make_fx(f, tracing_mode="fake")(*_inputs())  # gamma: an input the graph leaves unused
    _not_fused(gm, fake_workspace())


@pytest.mark.parametrize("form", ["rms_norm", "fused_rms_norm", "fused_rms_norm_rstd_used"])
def test_pass_on_undecomposed_norms(gloo_world1, cpu_kernels, form):
    """A hand-built graph of one all_reduce -> wait -> add residual -> norm block, as a
    pre-decomposition graph holds it: aten.rms_norm whole, or aten._fused_rms_norm (what
    F.rms_norm becomes on CUDA undecomposed), whose (output, rstd) is fused only when rstd
    is not used too."""
    fused_norm, rstd_used = torch.ops.aten._fused_rms_norm.default, form.endswith("rstd_used")
    g = torch.fx.Graph()
    x, res, gamma = g.placeholder("x"), g.placeholder("res"), g.placeholder("gamma")
    ar = g.call_function(
        torch.ops._c10d_functional.all_reduce.default, (x, "sum", gloo_world1.group_name)
    )
    w = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    r = g.call_function(torch.ops.aten.add.Tensor, (res, w))
    if form == "rms_norm":
        n = g.call_function(torch.ops.aten.rms_norm.default, (r, [256], gamma, EPS))
        outputs = [n, r]
    else:
        both = g.call_function(fused_norm, (r, [256], gamma, EPS))
        n = g.call_function(operator.getitem, (both, 0))
        outputs = [n, r] + ([g.call_function(operator.getitem, (both, 1))] if rstd_used else [])
    g.output(tuple(outputs))
    args = _inputs()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes_ = [mode.from_tensor(a) for a in args]
        for node, v in zip((x, res, gamma, ar, w, r, n), fakes_ + fakes_[:1] * 4):
            node.meta["val"] = v
        for node in g.nodes:
            if node.target is fused_norm:
                node.meta["val"] = node.target(fakes_[0], [256], fakes_[2], EPS)
    gm = torch.fx.GraphModule({}, g)
    want = gm(*args)
    assert fusion_pass.fuse_allreduce_rmsnorm(gm, fake_workspace()) == (0 if rstd_used else 1)
    got = gm(*args)
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    assert any(node.target is fused_norm for node in gm.graph.nodes) == rstd_used


def test_inductor_custom_pass_object(gloo_world1):
    gm, _ = _trace(gloo_world1, _rms_one_rounding)
    p = fusion_pass.AllReduceFusionPass(fake_workspace())
    # Inductor caches a graph compiled with a custom pass only when the pass is one of its
    # CustomGraphPass (registered on first use: torch_compat does not import inductor).
    from torch._inductor.custom_graph_pass import CustomGraphPass

    assert isinstance(p, CustomGraphPass)
    p(gm.graph)
    assert p.count == 4 and _count(gm, FUSED) == 4
    assert [b.fused for b in p.blocks] == [True] * 4
    assert p.uuid() == fusion_pass.AllReduceFusionPass(p.workspace).uuid()
    library.unregister_workspace(p.handle)


def test_inductor_end_to_end_with_post_grad_pass(gloo_world1, cpu_kernels, fresh_dynamo):
    # torch.compile(fullgraph=True) with inductor: dynamo traces the funcol all-reduce, the
    # pass rewrites the post-grad graph, inductor compiles around the custom op.
    p = fusion_pass.AllReduceFusionPass(fake_workspace(dtype=torch.float32))
    f = rc.block_fn(gloo_world1, _rms_fn)
    x, res, g = _inputs(dtype=torch.float32)
    try:
        # No cache: a hit (e.g. from an earlier run of this test) would skip the pass.
        with torch._inductor.config.patch(
            post_grad_custom_pre_pass=p, fx_graph_cache=False, force_disable_caches=True
        ):
            got = torch.compile(f, fullgraph=True, backend="inductor")(x, res, g)
    finally:
        library.unregister_workspace(p.handle)
    assert p.count == 1
    for a, b in zip(got, f(x, res, g)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --- the quantized op
def _ref_quant(x, res, gamma, eps, bias, pattern, scale, group, layout, oneshot, acc, handle):
    """World-size-1 CPU stand-in for the quantized op, quantizing with the independent numpy
    oracle (tests/oracles/quant_oracle.py); NVFP4 outputs are left zero (not an oracle check)."""
    from jax_fusedar.common.patterns import TRAITS, AllReduceFusionPattern

    library.lookup_workspace(handle)
    traits = TRAITS[AllReduceFusionPattern(pattern)]
    r_out, n_out, q_out, s_out = library._quant_outputs(x, pattern, group, layout)
    r = x + res
    n = rc.rms_norm_f32(r, gamma, eps, bias).to(x.dtype)
    r_out.copy_(r)
    if traits.has_norm_out:
        n_out.copy_(n)
    if traits.quant == "fp4":
        q_out.zero_()
        s_out.view(torch.uint8).zero_()
    else:
        q, s = rc.oracle_quantize(pattern, n.float().numpy(), scale, group)
        q_out.view(torch.uint8).copy_(q)
        if s is not None:
            s_out.copy_(s)
    return r_out, n_out, q_out, s_out


@pytest.fixture
def cpu_quant_kernel():
    with torch.library._scoped_library("torch_compat", "IMPL") as lib:
        lib.impl("allreduce_residual_rmsnorm_quant", _ref_quant, "CPU")
        yield


# (pattern, extra args (scale_factor, group, layout)); NVFP4 uses layout LINEAR/swizzled
QUANT_CASES = [(2, "sf"), (4, "sf"), (10, None), (11, None), (8, 64), (9, 128)]
QUANT_CASES += [(3, "fp4:0"), (5, "fp4:2")]


def _quant_args(pattern, extra, m=8, h=256, dtype=BF16, device=None, handle=0):
    x, res, g = _inputs(m, h, dtype, device=device)
    fp4 = str(extra).startswith("fp4")
    sf = (
        torch.tensor([0.03], dtype=torch.float32, device=x.device) if extra == "sf" or fp4 else None
    )
    grp = extra if isinstance(extra, int) else None
    lay = int(extra.split(":")[1]) if fp4 else None
    return (x, res, g, EPS, 0.0, pattern, sf, grp, lay, None, False, handle)


def _expected_quant_meta(pattern, extra, m=8, h=256, dtype=BF16):
    """(shape, dtype, stride) of the four outputs, from the formats helpers."""
    from jax_fusedar.common import quant_layouts

    full = ((m, h), dtype, (h, 1))
    norm = full if pattern in (4, 5, 9, 11) else ((0,), dtype, (1,))
    if pattern in (3, 5):
        sshape = quant_layouts.nvfp4_scale_shape(m, h, int(extra.split(":")[1]))
        return [full, norm, ((m, h // 2), torch.uint8, (h // 2, 1)), (sshape, E4M3, (sshape[1], 1))]
    if pattern in (2, 4):
        s = ((0,), torch.float32, (1,))
    elif pattern in (10, 11):
        s = ((m, 1), torch.float32, (1, 1))
    else:
        k, t = quant_layouts.group_scale_buffer_shape(m, h, extra)
        s = ((m, k), torch.int32, (1, t))
    return [full, norm, ((m, h), E4M3, (h, 1)), s]


def _meta(outs):
    """(shape, dtype, stride) of each output, to compare with _expected_quant_meta."""
    return [(tuple(t.shape), t.dtype, t.stride()) for t in outs]


def _same(a, b):
    """Equal metadata and bits (NVFP4's stand-in writes zeros: still compared)."""
    assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride())
    view = (lambda t: t.view(torch.uint8)) if a.dtype == E4M3 else (lambda t: t)
    assert torch.equal(view(a), view(b))


@pytest.mark.parametrize("pattern, extra", QUANT_CASES)
def test_quant_fake_tensor_shapes(pattern, extra, handle):
    with FakeTensorMode():
        outs = QUANT(*_quant_args(pattern, extra, device="cuda", handle=handle))
    assert _meta(outs) == _expected_quant_meta(pattern, extra)
    assert all(t.device.type == "cuda" for t in outs)


@pytest.mark.parametrize("pattern, extra", QUANT_CASES)
def test_quant_real_impl_wiring(cpu_stream, sm100, pattern, extra):
    ws = fake_workspace(global_ranks=(0, 1))
    with registered(ws) as h:
        args = _quant_args(pattern, extra, handle=h)
        outs = library.allreduce_residual_rmsnorm_quant._init_fn(*args)
        assert _meta(outs) == _expected_quant_meta(pattern, extra)
        ((a, kw),) = ws.native_rank().launches
        r, n, q, s = outs
        assert a[0] == pattern and a[4] == args[0].data_ptr()
        assert kw["residual_out"] == r.data_ptr() and kw["quant_out"] == q.data_ptr()
        assert kw["norm_out"] == (n.data_ptr() if pattern in (4, 5, 9, 11) else 0)
        assert kw["scale_out"] == (0 if pattern in (2, 4) else s.data_ptr())
        assert kw["scale_factor"] == (args[6].data_ptr() if args[6] is not None else 0)
        assert kw["block_quant_group_size"] == (extra if isinstance(extra, int) else 0)


def test_quant_real_impl_refuses_nvfp4_on_sm90(cpu_stream, sm90):
    ws = fake_workspace(global_ranks=(0, 1))
    with registered(ws) as h, pytest.raises(ValueError, match="sm100"):
        library.allreduce_residual_rmsnorm_quant._init_fn(*_quant_args(5, "fp4:0", handle=h))
    assert not ws.native_rank().launches


@pytest.mark.parametrize("pattern, extra", [c for c in QUANT_CASES if c[0] not in (3, 5)])
def test_quant_opcheck(cpu_quant_kernel, handle, pattern, extra):
    args = _quant_args(pattern, extra, handle=handle)
    torch.library.opcheck(QUANT, args, test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_quant_torch_compile_fullgraph(cpu_quant_kernel, handle, fresh_dynamo, backend):
    def f(x, res, g, sf):
        r, n, q, s = QUANT(x, res, g, EPS, 0.0, 11, None, None, None, None, False, handle)
        r2, _, q2, _ = QUANT(n, r, g, EPS, 0.0, 2, sf, None, None, None, False, handle)
        r3, n3, q3, s3 = QUANT(n, r2, g, EPS, 0.0, 9, None, 64, None, None, False, handle)
        return q.float() * s, q2, s3, r3 + n3

    x, res, g = _inputs()
    sf = torch.tensor([0.02])
    got = torch.compile(f, fullgraph=True, backend=backend)(x, res, g, sf)
    for a, b in zip(got, f(x, res, g, sf)):
        _same(a, b)


def test_quant_stand_in_matches_the_oracle_dequantization(cpu_quant_kernel, handle):
    # Sanity of the stand-in itself (so the tests above compare something meaningful):
    # dequantized dynamic FP8 is within e4m3's half-step of the norm output.
    x, res, g = _inputs(m=8, h=256)
    r, n, q, s = QUANT(x, res, g, EPS, 0.0, 11, None, None, None, None, False, handle)
    y = n.float()
    assert torch.all((q.float() * s - y).abs() <= 2.0**-4 * y.abs() + 2.0**-10 * s)
    assert torch.all(s > 0) and not torch.equal(
        q.view(torch.uint8), torch.zeros_like(q.view(torch.uint8))
    )
