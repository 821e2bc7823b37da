"""``jax.export`` of programs with the fused op, on 8 CPU devices: round trips against the
jitted program; the stable workspace key the artifact carries; ("cpu", "cuda") artifacts
running the reference on CPU; no reference exported for cuda from an XLA-backend workspace
of a GPU-less process; symbolic token counts."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import assert_same_bits, jit_shard_map, make_mesh, moe_body, needs_native
from tests.jax.cpu_helpers import new_rng, random_gamma, random_partials, require_host_devices
from jax_fusedar import workspace as wsmod
from jax_fusedar.common import native
from jax_fusedar.ops.dense import FFI_TARGET

require_host_devices()
pytest.importorskip("flatbuffers", reason="serializing needs flatbuffers (./dev installs it)")

TOKENS, HIDDEN = 4, 256
BF = jnp.bfloat16
KW = dict(max_token_num=TOKENS, hidden_dim=HIDDEN, dtype=BF)
MESH = make_mesh((2, 4), ("dp", "tp"))


# Environment and once-per-kind logging reset per test (conftest.py); ./dev oldest runs it too.
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]


def layer(ws):
    """dp x tp program: per-rank partials [TOKENS, HIDDEN], per-group residual and gamma."""

    def body(x, r, g):
        out = jf.allreduce_fusion(x, axis_name="tp", workspace=ws, residual=r, rms_gamma=g)
        return out.residual_out, out.norm_out

    return jit_shard_map(body, ws.mesh, (P(("dp", "tp")), P("dp"), P("dp")), (P("dp"), P("dp")))


def structs(mesh, shapes, dtypes=(BF,) * 5):
    """ShapeDtypeStructs of (shape, spec) pairs on ``mesh``."""
    sds = lambda s, sp, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, sp))
    return [sds(s, sp, d) for (s, sp), d in zip(shapes, dtypes)]


def specs(tokens=TOKENS):
    """layer's arguments on MESH; ``tokens`` may be symbolic."""
    shapes = [(8 * tokens, HIDDEN), (2 * tokens, HIDDEN), (2 * HIDDEN,)]
    return structs(MESH, zip(shapes, (P(("dp", "tp")), P("dp"), P("dp"))))


def values(rng):
    x, r = (random_partials(rng, (n * TOKENS, HIDDEN), "bfloat16") for n in (8, 2))
    host = [x, r, random_gamma(rng, 2 * HIDDEN, "bfloat16")]
    return [jax.device_put(v, s.sharding) for v, s in zip(host, specs())]


round_trip = lambda exported: jf.export.deserialize(exported.serialize())
abstract = lambda name=None, **kw: jf.abstract_workspace(MESH, "tp", name=name, **{**KW, **kw})


def test_workspace_key_is_stable_across_creation_order_and_names():
    first = abstract()
    for _ in range(3):  # other workspaces created in between do not change the id
        abstract(max_token_num=8, hidden_dim=512, dtype=jnp.float16)
    again = abstract()
    assert again.id == first.id and again.serial > first.serial
    named = abstract("decoder")
    assert named.id != first.id and "name='decoder'" in repr(named)
    # Each field of the key matters: members (device order), sizes, dtype, backend.
    swapped = make_mesh((2, 4), ("dp", "tp"), [1, 0, 2, 3, 4, 5, 6, 7])
    others = [jf.abstract_workspace(swapped, "tp", **KW), abstract(backend="xla")]
    others += [abstract(max_token_num=2 * TOKENS), abstract(hidden_dim=2 * HIDDEN)]
    others += [abstract(dtype=jnp.float16)]
    assert len({first.id, *(o.id for o in others)}) == 1 + len(others)
    assert wsmod.workspace_key_id(first.key) == first.id and 0 < first.id < 2**63
    for name in (5, "", b"x"):
        with pytest.raises(ValueError, match="name must be None or a non-empty str"):
            abstract(name)


def test_a_second_live_kernel_workspace_with_the_same_key_is_refused():
    live = abstract("dup")
    live._ranks.append(object())  # as if its native ranks were registered
    wsmod._by_id[live.id] = live
    describe = lambda name: wsmod._describe(MESH, "tp", TOKENS, HIDDEN, BF, "trtllm", name)
    twin = describe("dup")
    with pytest.raises(ValueError, match="pass a distinct name="):
        wsmod._claim_id(twin, allocates=True)
    wsmod._claim_id(describe("dup2"), allocates=True)
    live._ranks.clear()
    live._destroyed = True  # once destroyed, the key is free again
    wsmod._claim_id(twin, allocates=True)
    assert wsmod.lookup(twin.id) is twin


def test_cuda_export_carries_the_stable_key_and_needs_the_helper():
    ws = abstract("serve")
    with pytest.raises(ValueError, match="custom call"):
        jax.export.export(layer(ws), platforms=("cuda",))(*specs())
    exported = jf.export.export(layer(ws), platforms=("cuda",))(*specs())
    text = exported.mlir_module()
    assert text.count(f"@{FFI_TARGET}") == 1 and "all_reduce" not in text
    same = abstract("serve")
    assert jf.export.workspace_ids(exported) == [same.id]
    # Read back with JAX's own deserialize (inspection registers and compiles nothing).
    assert jf.export.workspace_ids(jax.export.deserialize(exported.serialize())) == [same.id]


