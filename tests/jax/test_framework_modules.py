"""The Flax Linen, Flax NNX and Equinox modules of the fused op (jax_fusedar.flax,
jax_fusedar.equinox) on (dp, tp) = (2, 4) CPU devices: within the ulp bounds of the float64
oracle and allreduce_fusion's bits under jit + shard_map, grad, vmap, scan and remat (so they
fall back and refuse as it does); gamma's sharding metadata; the extra named if missing."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jax_fusedar as jf
from jax_fusedar.ops import reference
from tests.jax.cpu_helpers import assert_same_bits, check_outputs, jit_shard_map, new_rng, put
from tests.jax.cpu_helpers import random_gamma, random_partials, random_values
from tests.jax.cpu_helpers import require_host_devices
from tests.repo import run_code

require_host_devices()

DP, TP = 2, 4
TOKENS, HIDDEN = 8, 256
EPS = 1e-5
SPECS = (P(("dp", "tp")), P("dp"))  # per-rank partial sums; the residual stream
OUT_SPECS = (P("dp"), P("dp"))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((DP, TP), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)


def workspace(mesh, tokens):
    kw = dict(max_token_num=tokens, hidden_dim=HIDDEN, dtype=jnp.bfloat16)
    return jf.create_allreduce_fusion_workspace(mesh, "tp", **kw)


@pytest.fixture(scope="module")
def ws(mesh):
    w = workspace(mesh, 4 * TOKENS)
    yield w
    w.destroy()


def inputs(mesh, rng, lead=()):
    """(partial [dp*tp*tokens, H] placed as SPECS[0], residual [dp*tokens, H], the host
    partials and residual); ``lead`` adds leading (vmapped) axes on both."""
    partial = random_partials(rng, (*lead, DP * TP * TOKENS, HIDDEN), "bfloat16")
    residual = random_values(rng, (*lead, DP * TOKENS, HIDDEN), "bfloat16")
    specs = [P(*(None,) * len(lead), *s) for s in SPECS]
    return put(mesh, specs[0], partial), put(mesh, specs[1], residual), partial, residual


def oracle_check(partial, residual, gamma, residual_out, norm_out, what):
    """Every dp group's outputs against the float64 oracle of its tp ranks' partials."""
    for g in range(DP):
        rows = slice(g * TOKENS, (g + 1) * TOKENS)
        ranks = [partial[(g * TP + t) * TOKENS : (g * TP + t + 1) * TOKENS] for t in range(TP)]
        outs = dict(
            residual_out=np.asarray(residual_out)[rows], norm_out=np.asarray(norm_out)[rows]
        )
        gamma16 = np.asarray(jnp.asarray(gamma).astype(jnp.bfloat16))
        kw = dict(residual=residual[rows], gamma=gamma16, rms_eps=EPS, what=f"{what}, dp group {g}")
        check_outputs("bfloat16", ranks, **kw, **outs)


def direct(ws, partial, residual, gamma, **kw):
    kw.update(axis_name="tp", workspace=ws, residual=residual, rms_gamma=gamma, rms_eps=EPS)
    return jf.allreduce_fusion(partial, **kw)[1:3]


sharded = lambda mesh, f, in_specs, out_specs=OUT_SPECS: jit_shard_map(f, mesh, in_specs, out_specs)
cotangent = lambda mesh, rng: put(
    mesh, P("dp"), rng.standard_normal((DP * TOKENS, HIDDEN)).astype(np.float32)
)


def loss(outs, cot):
    residual_out, norm_out = outs
    f32 = lambda a: a.astype(jnp.float32)
    return jnp.sum(f32(norm_out) * cot) + jnp.sum(f32(residual_out) * cot[::-1])


class Framework:
    """make(ws, **options) -> (params, call): call(params, partial, residual) runs the module on
    one rank's shard; with_gamma sets params' gamma. ``rows``: make()'s options for all rows."""

    rows = {}

    def __init__(self):
        pytest.importorskip(self.package)
        self.lib, self.ours = map(importlib.import_module, self.modules)


