"""Misuse of torch_compat is a clear, early error naming what is wrong, also in the fake (meta)
implementations, so that ``torch.compile`` fails while tracing, not at run time. Ranks are
FakeRanks (no GPU)."""

import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torch_compat
from jax_fusedar.common import backend_choice, tp_groups
from torch_compat import library
from torch_compat import workspace as wsmod

from tests.torch.fakes import AR, FUSED, QUANT, fake_workspace, fuse, refused
from tests.torch.test_torch_compat import _call, _tensors, create_refused

U8, TE, VE = torch.uint8, TypeError, ValueError


# Options are never coerced; messages name the argument.
@pytest.mark.parametrize(
    "over,error,match",
    [
        (
            dict(pattern=1.5),
            VE,
            r"unknown fusion pattern 1\.5: pattern must be an "
            r"AllReduceFusionPattern or its int code, not a float",
        ),
        (dict(pattern="1"), VE, "unknown fusion pattern '1': pattern must be"),
        (dict(pattern=True), VE, "unknown fusion pattern True: pattern must be"),
        (dict(use_oneshot="false"), TE, "use_oneshot must be True, False or None, got 'false'"),
        (dict(use_oneshot=1), TE, "use_oneshot must be True, False or None, got 1"),
        (dict(fp32_acc="no"), TE, "fp32_acc must be True or False, got 'no'"),
        (dict(fp32_acc=None), TE, "fp32_acc must be True or False, got None"),
        (dict(launch_with_pdl="yes"), TE, "launch_with_pdl must be True or False"),
        (dict(trigger_completion_at_end=0), TE, "trigger_completion_at_end must be True or"),
        (dict(rms_eps="abc"), TE, "rms_eps must be a real number, got 'abc'"),
        (dict(rms_eps=None), TE, "rms_eps must be a real number, got None"),
        (dict(rms_eps=-1.0), VE, "rms_eps must be >= 0.0"),
        (dict(rms_eps=float("nan")), VE, "rms_eps must be finite"),
        (dict(weight_bias=1j), TE, "weight_bias must be a real number, got 1j"),
        (dict(weight_bias=None), TE, "weight_bias must be a real number, got None"),
    ],
)
def test_options_are_never_coerced(cpu_stream, over, error, match):
    kw = _tensors() | over
    refused(fake_workspace(), kw.pop("pattern", 1), match, error, **kw)


def test_layout_code_is_not_truncated(cpu_stream, sm100):
    ws, t = fake_workspace(), _tensors() | dict(scale_factor=1.0)
    t.update(quant_out=torch.empty(16, 512, dtype=U8), scale_out=torch.empty(16 * 64, dtype=U8))
    for layout in (2.7, "2", True):
        refused(ws, 5, r"layout \(layout_code\)", **t | {"layout_code": layout})


def test_real_bools_and_numbers_still_work(cpu_stream):
    import numpy as np

    ws = fake_workspace()
    flags = dict(use_oneshot=np.bool_(True), fp32_acc=np.bool_(True), rms_eps=np.float32(1e-5))
    _call(ws, pattern=np.int64(1), weight_bias=1, **flags)
    ((_, kw),) = ws._rank_obj.launches
    assert kw["algorithm"] == 1 and kw["fp32_acc"] is True and kw["weight_bias"] == 1.0
    assert type(kw["rms_eps"]) is float and type(kw["weight_bias"]) is float


BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SMALL = dict(max_tokens=128, hidden=1024)  # of bfloat16
WIDE_BF, WIDE_F32 = (dict(max_tokens=1, hidden=131072, dtype=d) for d in (BF, F32))


# is_buffer_size_sufficient answers whether pattern 0 on zeros of (m, h) goes through the
# op's checks.
@pytest.mark.parametrize(
    "ws, m, h, dtype",
    [
        (SMALL, 16, 1024, BF),
        (SMALL, 0, 1024, BF),
        (SMALL, 129, 1024, BF),
        (SMALL, 16, 1024, F32),
        (SMALL, 16, 1024, F16),
        (SMALL, 256, 512, BF),
        # The kernel's hidden-size rule: not whole 16-byte vectors, and past the launch limit
        # (a token's vectors over a cluster of at most 8 CTAs of at most 1024 threads), though
        # all within the element count ...
        (WIDE_BF, 1, 1020, BF),
        (WIDE_BF, 1, 131072, BF),
        (WIDE_BF, 1, 65544, BF),
        (WIDE_F32, 1, 6, F32),
        (WIDE_F32, 1, 40000, F32),
        # ... and their neighbours the kernel takes.
        (WIDE_BF, 1, 1024, BF),
        (WIDE_BF, 1, 65536, BF),
        (WIDE_F32, 1, 8, F32),
        (WIDE_F32, 1, 32768, F32),
    ],
)
def test_is_buffer_size_sufficient_agrees_with_the_op(cpu_stream, ws, m, h, dtype):
    ws = fake_workspace(**ws)
    try:
        torch_compat.allreduce_fusion(torch.zeros(m, h, dtype=dtype), ws, 0)
        accepted = True
    except ValueError:
        accepted = False
    assert ws.is_buffer_size_sufficient(2, m, h, dtype) == accepted, (m, h, dtype)