@needs_native
def test_multi_platform_artifact_runs_the_reference_on_cpu():
    exported = jf.export.export(layer(abstract()), platforms=("cpu", "cuda"))(*specs())
    assert f"@{FFI_TARGET}" in exported.mlir_module()  # the cuda branch has the kernel
    xla_ws = jf.create_allreduce_fusion_workspace(MESH, "tp", **KW)
    args = values(new_rng())
    want = layer(xla_ws)(*args)
    assert_same_bits(round_trip(exported).call(*args), want, "(cpu, cuda) artifact on cpu")


def test_compiling_the_kernel_call_without_the_native_module_says_what_to_install(monkeypatch):
    """A process with a cuda backend but no native module: lowering the kernel's call to
    compile it there raises, naming what to install; exporting the same program does not
    (the artifact needs only the target and its attributes)."""
    monkeypatch.setattr(native, "ext", None)
    real = jax.devices
    fake = lambda backend=None: [object()] if backend == "cuda" else real(backend)
    monkeypatch.setattr(jax, "devices", fake)
    ws = abstract()
    match = rf"calls the fused kernel \({FFI_TARGET}\) and would be compiled here for this "
    match += r"process's GPUs, but jax_fusedar's native extension is not available .*nvcc"
    with pytest.raises(RuntimeError, match=match):
        layer(ws).trace(*specs()).lower(lowering_platforms=("cuda",))
    text = jf.export.export(layer(ws), platforms=("cuda",))(*specs()).mlir_module()
    assert text.count(f"@{FFI_TARGET}") == 1


def test_an_xla_workspace_exports_for_cpu_and_is_refused_for_cuda_where_lowering_warns():
    ws = jf.create_allreduce_fusion_workspace(MESH, "tp", **KW)
    assert ws.backend == "xla"
    # The CPU lowering is silent (the reference is what CPU runs) and round-trips bit for bit.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exported = jf.export.export(layer(ws), platforms=("cpu",))(*specs())
    args = values(new_rng())
    assert_same_bits(round_trip(exported).call(*args), layer(ws)(*args), "cpu round trip")
    with pytest.raises(ValueError, match="not the fused kernel.*abstract_workspace"):
        jf.export.export(layer(ws), platforms=("cuda",))(*specs())
    with pytest.warns(UserWarning, match="XLA-backend workspace of a process without GPUs"):
        layer(ws).trace(*specs()).lower(lowering_platforms=("cuda",))
    with jf.export.allow_reference_for_cuda():
        exported = jf.export.export(layer(ws), platforms=("cuda",))(*specs())
    assert FFI_TARGET not in exported.mlir_module()


@pytest.mark.parametrize("backend", ["xla", "trtllm"])
def test_symbolic_token_counts_are_refused(backend):
    ws = abstract(backend=backend)
    with pytest.raises(ValueError, match="symbolic shape.*one artifact per token count"):
        jf.export.export(layer(ws), platforms=("cpu",))(*specs(*jax.export.symbolic_shape("t")))


def test_row_parallel_exports_on_explicit_axes_and_auto_axes_get_an_explanation():
    rng = new_rng()
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_type,) * 2)
        ws = jf.create_allreduce_fusion_workspace(mesh, "tp", **{**KW, "max_token_num": 16})
        shapes = [(16, 512), (512, HIDDEN), (16, HIDDEN), (HIDDEN,)]
        args = structs(mesh, zip(shapes, [P("dp", "tp"), P("tp", None), P("dp"), P()]))

        def f(h, w, r, g):
            out = jf.row_parallel_allreduce_fusion(h, w, residual=r, rms_gamma=g, workspace=ws)
            return out.residual_out, out.norm_out

        with jax.set_mesh(mesh):
            if axis_type == AxisType.Auto:
                with pytest.raises(ValueError, match="Explicit axes"):
                    jf.export.export(f, platforms=("cpu",))(*args)
                continue
            exported = round_trip(jf.export.export(f, platforms=("cpu",))(*args))
            value = lambda a: (rng.standard_normal(a.shape) / 8).astype(a.dtype)
            vals = [jax.device_put(value(a), a.sharding) for a in args]
            assert_same_bits(exported.call(*vals), jax.jit(f)(*vals), "row_parallel round trip")


# Exported like the dense op: their target is exempt too (one registry of the ops' targets).

MOE_ROWS, TOP_K, EXPERTS = 6, 2, 3


def moe_layer(ws, pattern):
    """A tp=4 program (dp 2) of one MoE op: three per-rank inputs (expert rows and what
    weighs them), then the dp group's residual and gamma."""
    body, n_out = moe_body(ws, pattern)
    split, group = P(("dp", "tp")), P("dp")
    return jit_shard_map(body, ws.mesh, (split, split, split, group, group), (group,) * n_out)