class Linen(Framework):
    name, package, modules = "linen", "flax", ("flax.linen", "jax_fusedar.flax")
    gamma_of = lambda self, params: self.lib.unbox(params)["params"]["scale"]

    def with_gamma(self, variables, gamma):
        return {"params": {"scale": self.lib.LogicallyPartitioned(gamma, ("norm",))}}

    def make(self, ws, **kw):
        module = self.ours.ResidualRMSNorm(workspace=ws, epsilon=EPS, **kw)
        # Flax's init traces the call, so it runs where the call may: inside shard_map.
        local_p = jnp.zeros((TOKENS, HIDDEN), jnp.bfloat16)
        init = lambda p, r: module.init(jax.random.key(0), p, r)
        return jit_shard_map(init, ws.mesh, (P(), P()), P())(local_p, local_p), module.apply


class NNX(Framework):
    name, package, modules = "nnx", "flax", ("flax.nnx", "jax_fusedar.flax.nnx")
    gamma_of = lambda self, state: state["scale"][...]

    def make(self, ws, **kw):
        kw.update(workspace=ws, epsilon=EPS, rngs=self.lib.Rngs(0))
        graphdef, state = self.lib.split(self.ours.ResidualRMSNorm(HIDDEN, **kw))
        return state, lambda s, p, r: self.lib.merge(graphdef, s)(p, r)

    def with_gamma(self, state, gamma):
        state = jax.tree.map(lambda a: a, state)
        state["scale"] = self.lib.Param(jnp.asarray(gamma))
        return state


class Equinox(Framework):
    name, package, modules = "equinox", "equinox", ("equinox", "jax_fusedar.equinox")
    # Per token under vmap, a workspace too small for the rows still holds each token: the
    # batching rule then runs one call per token (docs/jax_api.md), nothing falls back.
    rows = {"per_token": False}
    gamma_of = lambda self, module: module.weight

    def with_gamma(self, module, gamma):
        return self.lib.tree_at(lambda m: m.weight, module, jnp.asarray(gamma))

    def make(self, ws, per_token=True, **kw):
        module = self.ours.ResidualRMSNorm(HIDDEN, workspace=ws, eps=EPS, **kw)
        # Equinox's convention: the module sees one token, vmap maps it over the rows.
        return module, (lambda m, p, r: jax.vmap(m)(p, r) if per_token else m(p, r))


@pytest.fixture(params=[Linen, NNX, Equinox], ids=lambda f: f.name)
def fw(request):
    return request.param()


def module_with_gamma(fw, ws, rng, gamma_dtype):
    params, call = fw.make(ws)
    return fw.with_gamma(params, random_gamma(rng, HIDDEN, gamma_dtype)), call


@pytest.mark.parametrize(
    "gamma_dtype, lead",
    [("bfloat16", ()), ("float32", ()), ("bfloat16", (3,))],
    ids=["bfloat16", "float32", "vmap"],
)
def test_module_matches_the_oracle_and_the_op_bit_for_bit(fw, mesh, ws, gamma_dtype, lead):
    """Also a batch of calls (vmap over a leading axis, inside shard_map): the op's under the
    same vmap (not unbatched calls': XLA may reduce the folded rows in another order)."""
    rng = new_rng()
    params, call = module_with_gamma(fw, ws, rng, gamma_dtype)
    partial, residual, host_p, host_r = inputs(mesh, rng, lead)
    batch = (None,) * len(lead)
    specs, out_specs = tuple(P(*batch, *s) for s in SPECS), (P(*batch, "dp"),) * 2
    vmap = (lambda f, axes: jax.vmap(f, in_axes=axes)) if lead else (lambda f, axes: f)
    got = sharded(mesh, vmap(call, (None, 0, 0)), (P(), *specs), out_specs)(
        params, partial, residual
    )
    gamma = fw.gamma_of(params)
    assert gamma.dtype == jnp.dtype(gamma_dtype)
    op = vmap(functools.partial(direct, ws), (0, 0, None))
    want = sharded(mesh, op, (*specs, P()), out_specs)(partial, residual, gamma)
    assert_same_bits(got, want, f"{fw.name}: the module against allreduce_fusion, lead {lead}")
    for i in np.ndindex(*lead):
        what = f"{fw.name}, gamma {gamma_dtype}, element {i}"
        oracle_check(host_p[i], host_r[i], gamma, got[0][i], got[1][i], what)