@pytest.mark.parametrize(
    "args,error,match",
    [
        ((2, -1, 1024, BF), VE, "num_tokens must be >= 0, got -1"),
        ((2, 1.5, 1024, BF), TE, "num_tokens must be an int"),
        ((2, 16, 0, BF), VE, "hidden_dim must be >= 1"),
        ((2, 16, 1024, BF, "false"), TE, "use_oneshot must be True, False or None"),
        ((True, 16, 1024, BF), TE, "tp_size must be an int"),
    ],
)
def test_is_buffer_size_sufficient_refuses_nonsense(args, error, match):
    with pytest.raises(error, match=match):
        fake_workspace().is_buffer_size_sufficient(*args)


@pytest.mark.parametrize("pattern", [1, 2, 11])
def test_output_is_refused_where_the_pattern_does_not_write_it(cpu_stream, pattern):
    ws, t = fake_workspace(), _tensors()
    if pattern != 1:
        t["quant_out"] = torch.empty(16, 1024, dtype=torch.float8_e4m3fn)
        if pattern == 2:
            t.update(scale_factor=1.0, norm_out=None)
        else:
            t["scale_out"] = torch.empty(16, 1)
    match = rf"pattern {pattern} \(\w+\) does not write output; pass None"
    refused(ws, pattern, match, output=torch.empty_like(t["input"]), **t)
    fuse(ws, pattern, **t)  # without it: fine
    assert len(ws._rank_obj.launches) == 1


# torch's own backend list
@pytest.mark.parametrize(
    "backend,match",
    [
        (
            "mnnvl",
            "needs NVLink multicast .* use 'trtllm' \\(or 'auto'\\) within one node, "
            "torch.distributed.all_reduce",
        ),
        (
            "nccl",
            "unknown all-reduce backend 'nccl' \\(from the backend argument\\); "
            "torch_compat's backends: 'auto', 'trtllm'$",
        ),
        ("xla", "does not exist under torch; torch_compat's backends: 'auto', 'trtllm'"),
    ],
)
def test_backend_errors_list_torch_backends_only(gloo_world1, monkeypatch, backend, match):
    monkeypatch.delenv(backend_choice.BACKEND_ENV_VAR, raising=False)
    error = create_refused(match, backend, 1, 0)
    if backend != "xla":  # only the message about 'xla' itself names it
        assert "xla" not in str(error)
    monkeypatch.setenv(backend_choice.BACKEND_ENV_VAR, backend)
    create_refused(r"\(from the \$JAX_FUSEDAR_ALLREDUCE_BACKEND\)", "auto", 1, 0)


def test_multi_node_advice_is_torchs():
    group = tp_groups.TPGroup(members=(0, 1, 2), index=0)
    with pytest.raises(ValueError, match="spans 3 nodes") as info:
        wsmod.resolve_backend("trtllm", group, {0: "a", 1: "b", 2: "c"})
    assert "xla" not in str(info.value) and "torch.distributed.all_reduce" in str(info.value)
    assert wsmod.resolve_backend(None, group, {0: "a", 1: "a", 2: "a"}) == "trtllm"


def test_create_timeout_is_named(gloo_world1):
    match = "timeout_s must be a real number, got 'soon'"
    create_refused(match, world_size=1, rank=0, timeout_s="soon", error=TypeError)


