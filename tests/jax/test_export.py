"""``jax.export`` of programs with the fused op, on 8 CPU devices: round trips (serialize,
deserialize, call) against the directly jitted program; the stable workspace key the
artifact carries (independent of creation order, distinct per name); multi-platform
("cpu", "cuda") artifacts running the reference on CPU; the refusal to export the reference
for cuda from an XLA-backend workspace of a GPU-less process; symbolic token counts."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fusedar as jf
from tests.jax.cpu_helpers import (
    assert_same_bits,
    jit_shard_map,
    make_mesh,
    moe_body,
    needs_native,
    new_rng,
    random_gamma,
    random_partials,
    require_host_devices,
)
from jax_fusedar import workspace as wsmod
from jax_fusedar.common import native
from jax_fusedar.ops.dense import FFI_TARGET

require_host_devices()
pytest.importorskip(
    "flatbuffers", reason="jax.export serialization needs flatbuffers (./dev installs it)"
)

TOKENS, HIDDEN = 4, 256
KW = dict(max_token_num=TOKENS, hidden_dim=HIDDEN, dtype=jnp.bfloat16)
MESH = make_mesh((2, 4), ("dp", "tp"))


# Environment and once-per-kind logging reset per test (conftest.py).
# Also in the oldest-versions lane (./dev oldest).
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.oldest]


def layer(ws):
    """dp x tp program: per-rank partials [TOKENS, HIDDEN], per-group residual and gamma."""

    def body(x, residual, gamma):
        out = jf.allreduce_fusion(
            x, axis_name="tp", workspace=ws, residual=residual, rms_gamma=gamma
        )
        return out.residual_out, out.norm_out

    in_specs = (P(("dp", "tp")), P("dp"), P("dp"))
    return jit_shard_map(body, ws.mesh, in_specs, (P("dp"), P("dp")))


def structs(mesh, shapes, dtypes=(jnp.bfloat16,) * 5):
    """ShapeDtypeStructs of (shape, spec) pairs on ``mesh``."""
    return [
        jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, sp))
        for (s, sp), d in zip(shapes, dtypes)
    ]


def specs(tokens=TOKENS):
    """layer's arguments on MESH; ``tokens`` may be symbolic."""
    shapes = [(8 * tokens, HIDDEN), (2 * tokens, HIDDEN), (2 * HIDDEN,)]
    return structs(MESH, zip(shapes, (P(("dp", "tp")), P("dp"), P("dp"))))


def values(rng):
    x, r = (random_partials(rng, (n * TOKENS, HIDDEN), "bfloat16") for n in (8, 2))
    host = [x, r, random_gamma(rng, 2 * HIDDEN, "bfloat16")]
    return [jax.device_put(v, s.sharding) for v, s in zip(host, specs())]


def round_trip(exported):
    return jf.export.deserialize(exported.serialize())


def test_round_trip_on_cpu_gives_the_jitted_bits():
    ws = jf.create_allreduce_fusion_workspace(MESH, "tp", **KW)
    exported = jf.export.export(layer(ws), platforms=("cpu",))(*specs())
    args = values(new_rng())
    assert_same_bits(round_trip(exported).call(*args), layer(ws)(*args), "cpu round trip")


def test_workspace_key_is_stable_across_creation_order_and_names():
    first = jf.abstract_workspace(MESH, "tp", **KW)
    for _ in range(3):  # other workspaces created in between do not change the id
        jf.abstract_workspace(MESH, "tp", max_token_num=8, hidden_dim=512, dtype=jnp.float16)
    again = jf.abstract_workspace(MESH, "tp", **KW)
    assert again.id == first.id and again.serial > first.serial
    named = jf.abstract_workspace(MESH, "tp", name="decoder", **KW)
    assert named.id != first.id and "name='decoder'" in repr(named)
    # Each field of the key matters: members (device order), sizes, dtype, backend.
    swapped = make_mesh((2, 4), ("dp", "tp"), [1, 0, 2, 3, 4, 5, 6, 7])
    others = [
        jf.abstract_workspace(swapped, "tp", **KW),
        jf.abstract_workspace(MESH, "tp", **{**KW, "max_token_num": 2 * TOKENS}),
        jf.abstract_workspace(MESH, "tp", **{**KW, "hidden_dim": 2 * HIDDEN}),
        jf.abstract_workspace(MESH, "tp", **{**KW, "dtype": jnp.float16}),
        jf.abstract_workspace(MESH, "tp", backend="xla", **KW),
    ]
    assert len({first.id, *(o.id for o in others)}) == 1 + len(others)
    assert wsmod.workspace_key_id(first.key) == first.id and 0 < first.id < 2**63