# Compiles several programs (4-8 s of CPU on 2 cores): the quick lane leaves it out.
@pytest.mark.slow
def test_module_gradients_are_the_ops(fw, mesh, ws):
    """jax.grad through the module (gamma, the partial sum and the residual) equals, bit for
    bit, jax.grad through allreduce_fusion, whose gradient is that of the plain math. Two
    layers of it in a lax.scan over stacked parameters, each under jax.checkpoint: forward and
    gradients equal the two layers unrolled without remat."""
    rng = new_rng()
    params, call = fw.make(ws)
    layers = [fw.with_gamma(params, random_gamma(rng, HIDDEN, "float32")) for _ in range(2)]
    partial, residual, _, _ = inputs(mesh, rng)
    cot = cotangent(mesh, rng)

    def grads(outputs, first, argnums=(0, 1, 2)):
        """outputs(first, partial, residual), and jax.grad of its loss w.r.t. ``argnums``."""
        body = lambda q, p, r, c: (
            outputs(q, p, r),
            jax.grad(lambda *a: loss(outputs(*a), c), argnums)(q, p, r),
        )
        grad_specs = tuple((P(), *SPECS)[i] for i in argnums)
        return sharded(mesh, body, (P(), *SPECS, P("dp")), (OUT_SPECS, grad_specs))(
            first, partial, residual, cot
        )

    got, g = grads(call, layers[0])[1], fw.gamma_of(layers[0])
    want = grads(lambda g, p, r: direct(ws, p, r, g), g)[1]
    assert_same_bits(
        (fw.gamma_of(got[0]), *got[1:]), want, f"{fw.name}: gradients against the op's"
    )
    # And the op's gradient is the plain math's: psum + residual add + RMSNorm at the op's
    # rounding points (its default fallback's all-reduce: the psum in the activations' dtype).

    def plain_math(g, p, r):
        out = reference.residual_add(
            reference.fallback_allreduce(p, "tp", fallback="xla", fp32_acc=True), r
        )
        norm = reference.rms_norm(
            out, g.astype(p.dtype), rms_eps=EPS, weight_bias=0.0, out_dtype=p.dtype
        )
        return out, norm

    assert_same_bits(want, grads(plain_math, g)[1], "the op's gradients against the plain math's")

    def scanned(stacked, p, r):
        r, norms = jax.lax.scan(lambda r, layer: jax.checkpoint(call)(layer, p, r), r, stacked)
        return r, norms[-1]

    def unrolled(layers, p, r):
        for layer in layers:
            r, n = call(layer, p, r)
        return r, n

    s_out, (s_grad,) = grads(scanned, jax.tree.map(lambda *a: jnp.stack(a), *layers), (0,))
    u_out, (u_grad,) = grads(unrolled, layers, (0,))
    assert_same_bits(s_out, u_out, f"{fw.name}: scan + remat forward")
    assert_same_bits(
        [fw.gamma_of(jax.tree.map(lambda a: a[i], s_grad)) for i in range(2)],
        [fw.gamma_of(g) for g in u_grad],
        f"{fw.name}: scan + remat gradients",
    )


def test_module_falls_back_and_refuses_as_the_op(fw, mesh):
    """A workspace too small for the call: the op's fallback's bits (either fallback), and with
    strict=True its error."""
    small = workspace(mesh, TOKENS // 2)
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


def test_flax_gamma_carries_its_sharding_metadata(mesh, ws):
    nn, nnx = Linen().lib, NNX().lib
    box = Linen().make(ws, kernel_axes=("embed_norm",))[0]["params"]["scale"]
    assert isinstance(box, nn.LogicallyPartitioned) and box.names == ("embed_norm",)
    assert nn.logical_to_mesh_axes(box.names, (("embed_norm", None),)) == P(None)
    with jax.set_mesh(mesh):  # Flax places a parameter with sharding metadata on creation
        m = NNX().ours.ResidualRMSNorm(HIDDEN, workspace=ws, kernel_axes=(None,), rngs=nnx.Rngs(0))
    assert m.scale.get_metadata()["out_sharding"] == (None,)
    assert nnx.get_partition_spec(nnx.state(m))["scale"].get_value() == P(None)
    # The workspace is static: the state holds gamma only.
    assert [a.shape for a in jax.tree.leaves(nnx.state(m))] == [(HIDDEN,)]


@pytest.mark.parametrize("extra", ["flax", "equinox"])
def test_import_without_the_framework_names_the_extra(extra):
    code = f"import sys\nsys.modules[{extra!r}] = None  # as if the package were not installed\n"
    code += (
        f"try:\n    import jax_fusedar.{extra}\nexcept ImportError as e:\n    print('ERROR', e)\n"
    )
    r = run_code(code, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"pip install 'jax_fusedar[{extra}]'" in r.stdout, r.stdout
