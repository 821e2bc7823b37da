"""jax_fusedar.fuse across layer boundaries, on 8 virtual CPU devices: a pre-norm decoder
scanned over its layers has the add of layer i and the norm of layer i + 1 in two
iterations; the loop is rotated (fusion/rotation.py) so that each add and the next norm are
one site, the last one with the final norm after the loop. Forward and ``jax.grad`` equal the
original bit for bit on the xla backend; a site inside a ``jax.checkpoint`` keeps the
checkpoint: the fused program saves for the backward pass what the original saves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import PartitionSpec as P

from tests.jax import cpu_helpers
from tests.jax.fuse_checks import assert_bit_equal, compiled, rms_norm
from tests.models import annotated_llama, scanned_llama
from tests.models.common import Config, activations
import jax_fusedar as jf
from jax_fusedar.fusion.chain import GAMMA_AFTER_USE

cpu_helpers.require_host_devices()

CFG = Config(layers=3)


def setup(module, **kw):
    mesh = cpu_helpers.mesh_2x4()
    params = module.place(module.init_params(CFG, 0, jnp.bfloat16), mesh)
    x = jax.device_put(activations(CFG, 1, jnp.bfloat16), module.input_sharding(mesh))
    return mesh, params, x, module.make_forward(CFG, mesh, **kw)


def loss(fn):
    ct = np.random.default_rng(3).standard_normal((CFG.batch, CFG.seq, CFG.hidden))
    return lambda p, x: jnp.sum(fn(p, x).astype(jnp.float32) * ct)


def fused_and_checked(module, **kw):
    """The fused function, after checking forward and gradients bit for bit."""
    mesh, params, x, fwd = setup(module, **kw)
    fused = jf.fuse(fwd, mesh=mesh, axis_name="tp", backend="xla")
    with jax.set_mesh(mesh):
        assert_bit_equal(compiled(fused)(params, x), compiled(fwd)(params, x))
        g_f = compiled(jax.grad(loss(fused), argnums=(0, 1)))(params, x)
        g_o = compiled(jax.grad(loss(fwd), argnums=(0, 1)))(params, x)
        assert_bit_equal(g_f, g_o)
    return fused, (mesh, params, x, fwd)


def saved_beyond(capsys, mesh, fused, fwd, params, x):
    """The types of the values jax.grad of the fused program saves for the backward pass
    beyond what the original saves, after checking that it saves all the original does."""

    def saved_types(fn):
        capsys.readouterr()
        print_saved_residuals(jax.jit(fn), params, x)
        return sorted(line.split()[0] for line in capsys.readouterr().out.splitlines())

    with jax.set_mesh(mesh):
        got, want = saved_types(fused), saved_types(fwd)
    extra = list(got)
    for t in want:
        assert t in extra, (t, got, want)
        extra.remove(t)
    return extra


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("layout", ["plain_jit", "shard_map"])
def test_the_scanned_decoder_is_rotated_and_every_add_fused(layout, remat, capsys):
    """Checkpointed (MaxText's nn.scan(nn.remat)), the rotated iteration keeps the original's
    derivative, so it saves what the original saves (plus the next layer's gamma slice)."""
    fused, (mesh, params, x, fwd) = fused_and_checked(scanned_llama, layout=layout, remat=remat)
    rep = fused.report
    assert len(rep.fused) == 2 == len(rep.sites), rep.line()
    # Each layer's two adds, the last with the final norm: 2 * layers fused calls per run.
    assert rep.fused_runs() == 2 * CFG.layers, rep.line()
    rotated = [s for s in rep.fused if s.note and "across scan iterations" in s.note]
    assert len(rotated) == 1 and "the final norm after the loop" in rotated[0].note
    if remat:
        extra = saved_beyond(capsys, mesh, fused, fwd, params, x)
        # The shifted gamma stack: [layers, hidden] (under shard_map, one per device: a
        # residual of the shard_map is laid out over all of them, [devices * layers, hidden]).
        stacks = (f"bf16[{CFG.layers},{CFG.hidden}]", f"bf16[{8 * CFG.layers},{CFG.hidden}]")
        assert extra == [] or (len(extra) == 1 and extra[0] in stacks), extra
    elif layout == "shard_map":
        # The first layer's norm is peeled before the loop; inside it every residual add is
        # the fused op's (no psum left in the plain-math form: the plain-jit entry's own).
        with jax.set_mesh(mesh):
            text = str(jax.make_jaxpr(fused)(params, x))
        body = text[text.index("scan[") :]
        assert body.count("jax_fusedar_allreduce_fusion") == 2, body
        assert "psum" not in body.split("jax_fusedar_allreduce_fusion")[0].split("scan[")[-1]


def test_without_a_final_norm_the_last_add_has_no_site():
    fused, _ = fused_and_checked(scanned_llama, final_norm=False)
    rep = fused.report
    assert rep.fused_runs() == 2 * CFG.layers - 1, rep.line()
    (rotated,) = [s for s in rep.fused if s.note and "across scan iterations" in s.note]
    assert rotated.runs == CFG.layers - 1 and "its fused norm is unused" in rotated.note


def test_checkpointed_layers_one_after_another_save_and_recompute_as_written(capsys):
    """Checkpointed layers in a loop (scan_layers=False): each call's add and the next norm are
    one site (fusion/chain.py); the rewritten calls (custom_jvp's) keep the original's
    derivatives and save what it saves, plus the final norm's gamma their last call reads."""
    fused, (mesh, params, x, fwd) = fused_and_checked(annotated_llama, remat=True)
    rep = fused.report
    assert len(rep.fused) == len(rep.sites) == 2 * CFG.layers, rep.line()
    across = [s for s in rep.fused if s.note and "across checkpoint calls" in s.note]
    assert len(across) == CFG.layers, rep.sites
    extra = saved_beyond(capsys, mesh, fused, fwd, params, x)
    assert extra in ([], [f"bf16[{CFG.hidden}]"]), extra
    with jax.set_mesh(mesh):
        dx, dp = jnp.ones_like(x), jax.tree.map(jnp.zeros_like, params)
        tangent = lambda fn: compiled(lambda p, x: jax.jvp(fn, (p, x), (dp, dx)))(params, x)
        assert_bit_equal(tangent(fused), tangent(fwd))
    assert fused.report.fused


@pytest.mark.parametrize("saving", [False, True], ids=["default_policy", "saving_policy"])
def test_checkpoints_with_a_saving_policy_are_not_crossed(saving):
    """The add closing a checkpointed call and the next norm are one site, unless the policy
    saves named values (the moved norm would change what it saves)."""
    mesh, params, x, _ = setup(annotated_llama, remat=False)

    def layer(p, v):
        return v + jnp.tanh(rms_norm(v, p["attn_norm"], CFG.eps) @ p["wv"]) @ p["wo"]

    policy = jax.checkpoint_policies.save_only_these_names("x") if saving else None
    step = jax.checkpoint(layer, policy=policy)

    def fwd(params, v):
        for p in params["layers"]:
            v = step(p, v)
        return rms_norm(v, params["final_norm"], CFG.eps)

    fused = jf.fuse(fwd, mesh=mesh, axis_name="tp", backend="xla")
    with jax.set_mesh(mesh):
        assert_bit_equal(compiled(fused)(params, x), compiled(fwd)(params, x))
    rep = fused.report
    if saving:
        assert not rep.fused, rep.line()
    else:
        assert len(rep.fused) == CFG.layers, rep.line()
        assert all("across checkpoint calls" in s.note for s in rep.fused), rep.sites


def test_a_call_whose_next_gamma_reads_its_outputs_says_why_it_is_not_joined():
    """A next gamma computed from the previous call's outputs: that call cannot compute the
    next norm, and its site says so; the last call (final gamma at hand) is joined."""
    mesh, layers, hidden = cpu_helpers.tp_mesh(), 3, 64
    rng = np.random.default_rng(5)
    ws = jnp.asarray(rng.standard_normal((layers, 8, hidden, hidden)) / 8, jnp.bfloat16)
    v0 = jnp.asarray(rng.standard_normal((16, hidden)), jnp.bfloat16)
    gs = jnp.asarray(1 + rng.standard_normal((layers, hidden)) / 4, jnp.bfloat16)
    g_final = jnp.asarray(1 + rng.standard_normal(hidden) / 4, jnp.bfloat16)

    def layer(v, w, g):
        v = v + jax.lax.psum(jnp.tanh(rms_norm(v, g) @ w), "tp")
        return v, jnp.max(v)

    step = jax.checkpoint(layer)

    def body(ws, v, gs, g_final):
        top = jnp.zeros((), v.dtype)
        for n in range(layers):
            v, top = step(v, ws[n, 0], gs[n] + 0 * top)  # gamma reads the last call's max
        return rms_norm(v, g_final)

    fwd = jax.shard_map(
        body, mesh=mesh, in_specs=(P(None, "tp"), P(), P(), P()), out_specs=P(), check_vma=False
    )
    fused = jf.fuse(fwd, mesh=mesh, axis_name="tp", backend="xla")
    args = (ws, v0, gs, g_final)
    assert_bit_equal(compiled(fused)(*args), compiled(fwd)(*args))
    rep = fused.report
    assert len(rep.fused) == 1 and "across checkpoint calls" in rep.fused[0].note, rep.line()
    assert [s.reason for s in rep.not_fused] == [GAMMA_AFTER_USE] * (layers - 1), rep.line()
