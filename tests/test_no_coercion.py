"""Options are never coerced, and every error names the argument: a sweep of every public
entry point (the JAX ops, the workspace constructors and their methods, fuse,
row_parallel_allreduce_fusion, torch_compat's functions, the CLI's flags) with wrongly typed
options: strings for bools and numbers, floats and bools for ints, numbers for names. Each
must raise TypeError or ValueError whose message names the argument, before anything runs.
8 virtual CPU devices (JAX), FakeRanks (torch), the CLI's parser in process."""

import pytest

from tests.cpu_devices import use_host_devices

# The 8 CPU devices, set before JAX is first imported (below): this file sits outside the
# folders whose conftest.py sets them up (tests/cpu_devices.py).
use_host_devices()

# Wrong values by the kind of option (None where None is not a valid value).
BOOL = ["false", "True", 1, 0.0]
OPTIONAL_BOOL = ["false", 1]
FLOAT = ["1e-6", None, True, 1j, "nan"]
INT = ["64", 64.0, True]
NAME = [5, b"tp"]
STRICT_INT = ["0", 0.0, True]  # an int option that takes no float or bool either


def cases(**kinds):
    return [(name, value) for name, wrong in kinds.items() for value in wrong]


def expect_named(call, name, value):
    """``call()`` must raise TypeError/ValueError naming ``name`` (a bare or $-prefixed
    argument name, or a CLI flag)."""
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert name in str(info.value), (name, value, str(info.value))


# --- JAX --------------------------------------------------------------------------------------

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_fusedar as jf  # noqa: E402
from tests.jax.cpu_helpers import make_mesh, require_host_devices  # noqa: E402

require_host_devices()

# Also in the oldest-versions lane (./dev oldest).
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]

MESH_KW = dict(max_token_num=8, hidden_dim=256, dtype=jnp.bfloat16)
ROWS, SCALES, IDX = ((4, 256), jnp.bfloat16), ((4,), jnp.float32), ((4, 1), jnp.int32)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((8,), ("tp",))


@pytest.fixture(scope="module")
def ws(mesh):
    return jf.create_allreduce_fusion_workspace(mesh, "tp", **MESH_KW)


def expect_named_in_trace(mesh, body, name, value, *shapes):
    """Traces ``body`` in a shard_map on per-shard arrays of ``shapes`` (rows split over
    "tp"): it must raise naming ``name``."""
    sharded = lambda s: P("tp") if len(s) > 1 else P()
    avals = [
        jax.ShapeDtypeStruct(
            (8 * s[0], *s[1:]) if len(s) > 1 else s, dt, sharding=NamedSharding(mesh, sharded(s))
        )
        for s, dt in shapes
    ]
    specs = tuple(sharded(s) for s, _ in shapes)
    prog = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    expect_named(lambda: jax.jit(prog).trace(*avals), name, value)


def gamma():
    return jnp.ones(256, jnp.bfloat16)


@pytest.mark.parametrize(
    "name,value",
    cases(
        use_oneshot=OPTIONAL_BOOL,
        fp32_acc=BOOL + [None],
        strict=OPTIONAL_BOOL,
        rms_eps=FLOAT,
        weight_bias=FLOAT,
        pattern=["1", 1.0, True],
        axis_name=NAME,
    ),
)
def test_allreduce_fusion(mesh, ws, name, value):
    kw = {"axis_name": "tp", "rms_gamma": gamma(), name: value}
    body = lambda x: jf.allreduce_fusion(x, workspace=ws, **kw).norm_out
    expect_named_in_trace(mesh, body, name, value, ROWS)


