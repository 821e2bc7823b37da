"""jax_fusedar.fuse sees through what framework code puts between the matmul (or psum), the
residual add and the norm, on 8 virtual CPU devices: sharding constraints, reshard,
``checkpoint_name`` (kept in the program around the fused call), a per-token linear under
``vmap`` (``w @ x`` then a transpose), gamma multiplied after the norm's rounding (left after
the fused norm), and the near misses a report lists when nothing fuses. Each form is fused
bit for bit on the xla backend (XLA rounding as written: tests/cpu_devices.py)."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tests.jax import cpu_helpers
from tests.jax.cpu_helpers import mesh_2x4
from tests.jax.fuse_checks import F, H, T, assert_bit_equal, assert_close, fuse_and_run
from tests.jax.fuse_checks import linear_operands, rms_norm
import jax_fusedar as jf

cpu_helpers.require_host_devices()

f32 = jnp.float32


def fuse_and_compare(fn, args, mesh, **kw):
    """The report and the fused program's jaxpr, after checking that its outputs are the
    original's bit for bit and its gradients within 4 bfloat16 eps of them."""
    fused, out, want, g_f, g_o = fuse_and_run(fn, args, mesh, grads=True, **kw)
    assert_bit_equal(out, want)
    assert_close(g_f, g_o, 4 * float(jnp.finfo(jnp.bfloat16).eps))
    with jax.set_mesh(mesh):
        return fused.report, str(jax.make_jaxpr(fused)(*args))


def one_site(fn, args, mesh):
    """``fn``'s one site fused (bit for bit, gradients within the bound); its report."""
    with jax.set_mesh(mesh):
        rep, _ = fuse_and_compare(fn, args, mesh)
    assert len(rep.fused) == 1, rep.line()
    return rep


@pytest.mark.parametrize("where", ["sum", "residual_sum", "both"])
def test_sharding_constraints_and_names_are_looked_through_and_kept(where):
    """MaxText's order: checkpoint_name and a sharding constraint on the projection and on the
    residual sum; the latter stays around the fused call's residual_out."""
    mesh = mesh_2x4()
    sc = lambda v: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P("dp")))

    def fn(x, w, res, g):
        s = x @ w
        if where in ("sum", "both"):
            s = sc(checkpoint_name(s, "out_proj"))
        r = res + s
        if where in ("residual_sum", "both"):
            r = checkpoint_name(sc(r), "decoder_layer_input")
        return r, rms_norm(r, g)

    with jax.set_mesh(mesh):
        rep, text = fuse_and_compare(fn, linear_operands(mesh), mesh)
        original = str(jax.make_jaxpr(fn)(*linear_operands(mesh)))
    assert len(rep.fused) == 1, rep.line()
    # No kernel on CPU: the fused entry is the model's own matmul, then the fused op's
    # epilogue (rewritten, the same values); with a kernel, the custom-partitioned entry.
    assert text != original and "custom_partitioning" not in text
    if where in ("residual_sum", "both"):
        # kept: the constraint and the name read the fused call's residual_out
        assert "sharding_constraint" in text and "name[name=decoder_layer_input]" in text
    else:
        assert "name[name=out_proj]" not in text  # the sum is gone with the matmul


def test_reshard_and_explicit_axes_are_looked_through():
    mesh = mesh_2x4(AxisType.Explicit)

    def fn(x, w, res, g):
        s = jnp.einsum("tf,fh->th", x, w, out_sharding=P("dp"))
        r = jax.sharding.reshard(res + s, P("dp"))
        return r, rms_norm(r, g)

    one_site(fn, linear_operands(mesh), mesh)


@pytest.mark.parametrize("policy", [None, "saving"], ids=["default policy", "saving policy"])
def test_a_name_on_the_sum_under_a_saving_policy_stays_as_written(policy):
    """Under a policy saving named values the fused op would leave the named sum uncomputed
    (what was saved would no longer be): refused. The default policy saves inputs only."""
    mesh = mesh_2x4()
    if policy:
        policy = jax.checkpoint_policies.save_only_these_names("out_proj")

    def layer(x, w, res, g):
        r = res + checkpoint_name(x @ w, "out_proj")
        return r, rms_norm(r, g)

    with jax.set_mesh(mesh):
        rep, _ = fuse_and_compare(jax.checkpoint(layer, policy=policy), linear_operands(mesh), mesh)
    if policy is None:
        assert len(rep.fused) == 1, rep.line()
    else:
        assert not rep.fused and rep.sites[0].reason.startswith(
            "checkpoint_name 'out_proj' on the all-reduce's sum"
        ), rep.line()


def test_a_per_token_linear_under_vmap_is_fused_in_its_own_order():
    """Equinox's Linear (vmap of w @ x, then a transpose): the fused call contracts in that
    order (weight_first), so the sums are the program's."""
    mesh = mesh_2x4()

    def fn(x, w, res, g):
        r = res + jax.vmap(lambda t: w @ t)(x)  # w: [H, F], split along F
        return r, rms_norm(r, g)

    args = linear_operands(mesh, w_shape=(H, F), w_spec=P(None, "tp"))
    with jax.set_mesh(mesh):
        assert "transpose" in str(jax.make_jaxpr(fn)(*args))
    assert one_site(fn, args, mesh).sites[0].kind == "dot_general"


def test_gamma_after_the_rounding_leaves_its_multiplication_in_the_program():
    """MaxText's RMSNorm: normalized, rounded to T, then gamma by an einsum (a dot_general with
    a batch dim): the fused norm is the rounded value, the einsum stays after it."""
    mesh = mesh_2x4()

    def fn(x, w, res, g):
        r = res + x @ w
        f = r.astype(f32)
        y = (f * jax.lax.rsqrt(jnp.mean(f * f, -1, keepdims=True) + 1e-6)).astype(r.dtype)
        return r, jnp.einsum("k,...k->...k", g, y)

    assert one_site(fn, linear_operands(mesh), mesh).sites[0].rounding_change is None


@pytest.mark.parametrize("fused", [False, True], ids=["nothing fused", "a fused site"])
def test_nothing_fused_lists_the_near_misses(fused):
    """A matmul whose sum goes through an op fuse cannot see through: the report names it,
    what follows it and why. A fused site lists no near misses."""
    mesh = mesh_2x4()

    def fn(x, w, res, g):
        if fused:
            r = res + x @ w
            return r, rms_norm(r, g) @ jnp.ones((H, H), jnp.bfloat16)
        r = res + jnp.tanh(x @ w)
        return r, rms_norm(r, g)

    with jax.set_mesh(mesh):
        rep = jf.fuse(fn, mesh=mesh, axis_name="tp", backend="xla").analyze(*linear_operands(mesh))
    if fused:
        assert len(rep.fused) == 1 and rep.near_misses == [], rep
        return
    assert not rep.sites and len(rep.near_misses) == 1, rep.line()
    miss = rep.near_misses[0]
    assert (miss.op, miss.shape, miss.followed_by[:2]) == ("dot_general", (T, H), ("tanh", "add"))
    assert miss.reason == "the all-reduce is not followed by a residual add", miss
    assert "near misses: dot_general [8, 64] at top level, then tanh, add" in rep.line()
    assert rep.as_dict()["near_misses"][0]["reason"] == miss.reason
