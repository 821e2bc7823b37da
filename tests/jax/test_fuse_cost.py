"""What keeps ``jax_fusedar.fuse``'s own time small, counted rather than timed (the times
are benchmarks/fuse_cost.py's): each site is matched once where a scope's two matching
passes see the same program, and sites of one signature share one trace of the code that
replaces them."""

import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

import jax_fusedar as jf
from jax_fusedar import workspace
from jax_fusedar.fusion import matching
from jax_fusedar.ops import partitioning
from tests.jax import cpu_helpers
from tests.jax.fuse_checks import rms_norm

cpu_helpers.require_host_devices()

MESH = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Auto,))
T, H, F, LAYERS = 8, 64, 128, 3


def decoder(x, w_up, w_down, g):
    """Plain-jit MLP layers (the down-projection's partitioner all-reduce), the activation and
    a select in jitted helpers as models write them."""
    h = rms_norm(x, g[0])
    for i in range(LAYERS):
        a = jax.jit(jax.nn.silu)(h @ w_up[i])
        a = jnp.where(jnp.isfinite(a), a, 0.0)  # a jitted select_n (and a scalar's cast)
        x = a @ w_down[i] + x
        h = rms_norm(x, g[i + 1])
    return h


def put(a, spec):
    return cpu_helpers.put(MESH, spec, jnp.asarray(a, jnp.bfloat16))


def operands():
    rng = np.random.default_rng(3)
    return (
        put(rng.standard_normal((T, H)), P()),
        put(rng.standard_normal((LAYERS, H, F)) / 8, P(None, None, "tp")),
        put(rng.standard_normal((LAYERS, F, H)) / 8, P(None, "tp")),
        put(1 + 0.1 * rng.standard_normal((LAYERS + 1, H)), P()),
    )


def counting(monkeypatch, module, name):
    """``module.name`` wrapped to count its calls (``.call_count``)."""
    counted = mock.Mock(wraps=getattr(module, name))
    monkeypatch.setattr(module, name, counted)
    return counted


def assert_within_a_bfloat16_unit(got, want):
    """The fallback writes the site as the program does: the same value (roundings aside,
    which are XLA's to order on this CPU: compared to one bfloat16 unit)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 2.0**-7 * np.max(np.abs(b))


def test_each_site_is_matched_once_and_its_epilogue_traced_once(monkeypatch):
    """The jitted helpers beside each site are not opened, the second matching pass reuses
    the first's matches; the epilogues (one signature) are traced once."""
    matched = counting(monkeypatch, matching, "match_plain_dot")
    epilogues = counting(monkeypatch, partitioning, "row_parallel_without_kernel")
    args = operands()
    fused = jf.fuse(decoder, mesh=MESH, axis_name="tp", backend="xla")
    with jax.set_mesh(MESH):
        report = fused.analyze(*args)
        assert [s.fused for s in report.sites] == [True] * LAYERS, report.line()
        assert (matched.call_count, epilogues.call_count) == (LAYERS, 1)
        assert_within_a_bfloat16_unit(jax.jit(fused)(*args), jax.jit(decoder)(*args))


def checkpointed_decoder(x, w_up, w_down, w_o, g):
    """Pre-norm layers, each a jax.checkpoint call (MaxText's unscanned layers): the add at
    the end of one call and the norm at the start of the next make a site across calls."""

    def layer(x, w_up, w_down, w_o, g_attn, g_mlp):
        h = rms_norm(x, g_attn)
        x = jnp.tanh(h @ w_up) @ w_o + x
        h = rms_norm(x, g_mlp)
        return jax.nn.silu(h @ w_up) @ w_down + x

    for i in range(LAYERS):
        x = jax.checkpoint(layer)(x, w_up[i], w_down[i], w_o[i], g[2 * i], g[2 * i + 1])
    return rms_norm(x, g[-1])


def test_checkpointed_layers_rotated_are_planned_once(monkeypatch):
    """Rotating fuses more than the calls as written could, which are then not planned to
    count theirs. Each rewritten call stands after the slice of the next layer's gamma."""
    matched = counting(monkeypatch, matching, "match_plain_dot")
    x, w_up, w_down, g = operands()
    w_o = put(np.random.default_rng(4).standard_normal((LAYERS, F, H)) / 8, P(None, "tp"))
    args = (x, w_up, w_down, w_o, jnp.concatenate([g, g, g[:1]])[: 2 * LAYERS + 1])
    fused = jf.fuse(checkpointed_decoder, mesh=MESH, axis_name="tp", backend="xla")
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
    with jax.set_mesh(MESH):
        report = fused.analyze(*args)
        assert matched.call_count == 2 * LAYERS
        assert [s.fused for s in report.sites] == [True] * (2 * LAYERS), report.line()
        assert sum("across checkpoint calls" in (s.note or "") for s in report.sites) == LAYERS
        got = jax.jit(jax.value_and_grad(loss(fused), argnums=(0, 4)))(*args)
        want = jax.jit(jax.value_and_grad(loss(checkpointed_decoder), argnums=(0, 4)))(*args)
    assert_within_a_bfloat16_unit(got, want)


def test_the_workspaces_creation_is_timed_apart_from_the_analysis(monkeypatch):
    """Creating a kernel workspace is a collective, as slow as the slowest rank: the report
    keeps it out of ``analysis_s`` (in ``allocate_s``); a creation made slow here shows it."""
    original = workspace.create_allreduce_fusion_workspace

    def slow(*a, **k):
        time.sleep(0.5)
        return original(*a, **k)

    monkeypatch.setattr(workspace, "create_allreduce_fusion_workspace", slow)
    fused = jf.fuse(decoder, mesh=MESH, axis_name="tp", backend="xla")
    with jax.set_mesh(MESH):
        report = fused.analyze(*operands())
    assert len(report.fused) == LAYERS, report.line()
    assert 0.5 <= report.allocate_s < 0.5 * len(fused.workspaces) + 0.5
    assert 0 < report.analysis_s < report.allocate_s
    assert report.pass_s >= report.analysis_s + report.allocate_s
    assert report.as_dict()["allocate_s"] == report.allocate_s