@pytest.mark.parametrize(
    "pattern,name,value",
    [(9, "block_quant_group_size", v) for v in INT + ["sixty-four"]]
    + [(3, "layout_code", v) for v in STRICT_INT]
    + [(4, "scale_factor", v) for v in ["0.5", 0.5, True]],
)
def test_allreduce_fusion_quantization_options(mesh, ws, pattern, name, value):
    kw = {name: value}
    if name != "scale_factor" and pattern != 9:
        kw["scale_factor"] = jnp.ones((), jnp.float32)
    if pattern == 9 and name != "block_quant_group_size":
        kw["block_quant_group_size"] = 64

    def body(x):
        return jf.allreduce_fusion(
            x, axis_name="tp", workspace=ws, pattern=pattern, rms_gamma=gamma(), **kw
        ).residual_out

    expect_named_in_trace(mesh, body, name, value, ROWS)


MOE = cases(rms_eps=FLOAT, weight_bias=FLOAT, strict=OPTIONAL_BOOL, axis_name=NAME)


@pytest.mark.parametrize("name,value", MOE + cases(return_allreduce_out=BOOL + [None]))
def test_moe_reduction_allreduce_fusion(mesh, ws, name, value):
    kw = {"axis_name": "tp", "workspace": ws, "rms_gamma": gamma(), name: value}

    def body(outputs, scales, tokens):
        return jf.moe_reduction_allreduce_fusion(outputs[None], scales[None], tokens, **kw)

    expect_named_in_trace(mesh, lambda *a: body(*a).norm_out, name, value, ROWS, SCALES, ROWS)


@pytest.mark.parametrize("name,value", MOE + cases(routed_scaling_factor=FLOAT))
def test_moe_finalize_allreduce_fusion(mesh, ws, name, value):
    kw = {"axis_name": "tp", "workspace": ws, "rms_gamma": gamma(), name: value}
    body = lambda rows, idx: jf.moe_finalize_allreduce_fusion(rows, idx, **kw).norm_out
    expect_named_in_trace(mesh, body, name, value, ROWS, IDX)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize(
    "name,value",
    cases(
        use_oneshot=OPTIONAL_BOOL,
        fp32_acc=BOOL + [None],
        strict=OPTIONAL_BOOL,
        rms_eps=FLOAT,
        weight_bias=FLOAT,
        precision=["quickest", 3],
    ),
)
def test_row_parallel_allreduce_fusion(axis_type, name, value):
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_type,) * 2)
    ws = jf.create_allreduce_fusion_workspace(mesh, "tp", **MESH_KW)
    h = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("dp", "tp")))
    w = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    kw = {"residual": None, "rms_gamma": gamma(), "workspace": ws, name: value}

    def run():
        with jax.set_mesh(mesh):  # lowered: on Auto axes the partition rule runs here
            jax.jit(lambda h, w: jf.row_parallel_allreduce_fusion(h, w, **kw).norm_out).lower(h, w)

    expect_named(run, "recision" if name == "precision" else name, value)


# (call(mesh, ws, **kw), the valid keywords, the wrong ones); each call gets the valid
# keywords with one replaced.
JAX_CALLS = {
    "create_allreduce_fusion_workspace": (
        lambda mesh, ws, **kw: jf.create_allreduce_fusion_workspace(mesh, **kw),
        {**MESH_KW, "axis_name": "tp"},
        cases(
            max_token_num=INT,
            hidden_dim=INT,
            exchange_timeout_s=FLOAT,
            handshake=OPTIONAL_BOOL,
            handshake_timeout_s=["30", True, 1j],
            timeout_s=["30", True, 1j],
            name=[5, ""],
            backend=[5],
            dtype=["int8", None],
            axis_name=NAME,
        ),
    ),
    "abstract_workspace": (
        lambda mesh, ws, **kw: jf.abstract_workspace(mesh, **kw),
        {**MESH_KW, "axis_name": "tp"},
        cases(max_token_num=INT, hidden_dim=INT, name=[5, ""], backend=[5, "fast"], axis_name=NAME),
    ),
    "workspace_set_timeout": (
        lambda mesh, ws, timeout_s: ws.set_timeout(timeout_s),
        {},
        cases(timeout_s=["5", True, 1j]),
    ),
    "workspace_is_buffer_size_sufficient": (
        lambda mesh, ws, **kw: ws.is_buffer_size_sufficient(**kw),
        {"num_tokens": 4, "hidden_dim": 256},
        cases(num_tokens=INT, hidden_dim=INT),
    ),
    "fuse": (
        lambda mesh, ws, **kw: jf.fuse(lambda x: x, mesh=mesh, **kw),
        {},
        cases(
            max_tokens=INT,
            use_oneshot=OPTIONAL_BOOL,
            strict=OPTIONAL_BOOL,
            allow_rounding_change=BOOL + [None],
            backend=[5, "fast"],
            log_level=["INFO", True],
            axis_name=[5],
        ),
    ),
}