def moe_specs(pattern):
    t, h = TOKENS, HIDDEN
    if pattern == 7:
        shapes, dtypes = [(8, MOE_ROWS, h), (8, t, TOP_K), (8, t, TOP_K)], [BF, jnp.int32, BF]
    else:
        shapes, dtypes = [(8, EXPERTS, t, h), (8, EXPERTS, t), (8, t, h)], [BF, jnp.float32, BF]
    specs = [P(("dp", "tp"))] * 3 + [P("dp")] * 2
    return structs(MESH, zip(shapes + [(2 * t, h), (2 * h,)], specs), dtypes + [BF] * 2)


@needs_native
@pytest.mark.parametrize("pattern", [6, 7])
def test_moe_export_round_trip(pattern):
    """Exported for (cpu, cuda) from an abstract kernel workspace: the cuda branch keeps the
    MoE custom call and the stable key; serialized, deserialized and run on CPU it gives the
    bits of the same program jitted on an XLA workspace."""
    served = abstract("moe")
    exported = jf.export.export(moe_layer(served, pattern), platforms=("cpu", "cuda"))(
        *moe_specs(pattern)
    )
    text = exported.mlir_module()
    assert text.count(f"@{native.FFI_TARGETS['moe_allreduce_fusion']}") == 1, text
    assert f"pattern = {pattern} : i32" in text
    assert jf.export.workspace_ids(round_trip(exported)) == [served.id]
    xla_ws = jf.create_allreduce_fusion_workspace(MESH, "tp", **KW)
    rng = new_rng()
    normal = lambda s: (rng.standard_normal(s.shape) / 4).astype(s.dtype)
    value = lambda s: (
        rng.integers(-1, MOE_ROWS, s.shape).astype(np.int32) if s.dtype == jnp.int32 else normal(s)
    )
    args = [jax.device_put(value(s), s.sharding) for s in moe_specs(pattern)]
    want = moe_layer(xla_ws, pattern)(*args)
    assert_same_bits(round_trip(exported).call(*args), want, f"pattern {pattern}: on cpu")


# Exporting needs only the custom call's target and attributes; a CPU-only install (no nvcc,
# so no native module) must export as any other machine does.

WITHOUT_NATIVE = r"""
import json, sys
sys.modules["jax_fusedar.common._fusedar"] = None  # blocked, as on a CPU-only install
import jax
from jax_fusedar.common import native
assert not native.available()
exporting, serving = json.loads(sys.stdin.read())
ns = {"__name__": "__docs__"}
exec(exporting, ns)
exported = jax.export.deserialize(ns["blob"])  # plain JAX: nothing of ours registered
ws = ns["serving_ws"]
assert list(exported.platforms) == ["cpu", "cuda"] and ws.backend == "trtllm", exported.platforms
(call,) = [line for line in exported.mlir_module().splitlines() if "@TARGET" in line]
for attr in ("pattern = 1 : i32", "fp32_acc = true", f"workspace_id = {ws.id}"):
    assert attr in call, (attr, call)
assert ns["jf"].export.workspace_ids(exported) == [ws.id]
# Lowering for cuda to inspect the program needs no module either.
lowered = ns["g"].trace(ns["partial"], ns["residual"], ns["gamma"])
assert lowered.lower(lowering_platforms=("cuda",)).as_text().count("@TARGET") == 1
try:
    exec(serving, ns)
    raise AssertionError("the serving side ran without the native module")
except RuntimeError as e:
    msg = str(e)
assert msg.startswith("jax_fusedar.export.deserialize: the artifact calls TARGET, whose handlers "
    "this process needs to compile it, but jax_fusedar's native extension is not available"), msg
assert "build the package with a CUDA compiler (nvcc)" in msg, msg
"""


def test_the_docs_export_example_exports_without_the_native_module():
    """docs/jax_api.md's exporting side ("any machine") in a fresh process where the native
    extension cannot load (the checks run there): the artifact serializes with the kernel's
    custom call, its attributes and the serving workspace's stable id; its serving side,
    which compiles the artifact, refuses there, naming what to install."""
    import json

    from tests.jax.child_process import cpu_env, run_script
    from tests.repo import REPO
    from tests.test_readme import python_blocks

    (block,) = [c for _, c in python_blocks(REPO / "docs/jax_api.md") if "# Exporting side" in c]
    exporting, marker, serving = block.partition("# Serving side")
    assert marker, "docs/jax_api.md's export example lost its serving side"
    env = cpu_env(8)
    for var in ("JAX_FUSEDAR_STRICT", "JAX_FUSEDAR_ALLREDUCE_BACKEND"):
        env.pop(var, None)
    stdin = json.dumps([exporting, marker + serving])
    r = run_script(WITHOUT_NATIVE.replace("TARGET", FFI_TARGET), env=env, timeout=600, stdin=stdin)
    assert r.returncode == 0, r.stderr[-6000:]