@pytest.mark.parametrize("name", [5, "", b"x"])
def test_name_must_be_a_non_empty_str(name):
    with pytest.raises(ValueError, match="name must be None or a non-empty str"):
        jf.abstract_workspace(MESH, "tp", name=name, **KW)


def test_a_second_live_kernel_workspace_with_the_same_key_is_refused():
    live = jf.abstract_workspace(MESH, "tp", name="dup", **KW)
    live._ranks.append(object())  # as if its native ranks were registered
    wsmod._by_id[live.id] = live
    describe = lambda name: wsmod._describe(
        MESH, "tp", TOKENS, HIDDEN, jnp.bfloat16, "trtllm", name
    )
    twin = describe("dup")
    with pytest.raises(ValueError, match="pass a distinct name="):
        wsmod._claim_id(twin, allocates=True)
    wsmod._claim_id(describe("dup2"), allocates=True)
    live._ranks.clear()
    live._destroyed = True  # once destroyed, the key is free again
    wsmod._claim_id(twin, allocates=True)
    assert wsmod.lookup(twin.id) is twin


def test_disabled_checks_exempt_exactly_the_fused_targets():
    # The ops' targets (the dense op's and the one both MoE ops call), from the registry;
    # never the device timestamp of the benchmarks.
    assert jf.export.DISABLED_CHECKS == (
        jax.export.DisabledSafetyCheck.custom_call(FFI_TARGET),
        jax.export.DisabledSafetyCheck.custom_call(native.FFI_TARGETS["moe_allreduce_fusion"]),
    )


def test_cuda_export_carries_the_stable_key_and_needs_the_helper():
    ws = jf.abstract_workspace(MESH, "tp", name="serve", **KW)
    with pytest.raises(ValueError, match="custom call"):
        jax.export.export(layer(ws), platforms=("cuda",))(*specs())
    exported = jf.export.export(layer(ws), platforms=("cuda",))(*specs())
    text = exported.mlir_module()
    assert text.count(f"@{FFI_TARGET}") == 1 and "all_reduce" not in text
    same = jf.abstract_workspace(MESH, "tp", name="serve", **KW)
    assert jf.export.workspace_ids(exported) == [same.id]
    # Read back with JAX's own deserialize (inspection registers and compiles nothing).
    assert jf.export.workspace_ids(jax.export.deserialize(exported.serialize())) == [same.id]


@needs_native
def test_multi_platform_artifact_runs_the_reference_on_cpu():
    ws = jf.abstract_workspace(MESH, "tp", **KW)
    exported = jf.export.export(layer(ws), platforms=("cpu", "cuda"))(*specs())
    assert f"@{FFI_TARGET}" in exported.mlir_module()  # the cuda branch has the kernel
    xla_ws = jf.create_allreduce_fusion_workspace(MESH, "tp", **KW)
    args = values(new_rng())
    assert_same_bits(
        round_trip(exported).call(*args), layer(xla_ws)(*args), "(cpu, cuda) artifact on cpu"
    )


