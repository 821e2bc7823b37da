"""The Flax Linen, Flax NNX and Equinox modules of the fused op (jax_fusedar.flax,
jax_fusedar.equinox) on 8 CPU devices ((dp, tp) = (2, 4)): each module's outputs are within
the fused op's ulp bounds of the float64 oracle of psum + residual add + RMSNorm; they are
jax_fusedar.allreduce_fusion's, bit for bit, under jit + shard_map, jax.grad, vmap, scan and
remat (so each falls back, and refuses under strict mode, exactly as it does); gamma carries
the framework's sharding metadata; and without the framework the import names the extra."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jax_fusedar as jf
from jax_fusedar.ops import reference
from tests.jax.cpu_helpers import (
    assert_same_bits,
    check_outputs,
    jit_shard_map,
    new_rng,
    put,
    random_gamma,
    random_partials,
    random_values,
    require_host_devices,
)
from tests.repo import REPO

require_host_devices()

DP, TP = 2, 4
TOKENS, HIDDEN = 8, 256
EPS = 1e-5
DTYPE = "bfloat16"
SPECS = (P(("dp", "tp")), P("dp"))  # per-rank partial sums; the residual stream
OUT_SPECS = (P("dp"), P("dp"))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((DP, TP), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture(scope="module")
def ws(mesh):
    w = jf.create_allreduce_fusion_workspace(
        mesh, "tp", max_token_num=4 * TOKENS, hidden_dim=HIDDEN, dtype=jnp.bfloat16
    )
    yield w
    w.destroy()


def inputs(mesh, rng, lead=()):
    """(partial [dp*tp*tokens, H] placed as SPECS[0], residual [dp*tokens, H], the host
    partials and residual); ``lead`` adds leading (vmapped) axes on both."""
    partial = random_partials(rng, (*lead, DP * TP * TOKENS, HIDDEN), DTYPE)
    residual = random_values(rng, (*lead, DP * TOKENS, HIDDEN), DTYPE)
    specs = [P(*(None,) * len(lead), *s) for s in SPECS]
    return put(mesh, specs[0], partial), put(mesh, specs[1], residual), partial, residual


def oracle_check(partial, residual, gamma, residual_out, norm_out, what):
    """Every dp group's outputs against the float64 oracle of its tp ranks' partials."""
    for g in range(DP):
        rows = slice(g * TOKENS, (g + 1) * TOKENS)
        ranks = [partial[(g * TP + t) * TOKENS : (g * TP + t + 1) * TOKENS] for t in range(TP)]
        check_outputs(
            DTYPE,
            ranks,
            residual=residual[rows],
            gamma=np.asarray(jnp.asarray(gamma).astype(jnp.bfloat16)),
            rms_eps=EPS,
            residual_out=np.asarray(residual_out)[rows],
            norm_out=np.asarray(norm_out)[rows],
            what=f"{what}, dp group {g}",
        )


def direct(ws, partial, residual, gamma, **kw):
    out = jf.allreduce_fusion(
        partial, axis_name="tp", workspace=ws, residual=residual, rms_gamma=gamma, rms_eps=EPS, **kw
    )
    return out.residual_out, out.norm_out


def sharded(mesh, f, in_specs, out_specs=OUT_SPECS):
    return jit_shard_map(f, mesh, in_specs, out_specs)


def loss(outs, cot):
    residual_out, norm_out = outs
    return jnp.sum(norm_out.astype(jnp.float32) * cot) + jnp.sum(
        residual_out.astype(jnp.float32) * cot[::-1]
    )


# --- the three frameworks, behind one interface ---------------------------------------------
# Each: make(ws, **options) -> (params, call) where call(params, partial, residual) runs the
# module on one rank's shard, and params is a pytree whose gamma leaf is set by with_gamma.


class Linen:
    name = "linen"
    rows = {}  # make()'s options for a call on all the rows at once

    def __init__(self):
        pytest.importorskip("flax")
        from flax import linen as nn

        import jax_fusedar.flax as jff

        self.nn, self.jff = nn, jff

    def make(self, ws, **kw):
        module = self.jff.ResidualRMSNorm(workspace=ws, epsilon=EPS, **kw)
        # Flax's init traces the call, so it runs where the call may: inside shard_map.
        local_p = jnp.zeros((TOKENS, HIDDEN), jnp.bfloat16)
        init = jit_shard_map(
            lambda p, r: module.init(jax.random.key(0), p, r), ws.mesh, (P(), P()), P()
        )
        variables = init(local_p, local_p)
        return variables, lambda v, p, r: module.apply(v, p, r)

    def with_gamma(self, variables, gamma):
        return {"params": {"scale": self.nn.LogicallyPartitioned(gamma, ("norm",))}}

    def gamma_of(self, params):
        return self.nn.unbox(params)["params"]["scale"]


class NNX:
    name = "nnx"
    rows = {}

    def __init__(self):
        pytest.importorskip("flax")
        from flax import nnx

        import jax_fusedar.flax.nnx as jfn

        self.nnx, self.jfn = nnx, jfn

    def make(self, ws, **kw):
        module = self.jfn.ResidualRMSNorm(
            HIDDEN, workspace=ws, epsilon=EPS, rngs=self.nnx.Rngs(0), **kw
        )
        graphdef, state = self.nnx.split(module)
        return state, lambda s, p, r: self.nnx.merge(graphdef, s)(p, r)

    def with_gamma(self, state, gamma):
        state = jax.tree.map(lambda a: a, state)
        state["scale"] = self.nnx.Param(jnp.asarray(gamma))
        return state

    def gamma_of(self, state):
        return state["scale"][...]


class Equinox:
    name = "equinox"
    # Per token under vmap, a workspace too small for the rows still holds each token: the
    # batching rule then runs one call per token (docs/jax_api.md), nothing falls back.
    rows = {"per_token": False}

    def __init__(self):
        pytest.importorskip("equinox")
        import equinox as eqx

        import jax_fusedar.equinox as jfe

        self.eqx, self.jfe = eqx, jfe

    def make(self, ws, per_token=True, **kw):
        module = self.jfe.ResidualRMSNorm(HIDDEN, workspace=ws, eps=EPS, **kw)
        # Equinox's convention: the module sees one token, vmap maps it over the rows.
        if per_token:
            return module, lambda m, p, r: jax.vmap(m)(p, r)
        return module, lambda m, p, r: m(p, r)

    def with_gamma(self, module, gamma):
        return self.eqx.tree_at(lambda m: m.weight, module, jnp.asarray(gamma))

    def gamma_of(self, module):
        return module.weight


FRAMEWORKS = [Linen, NNX, Equinox]


@pytest.fixture(params=FRAMEWORKS, ids=lambda f: f.name)
def fw(request):
    return request.param()


@pytest.mark.parametrize("gamma_dtype", ["bfloat16", "float32"])
def test_module_matches_the_oracle_and_the_op_bit_for_bit(fw, mesh, ws, gamma_dtype):
    rng = new_rng()
    params, call = fw.make(ws)
    params = fw.with_gamma(params, random_gamma(rng, HIDDEN, gamma_dtype))
    partial, residual, host_p, host_r = inputs(mesh, rng)
    got = sharded(mesh, call, (P(), *SPECS))(params, partial, residual)
    gamma = fw.gamma_of(params)
    assert gamma.dtype == jnp.dtype(gamma_dtype)
    want = sharded(mesh, functools.partial(direct, ws), (*SPECS, P()))(partial, residual, gamma)
    assert_same_bits(got, want, f"{fw.name}: the module against allreduce_fusion")
    oracle_check(host_p, host_r, gamma, *got, f"{fw.name}, gamma {gamma_dtype}")


# The gradient and scan + remat tests compile several programs each (2-4 s of CPU on 2
# cores): the full suite runs them, the quick lane leaves them out.
@pytest.mark.slow
def test_module_gradients_are_the_ops(fw, mesh, ws):
    """jax.grad through the module (gamma, the partial sum and the residual) equals, bit for
    bit, jax.grad through allreduce_fusion, whose gradient is that of the plain math."""
    rng = new_rng()
    params, call = fw.make(ws)
    params = fw.with_gamma(params, random_gamma(rng, HIDDEN, "float32"))
    partial, residual, _, _ = inputs(mesh, rng)
    cot = put(mesh, P("dp"), rng.standard_normal((DP * TOKENS, HIDDEN)).astype(np.float32))

    def grads(outputs, first):
        """jax.grad of the loss of ``outputs(first, partial, residual)`` w.r.t. all three."""

        def body(q, p, r, c):
            return jax.grad(lambda q, p, r: loss(outputs(q, p, r), c), (0, 1, 2))(q, p, r)

        in_specs = (P(), *SPECS, P("dp"))
        return sharded(mesh, body, in_specs, (P(), *SPECS))(first, partial, residual, cot)

    got = grads(call, params)
    g = fw.gamma_of(params)
    want = grads(lambda g, p, r: direct(ws, p, r, g), g)
    assert_same_bits(
        (fw.gamma_of(got[0]), got[1], got[2]), want, f"{fw.name}: gradients against the op's"
    )
    # And the op's gradient is the plain math's: psum + residual add + RMSNorm.
    plain = grads(lambda g, p, r: plain_math(p, r, g), g)
    assert_same_bits(want, plain, "the op's gradients against the plain math's")


def plain_math(p, r, g):
    """psum + residual add + RMSNorm in plain JAX at the op's rounding points (its default
    fallback's all-reduce: the psum in the activations' dtype)."""
    s = reference.fallback_allreduce(p, "tp", fallback="xla", fp32_acc=True)
    out = reference.residual_add(s, r)
    return out, reference.rms_norm(
        out, g.astype(p.dtype), rms_eps=EPS, weight_bias=0.0, out_dtype=p.dtype
    )


def test_module_under_vmap(fw, mesh, ws):
    """A batch of calls (vmap over a leading axis, inside shard_map) is allreduce_fusion's
    under the same vmap, bit for bit, and each element is within the oracle's bounds. (Not
    bit-equal to unbatched calls: XLA may reduce the folded rows in another order.)"""
    rng = new_rng()
    params, call = fw.make(ws)
    params = fw.with_gamma(params, random_gamma(rng, HIDDEN, "bfloat16"))
    partial, residual, host_p, host_r = inputs(mesh, rng, lead=(3,))
    specs = tuple(P(None, *s) for s in SPECS)
    out_specs = tuple(P(None, "dp") for _ in range(2))
    got = sharded(
        mesh,
        lambda q, p, r: jax.vmap(call, in_axes=(None, 0, 0))(q, p, r),
        (P(), *specs),
        out_specs,
    )(params, partial, residual)
    gamma = fw.gamma_of(params)
    want = sharded(
        mesh,
        lambda p, r, g: jax.vmap(functools.partial(direct, ws), in_axes=(0, 0, None))(p, r, g),
        (*specs, P()),
        out_specs,
    )(partial, residual, gamma)
    assert_same_bits(got, want, f"{fw.name}: vmap against allreduce_fusion's vmap")
    for i in range(3):
        oracle_check(host_p[i], host_r[i], gamma, got[0][i], got[1][i], f"{fw.name}, element {i}")


@pytest.mark.slow
def test_module_under_scan_and_remat(fw, mesh, ws):
    """Two layers of the module in a lax.scan over stacked parameters, each layer under
    jax.checkpoint: forward and gradients equal the two layers unrolled without remat."""
    rng = new_rng()
    params, call = fw.make(ws)
    layers = [fw.with_gamma(params, random_gamma(rng, HIDDEN, "float32")) for _ in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    partial, residual, _, _ = inputs(mesh, rng)

    def scanned(stacked, p, r):
        def step(r, layer):
            r, n = jax.checkpoint(call)(layer, p, r)
            return r, n

        r, norms = jax.lax.scan(step, r, stacked)
        return r, norms[-1]

    def unrolled(layers, p, r):
        for layer in layers:
            r, n = call(layer, p, r)
        return r, n

    cot = put(mesh, P("dp"), rng.standard_normal((DP * TOKENS, HIDDEN)).astype(np.float32))

    def run(f, params):
        def body(q, p, r, c):
            return f(q, p, r), jax.grad(lambda q: loss(f(q, p, r), c))(q)

        in_specs = (P(), *SPECS, P("dp"))
        return sharded(mesh, body, in_specs, (OUT_SPECS, P()))(params, partial, residual, cot)

    (s_out, s_grad), (u_out, u_grad) = run(scanned, stacked), run(unrolled, layers)
    assert_same_bits(s_out, u_out, f"{fw.name}: scan + remat forward")
    assert_same_bits(
        [fw.gamma_of(jax.tree.map(lambda a: a[i], s_grad)) for i in range(2)],
        [fw.gamma_of(g) for g in u_grad],
        f"{fw.name}: scan + remat gradients",
    )


def test_module_falls_back_and_refuses_as_the_op(fw, mesh):
    """A workspace too small for the call: the module falls back to psum + RMSNorm as
    allreduce_fusion does (the same bits, with either fallback), and with strict=True raises
    its error."""
    small = jf.create_allreduce_fusion_workspace(
        mesh, "tp", max_token_num=TOKENS // 2, hidden_dim=HIDDEN, dtype=jnp.bfloat16
    )
    try:
        rng = new_rng()
        partial, residual, _, _ = inputs(mesh, rng)
        gamma = random_gamma(rng, HIDDEN, "bfloat16")

        def module_and_op(**options):
            """The module's outputs and allreduce_fusion's, both with ``options``."""
            params, call = fw.make(small, **options, **fw.rows)
            got = sharded(mesh, call, (P(), *SPECS))(
                fw.with_gamma(params, gamma), partial, residual
            )
            op = functools.partial(direct, small, **options)
            return got, sharded(mesh, op, (*SPECS, P()))(partial, residual, jnp.asarray(gamma))

        got, want = module_and_op()
        assert_same_bits(got, want, f"{fw.name}: the fallback")
        # The fallback option reaches the op: the kernel's rank-order additions, asked for.
        got, want_exact = module_and_op(fallback="kernel_exact", fp32_acc=False)
        assert_same_bits(got, want_exact, f"{fw.name}: the kernel-exact fallback")
        assert not np.array_equal(np.asarray(want_exact[0]), np.asarray(want[0]))
        # (Linen's init traces the call, so there the refusal comes at init.)
        with pytest.raises(ValueError, match="cannot use the fused kernel.*exceed the workspace"):
            strict_params, strict_call = fw.make(small, strict=True, **fw.rows)
            sharded(mesh, strict_call, (P(), *SPECS))(strict_params, partial, residual)
    finally:
        small.destroy()


def test_linen_gamma_is_logically_partitioned(mesh, ws):
    pytest.importorskip("flax")
    from flax import linen as nn

    variables, _ = Linen().make(ws, kernel_axes=("embed_norm",))
    box = variables["params"]["scale"]
    assert isinstance(box, nn.LogicallyPartitioned) and box.names == ("embed_norm",)
    rules = (("embed_norm", None),)
    assert nn.logical_to_mesh_axes(box.names, rules) == P(None)


def test_nnx_gamma_carries_its_sharding_metadata(mesh, ws):
    pytest.importorskip("flax")
    from flax import nnx

    import jax_fusedar.flax.nnx as jfn

    with jax.set_mesh(mesh):  # Flax places a parameter with sharding metadata on creation
        m = jfn.ResidualRMSNorm(HIDDEN, workspace=ws, kernel_axes=(None,), rngs=nnx.Rngs(0))
    assert m.scale.get_metadata()["out_sharding"] == (None,)
    assert nnx.get_partition_spec(nnx.state(m))["scale"].get_value() == P(None)
    # The workspace is static: the state holds gamma only.
    assert [a.shape for a in jax.tree.leaves(nnx.state(m))] == [(HIDDEN,)]


IMPORT_WITHOUT = r"""
import sys
sys.modules[{module!r}] = None  # as if the package were not installed
try:
    import {ours}
except ImportError as e:
    print("ERROR", e)
"""


@pytest.mark.parametrize(
    "module, ours, extra",
    [("flax", "jax_fusedar.flax", "flax"), ("equinox", "jax_fusedar.equinox", "equinox")],
)
def test_import_without_the_framework_names_the_extra(module, ours, extra):
    r = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT.format(module=module, ours=ours)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"pip install 'jax_fusedar[{extra}]'" in r.stdout, r.stdout