# --- the fake implementations run the eager op's checks
def _fake(shape, dtype=torch.bfloat16):
    """Zeros on "cuda" under FakeTensorMode (no GPU needed), else on the eager op's "cpu"."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    fake = isinstance(_get_current_dispatch_mode(), FakeTensorMode)
    return torch.zeros(*shape, dtype=dtype, device="cuda" if fake else "cpu")


def _fused(h, rows=(8, 256), *, residual=None, gamma=None, eps=1e-6):
    """The arguments of the residual + RMSNorm op, each overridable (bfloat16 rows)."""
    x = _fake(rows)
    residual = _fake(rows) if residual is None else residual
    gamma = _fake((rows[-1],)) if gamma is None else gamma
    return FUSED, (x, residual, gamma, eps, 0.0, None, False, h)


def _quant(h, pattern, rows=(8, 256), *, scale_factor=None, group_size=None):
    """The arguments of the quantized op (bfloat16 rows)."""
    x, residual, gamma = _fake(rows), _fake(rows), _fake((rows[-1],))
    rest = (None, None, False, h)  # layout_code, use_oneshot, fp32_acc, the handle
    return QUANT, (x, residual, gamma, 1e-6, 0.0, pattern, scale_factor, group_size, *rest)


FLAT_3D = r"input must be 2-D \[token_num, hidden_dim\], got shape \[2, 4, 256\]"
FAKE_CASES = {
    "residual_float32": (
        lambda h: _fused(h, residual=_fake((8, 256), torch.float32)),
        "residual_in must have the input's dtype torch.bfloat16, got torch.float32",
    ),
    "allreduce_3d": (lambda h: (AR, (_fake((2, 4, 256)), None, False, h)), FLAT_3D),
    "quant_11_3d": (lambda h: _quant(h, 11, (2, 4, 256)), FLAT_3D),
    "too_many_tokens": (lambda h: _fused(h, (65, 256)), "does not fit the workspace"),
    "gamma_dtype": (
        lambda h: _fused(h, gamma=_fake((256,), F16)),
        "rms_gamma must have the input's dtype",
    ),
    "two_shot_impossible": (
        lambda h: (AR, (_fake((2, 256)), False, False, h)),
        "use_oneshot=False is not possible: two-shot needs more tokens than ranks",
    ),
    "group_size": (
        lambda h: _quant(h, 9, group_size=96),
        "hidden_dim must be divisible by group_size",
    ),
    "static_fp8_scale_dtype": (
        lambda h: _quant(h, 4, scale_factor=_fake((1,), torch.float16)),
        "scale_factor must be a float32 tensor",
    ),
    "negative_eps": (lambda h: _fused(h, eps=-1.0), "rms_eps must be >= 0.0"),
}


@pytest.mark.parametrize("case", list(FAKE_CASES))
def test_fake_refuses_what_eager_refuses(handle, cpu_stream, case):
    """Under FakeTensorMode (what torch.compile traces with) the op raises the eager op's
    ValueError, which the eager op gives on real CPU tensors of the same metadata."""
    build, match = FAKE_CASES[case]
    with FakeTensorMode():
        op, args = build(handle)
        with pytest.raises(ValueError, match=match):
            op(*args)
    op, real = build(handle)
    ws = library.lookup_workspace(handle)
    eager = {
        AR: library.allreduce._init_fn,
        FUSED: library.allreduce_residual_rmsnorm._init_fn,
        QUANT: library.allreduce_residual_rmsnorm_quant._init_fn,
    }[op]
    with pytest.raises(ValueError, match=match):
        eager(*real)
    assert not ws.native_rank().launches


def _fused_fn(handle):
    return lambda x, res, g: FUSED(x, res, g, 1e-6, 0.0, None, False, handle)


def test_torch_compile_refuses_while_tracing(handle, fresh_dynamo):
    """fullgraph compile of a call the op refuses: the error comes from tracing (the backend
    never gets a graph), not from running it."""
    backend = EagerAndRecordGraphs()
    compiled = torch.compile(_fused_fn(handle), fullgraph=True, backend=backend)
    x, res, g = _fused(handle)[1][:3]  # bfloat16 zeros on the CPU
    with pytest.raises(Exception, match="residual_in must have the input's dtype"):
        compiled(x, res.float(), g)
    assert backend.graphs == []


def test_fake_checks_wait_for_real_sizes_when_symbolic(handle):
    """With dynamic shapes the size rules (fit, one-shot) wait for the eager op; the rest
    (dtypes, ranks of the tensors) are still checked while tracing."""
    f = _fused_fn(handle)
    args = _fused(handle)[1][:3]  # bfloat16 zeros on the CPU
    gm = make_fx(f, tracing_mode="symbolic")(*args)
    assert any(n.target is FUSED for n in gm.graph.nodes)
    bad = (args[0], args[1].float(), args[2])
    with pytest.raises(ValueError, match="residual_in must have the input's dtype"):
        make_fx(f, tracing_mode="symbolic")(*bad)