def test_compiling_the_kernel_call_without_the_native_module_says_what_to_install(monkeypatch):
    """A process with a cuda backend but no native module: lowering the kernel's call to
    compile it there raises, naming what to install; exporting the same program does not
    (the artifact needs only the target and its attributes)."""
    monkeypatch.setattr(native, "ext", None)
    real = jax.devices
    monkeypatch.setattr(
        jax, "devices", lambda backend=None: [object()] if backend == "cuda" else real(backend)
    )
    ws = jf.abstract_workspace(MESH, "tp", **KW)
    with pytest.raises(
        RuntimeError,
        match=rf"calls the fused kernel \({FFI_TARGET}\) and would be compiled here for this "
        r"process's GPUs, but jax_fusedar's native extension is not available .*nvcc",
    ):
        layer(ws).trace(*specs()).lower(lowering_platforms=("cuda",))
    text = jf.export.export(layer(ws), platforms=("cuda",))(*specs()).mlir_module()
    assert text.count(f"@{FFI_TARGET}") == 1


def test_exporting_an_xla_workspace_for_cuda_is_refused_and_plain_lowering_warns():
    ws = jf.create_allreduce_fusion_workspace(MESH, "tp", **KW)
    assert ws.backend == "xla"
    with pytest.raises(ValueError, match="not the fused kernel.*abstract_workspace"):
        jf.export.export(layer(ws), platforms=("cuda",))(*specs())
    with pytest.warns(UserWarning, match="XLA-backend workspace of a process without GPUs"):
        layer(ws).trace(*specs()).lower(lowering_platforms=("cuda",))
    with jf.export.allow_reference_for_cuda():
        exported = jf.export.export(layer(ws), platforms=("cuda",))(*specs())
    assert FFI_TARGET not in exported.mlir_module()
    # The CPU lowering of the same workspace is silent (the reference is what CPU runs).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jf.export.export(layer(ws), platforms=("cpu",))(*specs())


@pytest.mark.parametrize("backend", ["xla", "trtllm"])
def test_symbolic_token_counts_are_refused(backend):
    ws = jf.abstract_workspace(MESH, "tp", backend=backend, **KW)
    with pytest.raises(ValueError, match="symbolic shape.*one artifact per token count"):
        jf.export.export(layer(ws), platforms=("cpu",))(*specs(*jax.export.symbolic_shape("t")))


def test_row_parallel_exports_on_explicit_axes_and_auto_axes_get_an_explanation():
    rng = new_rng()
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_type,) * 2)
        kw = dict(max_token_num=16, hidden_dim=HIDDEN, dtype=jnp.bfloat16)
        ws = jf.create_allreduce_fusion_workspace(mesh, "tp", **kw)
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
            vals = [
                jax.device_put((rng.standard_normal(a.shape) / 8).astype(a.dtype), a.sharding)
                for a in args
            ]
            assert_same_bits(exported.call(*vals), jax.jit(f)(*vals), "row_parallel round trip")


# Exported like the dense op: their target is exempt too (one registry of the ops' targets).

MOE_TOKENS, MOE_HIDDEN, MOE_ROWS, TOP_K, EXPERTS = 4, 256, 6, 2, 3


def moe_layer(ws, pattern):
    """A tp=4 program (dp 2) of one MoE op: three per-rank inputs (expert rows and what
    weighs them), then the dp group's residual and gamma."""

    body, n_out = moe_body(ws, pattern)
    split, group = P(("dp", "tp")), P("dp")
    return jit_shard_map(body, ws.mesh, (split, split, split, group, group), (group,) * n_out)


def moe_specs(pattern):
    t, h, bf16 = MOE_TOKENS, MOE_HIDDEN, jnp.bfloat16
    if pattern == 7:
        shapes, dtypes = [(8, MOE_ROWS, h), (8, t, TOP_K), (8, t, TOP_K)], [bf16, jnp.int32, bf16]
    else:
        shapes, dtypes = [(8, EXPERTS, t, h), (8, EXPERTS, t), (8, t, h)], [bf16, jnp.float32, bf16]
    specs = [P(("dp", "tp"))] * 3 + [P("dp")] * 2
    return structs(MESH, zip(shapes + [(2 * t, h), (2 * h,)], specs), dtypes + [bf16] * 2)