@pytest.mark.parametrize(
    "call,name,value", [(c, n, v) for c, (_, _, wrong) in JAX_CALLS.items() for n, v in wrong]
)
def test_jax_call(mesh, ws, call, name, value):
    fn, kw, _ = JAX_CALLS[call]
    expect_named(lambda: fn(mesh, ws, **{**kw, name: value}), name, value)


# --- torch_compat -----------------------------------------------------------------------------


@pytest.fixture
def torch_ws(monkeypatch):
    pytest.importorskip("torch")
    from torch_compat import cuda_state
    from tests.torch.test_moe import fake_workspace

    monkeypatch.setattr(cuda_state, "current_stream", lambda device: 0)
    monkeypatch.setattr(cuda_state, "compute_capability", lambda device: (10, 0))
    return fake_workspace(max_tokens=16, hidden=1024)


def _dense_tensors(torch, pattern):
    from tests.torch.test_torch_compat import _tensors

    t = _tensors(m=4, h=1024)
    if pattern in (3, 9):
        del t["norm_out"]
    e4m3 = lambda: torch.empty(4, 1024, dtype=torch.float8_e4m3fn)
    if pattern == 9:
        t["quant_out"], t["scale_out"] = e4m3(), torch.empty(2, 4, dtype=torch.int32)[:, :4].t()
    if pattern == 3:
        t["quant_out"] = torch.empty(4, 512, dtype=torch.uint8)
        t["scale_out"] = torch.empty(128 * 64, dtype=torch.uint8)
        t["scale_factor"] = torch.ones(1)
    if pattern == 4:
        t["quant_out"] = e4m3()
    return t


TORCH_DENSE = (
    [
        (1, n, v)
        for n, v in cases(
            use_oneshot=OPTIONAL_BOOL,
            fp32_acc=BOOL + [None],
            launch_with_pdl=BOOL + [None],
            trigger_completion_at_end=BOOL + [None],
            rms_eps=FLOAT,
            weight_bias=FLOAT,
            pattern=["1", 1.0, True],
            moe_finalize_backend=[5],
        )
    ]
    + [(9, "block_quant_group_size", v) for v in INT]
    + [(3, "layout_code", v) for v in STRICT_INT]
    + [(4, "scale_factor", v) for v in ["0.5", True, None]]
)


@pytest.mark.parametrize("pattern,name,value", TORCH_DENSE)
def test_torch_allreduce_fusion(torch_ws, pattern, name, value):
    import torch
    import torch_compat

    kw = dict(_dense_tensors(torch, pattern), pattern=pattern)
    if pattern == 9:
        kw["block_quant_group_size"] = 128
    kw[name] = value
    expect_named(lambda: torch_compat.allreduce_fusion(workspace=torch_ws, **kw), name, value)
    assert not torch_ws.native_rank().launches


