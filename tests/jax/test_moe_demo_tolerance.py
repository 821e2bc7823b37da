"""The tolerance of ``demo --moe`` (jax_fusedar/cli/compare.py ``moe_tolerance``), on 8 virtual
CPU devices, where the MoE op runs its reference lowering with the kernel's rounding points:
the MoE layers' magnitudes measured on the unsharded model (``moe_llama.term_ratios``) are the
TP group's, the fused TP model of the one-process-per-rank demo stays within the tolerance of
the unsharded reference at 2, 4 and 8 ranks, and a model off by more than rounding does not."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedar as jf
from jax_fusedar.cli.compare import moe_kernel_roundings, moe_tolerance
from jax_fusedar.cli.shared_demo import reference_tolerance
from jax_fusedar.models import llama, moe_llama
from tests.jax.cpu_helpers import make_mesh, require_host_devices

require_host_devices()

# 6-10 s a test on 2 CPU cores: the full suite runs them, the quick lane does not.
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.slow]

CFG, AXIS, DTYPE = moe_llama.TINY, "tp", jnp.bfloat16


def _prompt(seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.base.vocab, (2, 8)), jnp.int32)


def _cache(mesh, prompt):
    return llama.init_cache(CFG.base, mesh, AXIS, DTYPE, *prompt.shape)


def _reference(seed, prompt):
    """Logits of the plain model unsharded on one device, and its layers' magnitude ratios
    counted for a TP group of ``tp`` ranks (a function of tp)."""
    mesh1 = make_mesh((1,), (AXIS,))
    params = moe_llama.init_params(CFG, mesh1, AXIS, DTYPE, seed)
    fwd = moe_llama.make_forward(CFG, mesh1, AXIS, mlp=moe_llama.plain_moe_mlp(CFG))
    logits = np.asarray(jax.jit(fwd)(params, prompt, *_cache(mesh1, prompt), jnp.int32(0))[0])
    ratios = lambda tp, cache: moe_llama.term_ratios(
        CFG, mesh1, AXIS, params, prompt, *cache, tp=tp
    )
    return logits, lambda tp: ratios(tp, _cache(mesh1, prompt))


def _fused_error(tp, seed, prompt, ref, *, drop_shared=False):
    """max |logits - ref| / max |ref| of the demo's fused TP model (MoE finalize op, attention
    fused by fuse) on ``tp`` devices; ``drop_shared``: a wrong model, without the shared expert."""
    mesh = make_mesh((tp,), (AXIS,))
    params = moe_llama.init_params(CFG, mesh, AXIS, DTYPE, seed, vocab_parallel=False)
    if drop_shared:
        params["layers"]["shared_down"] = jnp.zeros_like(params["layers"]["shared_down"])
    kw = dict(max_token_num=prompt.size, hidden_dim=CFG.base.hidden, dtype=DTYPE)
    ws = jf.create_allreduce_fusion_workspace(mesh, AXIS, **kw)
    mlp = moe_llama.fused_moe_mlp(CFG, ws)
    fwd = moe_llama.make_forward(CFG, mesh, AXIS, mlp=mlp, vocab_parallel=False)
    out = jax.jit(jf.fuse(fwd, workspace=ws))(params, prompt, *_cache(mesh, prompt), jnp.int32(0))
    return np.max(np.abs(np.asarray(out[0]) - ref)) / np.max(np.abs(ref))


def test_the_kernel_roundings_and_the_formula():
    # top-8 of the GPU preset over 2 ranks: 8 products and 8 additions, 2 shared-expert
    # additions, 1 all-reduce addition.
    assert moe_kernel_roundings(8, 2) == 19
    eps, ratios = 2.0**-7, [0.5, 0.25]
    want = eps + 2 * (eps + math.sqrt(2) * eps / 2)
    want += sum(eps + math.sqrt(20) * eps / 2 * m for m in ratios)
    got = moe_tolerance("bfloat16", ratios, 20, dense_sites=2, world=2)
    assert got == pytest.approx(want, rel=1e-12)
    # A block whose terms are as large as the stream (m = 1), rounded as often as a psum of
    # 2 partial sums, is a site of the dense formula.
    dense = reference_tolerance("bfloat16", 2, 3)
    assert moe_tolerance("bfloat16", [1.0] * 3, 2) == pytest.approx(dense, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_unsharded_models_ratios_are_the_tp_groups(tp):
    """Counted on one device for tp ranks, the ratios are those the TP group measures (each
    rank's local experts and shared-expert columns, summed over the ranks)."""
    prompt = _prompt(3)
    _, ratios_for = _reference(3, prompt)
    mesh = make_mesh((tp,), (AXIS,))
    params = moe_llama.init_params(CFG, mesh, AXIS, DTYPE, 3)
    on_mesh = moe_llama.term_ratios(CFG, mesh, AXIS, params, prompt, *_cache(mesh, prompt), tp=tp)
    one = ratios_for(tp)
    assert len(one) == len(on_mesh) == CFG.base.layers
    np.testing.assert_allclose(sorted(one), sorted(on_mesh), rtol=2e-2)
    assert all(0.05 < m < 5 for m in one), one
    # Split over more ranks, the shared expert's partial sums can only add magnitude.
    assert sum(ratios_for(8)) >= sum(ratios_for(1)) * (1 - 1e-3)


@pytest.mark.parametrize("tp, seed", [(2, 0), (4, 1), (8, 2)])
def test_the_fused_tp_model_is_within_the_moe_tolerance(tp, seed):
    prompt = _prompt(seed)
    ref, ratios_for = _reference(seed, prompt)
    roundings = moe_kernel_roundings(CFG.top_k, tp) + 1
    tol = moe_tolerance(
        "bfloat16", ratios_for(tp), roundings, dense_sites=CFG.base.layers, world=tp
    )
    # The magnitudes tighten it below the count of every rounding site at full scale, the
    # MoE demo's former tolerance (11 sites a layer at top-8 on GPUs, top_k + 3 here).
    assert tol < reference_tolerance("bfloat16", tp, CFG.base.layers * (CFG.top_k + 3)) / 2
    rel = _fused_error(tp, seed, prompt, ref)
    assert rel <= tol, (rel, tol)
    # A model that differs by more than rounding (no shared expert) is outside it.
    wrong = _fused_error(tp, seed, prompt, ref, drop_shared=True)
    assert wrong > tol, (wrong, tol)