def moe_values(rng, pattern):
    def value(spec):
        if spec.dtype == jnp.int32:
            return rng.integers(-1, MOE_ROWS, spec.shape).astype(np.int32)
        return (rng.standard_normal(spec.shape) / 4).astype(spec.dtype)

    return [jax.device_put(value(s), s.sharding) for s in moe_specs(pattern)]


@needs_native
@pytest.mark.parametrize("pattern", [6, 7])
def test_moe_export_round_trip(pattern):
    """Exported for (cpu, cuda) from an abstract kernel workspace: the cuda branch keeps the
    MoE custom call and the stable key; serialized, deserialized and run on CPU it gives the
    bits of the same program jitted on an XLA workspace."""
    kw = dict(max_token_num=MOE_TOKENS, hidden_dim=MOE_HIDDEN, dtype=jnp.bfloat16)
    served = jf.abstract_workspace(MESH, "tp", name="moe", **kw)
    export = jf.export.export(moe_layer(served, pattern), platforms=("cpu", "cuda"))
    exported = export(*moe_specs(pattern))
    text = exported.mlir_module()
    assert text.count(f"@{native.FFI_TARGETS['moe_allreduce_fusion']}") == 1, text
    assert f"pattern = {pattern} : i32" in text
    assert jf.export.workspace_ids(round_trip(exported)) == [served.id]
    xla_ws = jf.create_allreduce_fusion_workspace(MESH, "tp", **kw)
    args = moe_values(new_rng(), pattern)
    assert_same_bits(
        round_trip(exported).call(*args),
        moe_layer(xla_ws, pattern)(*args),
        f"pattern {pattern}: (cpu, cuda) artifact on cpu",
    )


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
text = exported.mlir_module()
call = [line for line in text.splitlines() if "@TARGET" in line]
facts = {
    "platforms": list(exported.platforms),
    "custom_calls": len(call),
    "call": call[0] if call else "",
    "ids": ns["jf"].export.workspace_ids(exported),
    "serving_id": ns["serving_ws"].id,
    "backend": ns["serving_ws"].backend,
}
# Lowering for cuda to inspect the program needs no module either.
lowered = ns["g"].trace(ns["partial"], ns["residual"], ns["gamma"]).lower(
    lowering_platforms=("cuda",)
)
facts["lowered_calls"] = lowered.as_text().count("@TARGET")
try:
    exec(serving, ns)
    facts["serving"] = "ran"
except RuntimeError as e:
    facts["serving"] = str(e)
print("FACTS " + json.dumps(facts))
"""


def test_the_docs_export_example_exports_without_the_native_module():
    """docs/jax_api.md's exporting side ("any machine") in a fresh process where
    the native extension cannot load: the artifact serializes with the kernel's custom call,
    its attributes and the serving workspace's stable id; its serving side, which compiles
    the artifact, refuses there, naming what to install."""
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
    r = run_script(
        WITHOUT_NATIVE.replace("TARGET", FFI_TARGET),
        env=env,
        timeout=600,
        stdin=json.dumps([exporting, marker + serving]),
    )
    assert r.returncode == 0, r.stderr[-6000:]
    facts = json.loads(r.stdout.split("FACTS ", 1)[1])
    assert facts["platforms"] == ["cpu", "cuda"] and facts["backend"] == "trtllm", facts
    assert facts["custom_calls"] == 1 and facts["lowered_calls"] == 1, facts
    assert facts["ids"] == [facts["serving_id"]], facts
    for attr in ("pattern = 1 : i32", "fp32_acc = true", f"workspace_id = {facts['serving_id']}"):
        assert attr in facts["call"], (attr, facts["call"])
    assert facts["serving"].startswith(
        f"jax_fusedar.export.deserialize: the artifact calls {FFI_TARGET}, whose handlers "
        "this process needs to compile it, but jax_fusedar's native extension is not available"
    ), facts["serving"]
    assert "build the package with a CUDA compiler (nvcc)" in facts["serving"], facts["serving"]