@pytest.mark.parametrize(
    "name,value",
    cases(
        rms_eps=FLOAT,
        weight_bias=FLOAT,
        launch_with_pdl=BOOL + [None],
        fp32_acc=BOOL + [None],
        use_oneshot=OPTIONAL_BOOL,
        trigger_completion_at_end=BOOL + [None],
        routed_scaling_factor=["2.5", True, 1j],
    ),
)
def test_torch_moe_allreduce_fusion(torch_ws, name, value):
    import torch_compat
    from tests.torch.test_moe import P7, finalize_args

    kw = dict(finalize_args(h=1024), pattern=P7) | {name: value}
    expect_named(lambda: torch_compat.allreduce_fusion(workspace=torch_ws, **kw), name, value)
    assert not torch_ws.native_rank().moe_launches


@pytest.mark.parametrize(
    "name,value", cases(tp_size=INT, num_tokens=INT, hidden_dim=INT, use_oneshot=OPTIONAL_BOOL)
)
def test_torch_is_buffer_size_sufficient(torch_ws, name, value):
    import torch

    kw = dict(tp_size=2, num_tokens=4, hidden_dim=1024, dtype=torch.bfloat16) | {name: value}
    expect_named(lambda: torch_ws.is_buffer_size_sufficient(**kw), name, value)


@pytest.mark.parametrize(
    "name,value",
    cases(
        backend=[5, "fast"],
        world_size=["1", 1.0, True],
        rank=["0", 0.0, True],
        max_token_num=INT,
        hidden_dim=INT,
        dtype=["bfloat16", None],
        timeout_s=FLOAT[:-1],
        handshake=OPTIONAL_BOOL,
        handshake_timeout_s=["30", True, 1j],
        kernel_timeout_s=["30", True, 1j],
        gpus_per_node=INT,
        force_oneshot_support=BOOL,
    ),
)
def test_torch_create_allreduce_fusion_workspace(gloo_world1, name, value):
    import torch
    import torch_compat

    kw = dict(world_size=1, rank=0, max_token_num=8, hidden_dim=1024, dtype=torch.bfloat16)
    kw |= {name: value}
    expect_named(lambda: torch_compat.create_allreduce_fusion_workspace(**kw), name, value)


@pytest.mark.parametrize("value", ["1", 1.0, True])
def test_torch_workspace_handles(value):
    pytest.importorskip("torch")
    from torch_compat import library

    expect_named(lambda: library.lookup_workspace(value), "workspace_handle", value)
    expect_named(lambda: library.unregister_workspace(value), "workspace_handle", value)


@pytest.mark.parametrize("value", ["1", 1.0, True])
def test_torch_fusion_pass_handle(torch_ws, value):
    import torch.fx as fx
    import torch_compat

    graph = fx.symbolic_trace(lambda x: x)
    call = lambda: torch_compat.fuse_allreduce_rmsnorm(graph, torch_ws, workspace_handle=value)
    expect_named(call, "workspace_handle", value)


# --- the CLI ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag,value", [("--seed", "1e3"), ("--steps", "two"), ("--dtype", "half"), ("--backend", "yes")]
)
def test_cli_flags(capsys, flag, value):
    from jax_fusedar.cli.main import build_parser

    parser, _ = build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["demo", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err, err


@pytest.mark.parametrize(
    "var,value",
    [
        ("JAX_FUSEDAR_STRICT", "maybe"),
        ("JAX_FUSEDAR_HANDSHAKE", "2"),
        ("JAX_FUSEDAR_TIMEOUT_S", "abc"),
        ("JAX_FUSEDAR_HANDSHAKE_TIMEOUT_S", "soon"),
        ("JAX_FUSEDAR_ALLREDUCE_BACKEND", "fast"),
    ],
)
def test_cli_environment(monkeypatch, capsys, var, value):
    """In process (tests/cli/test_environment.py runs the commands). The --out folder cannot
    be created, so a run that missed the variable stops there, without running the demo."""
    from jax_fusedar.cli.main import main

    monkeypatch.setenv(var, value)
    assert main(["demo", "--bench", "--out", "/proc/forbidden"]) == 2
    err = capsys.readouterr().err
    assert f"${var}" in err and "error:" in err, err
