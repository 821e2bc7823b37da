"""jax_fusedar.fuse on models written in the styles public JAX code uses (tests/models/), on
8 virtual CPU devices ((dp, tp) = (2, 4)): the sites found and fused (or refused, with the
reason) per style; the fused model's outputs and gradients against the model as written,
within the documented bound; and the program lowered for CUDA holding one fused custom call
per fused site (the plain-jit Auto-axes style: the partition rule's per-shard program)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tests.jax import cpu_helpers
from tests.models import scanned_llama
from tests.models.common import Config
from tests.models.styles import PLAIN_JIT, REDUCE_SCATTER, STYLES
import jax_fusedar as jf
from jax_fusedar.ops.dense import FFI_TARGET

cpu_helpers.require_host_devices()

CFG = Config()
# The documented bound, at model level (docs/fusion_pass.md): every fused site is within
# its bound, and the differences travel through the layers as any rounding does. Measured
# on these 2-layer models: about one eps_T of max |output| forward, a few for gradients.
FORWARD_BOUND = 4.0  # max |fused - original| / (eps_T * max |original|)
GRAD_BOUND = 16.0


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _setup(style):
    mesh = style.mesh()
    params, x = style.inputs(CFG, mesh, seed=0)
    return mesh, params, x, style.forward(CFG, mesh)


def _kernel_workspace(style, mesh):
    """An abstract workspace of the kernel's backend for ``style``'s model on ``mesh``: what
    fuse meets on GPUs (on CPU its calls run the reference)."""
    dtype = jnp.dtype(style.dtype)
    return jf.abstract_workspace(
        mesh, "tp", max_token_num=CFG.tokens, hidden_dim=CFG.hidden, dtype=dtype, backend="trtllm"
    )


# The quick lane (./dev test --quick, under 2 minutes on 2 cores) keeps two styles, one
# refused and one fused, a few s of CPU each here; every style (2-layer models, forward and grad,
# fused and not: 1.3-10 s each) runs in the full suite.
QUICK_STYLES = {"gemma_sandwich", "hf_flax_llama"}


@pytest.mark.parametrize(
    "style",
    [
        pytest.param(s, id=s.name, marks=[] if s.name in QUICK_STYLES else [pytest.mark.slow])
        for s in STYLES
    ],
)
def test_style_is_fused_within_the_bound(style):
    """On the xla backend, but sequence parallelism (left as is without a kernel:
    test_fuse_reach.py) on a kernel workspace, as on GPUs."""
    mesh, params, x, forward = _setup(style)
    with jax.set_mesh(mesh):
        if style.kind == REDUCE_SCATTER:
            target = dict(workspace=_kernel_workspace(style, mesh))
        else:
            target = dict(mesh=mesh, axis_name="tp", backend="xla")
        fused = jf.fuse(forward, **target, allow_rounding_change=style.allow_rounding_change)
        out = fused(params, x)
        want = jax.jit(forward)(params, x)
    rep = fused.report
    assert len(rep.sites) == style.sites(CFG), rep.line()
    assert {s.kind for s in rep.sites} == {style.kind}, rep.sites
    if not style.fused:
        assert not rep.fused, rep.line()
        assert all(s.reason.startswith(style.reason) for s in rep.sites), rep.line()
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
        return
    assert len(rep.fused) == style.sites(CFG), rep.line()
    if style.module is scanned_llama:  # every add of the residual stream, every layer
        assert rep.fused_runs() == 2 * CFG.layers, rep.line()
    assert all(s.weight_bias == style.weight_bias for s in rep.sites)
    assert all(bool(s.rounding_change) == style.rounding_change for s in rep.sites)
    eps = float(jnp.finfo(style.dtype).eps)
    assert _rel(out, want) <= FORWARD_BOUND * eps, _rel(out, want) / eps
    if not style.grad_check:
        return
    ct = jnp.asarray(np.random.default_rng(3).standard_normal(want.shape), jnp.float32)
    loss = lambda fn: lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32) * ct)
    with jax.set_mesh(mesh):
        g_fused = jax.jit(jax.grad(loss(fused), argnums=(0, 1)))(params, x)
        g_want = jax.jit(jax.grad(loss(forward), argnums=(0, 1)))(params, x)
    worst = max(_rel(a, b) for a, b in zip(jax.tree.leaves(g_fused), jax.tree.leaves(g_want)))
    assert worst <= GRAD_BOUND * eps, worst / eps


def _partitioned_shard_for_cuda(jaxpr, mesh):
    """The per-shard program the partition rule gives the first plain-jit site on Auto axes
    (what XLA compiles on each GPU), lowered for cuda."""
    found = []

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "custom_partitioning":
                found.append(e)
            for v in e.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns"):
                    walk(sub)

    walk(jaxpr)
    assert found, "no custom_partitioning call in the fused program"
    e = found[0]
    cfg = e.params["static_args"][0]
    h, w, res, g = (v.aval for v in e.invars)
    # The first contracted pair over "tp" (bhtq,hqd: h), the batch over "dp".
    dims = cfg.dims
    h_spec = [None] * dims.h_ndim
    w_spec = [None] * dims.w_ndim
    h_spec[dims.h_dims[0]], w_spec[dims.w_dims[0]] = "tp", "tp"
    if 0 not in dims.h_dims:
        h_spec[0] = "dp"
    specs = (P(*h_spec), P(*w_spec), P("dp"), P())

    def arg(aval, spec):
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=NamedSharding(mesh, spec))

    args = tuple(arg(a, s) for a, s in zip((h, w, res, g), specs))
    return cpu_helpers.partitioned_shard_text(cfg, mesh, args)


@pytest.mark.parametrize(
    "style", [s for s in STYLES if s.fused], ids=[s.name for s in STYLES if s.fused]
)
def test_style_lowers_to_the_fused_custom_call_for_cuda(style):
    mesh, params, x, forward = _setup(style)
    fused = jf.fuse(
        forward,
        workspace=_kernel_workspace(style, mesh),
        allow_rounding_change=style.allow_rounding_change,
    )
    with jax.set_mesh(mesh):
        traced = jax.jit(fused).trace(params, x)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    n = style.sites(CFG)
    if style.kind == PLAIN_JIT and style.axis_type == AxisType.Auto:
        # Partitioned when XLA compiles: the module holds the partitioned calls, and the
        # partition rule's per-shard program holds the kernel.
        assert text.count("CustomSPMDPartitioning") == n, text
        shard = _partitioned_shard_for_cuda(traced.jaxpr.jaxpr, mesh)
        assert shard.count(f"@{FFI_TARGET}") == 1 and "all_reduce" not in shard
        return
    assert text.count(f"@{FFI_TARGET}") == n, fused.report.line()
    collectives = ("all_reduce", "reduce_scatter")
    assert not any(c in text for c in collectives), [c for c in collectives if c in text]
