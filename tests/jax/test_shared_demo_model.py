"""What the demo's one-process-per-rank mode (jax_fusedar/cli/shared_demo.py) relies on in the
model, on 8 CPU devices: a replicated LM head gives the vocabulary-parallel one's logits; device
draws are the same values for any mesh, and ``repack_columns`` reads them as the same model for
another TP size (what makes the unsharded reference the same model on GPUs); the fused TP model
stays within ``reference_tolerance`` of that reference at 2, 4 and 8 ranks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fusedar as jf
from jax_fusedar.cli.shared_demo import reference_tolerance
from jax_fusedar.models import llama
from tests.jax.cpu_helpers import make_mesh, require_host_devices

require_host_devices()

# 4-5 s a test on 2 CPU cores: the full suite runs them, the quick lane does not.
pytestmark = [pytest.mark.usefixtures("hermetic"), pytest.mark.slow]

CFG, AXIS = llama.TINY, "tp"


def _logits(mesh, params, prompt, *, vocab_parallel=True, fused=False):
    fwd = llama.make_forward(CFG, mesh, AXIS, scan=True, vocab_parallel=vocab_parallel)
    if fused:
        kw = dict(max_token_num=prompt.size, hidden_dim=CFG.hidden, dtype=jnp.bfloat16)
        fwd = jf.fuse(fwd, workspace=jf.create_allreduce_fusion_workspace(mesh, AXIS, **kw))
    cache = llama.init_cache(CFG, mesh, AXIS, jnp.bfloat16, *prompt.shape)
    return np.asarray(jax.jit(fwd)(params, prompt, *cache, jnp.int32(0))[0])


def _prompt(seed=1):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab, (2, 8)), jnp.int32)


def test_a_replicated_lm_head_gives_the_same_logits():
    mesh = make_mesh((4,), (AXIS,))
    split = llama.init_params(CFG, mesh, AXIS, jnp.bfloat16, 0)
    whole = llama.init_params(CFG, mesh, AXIS, jnp.bfloat16, 0, vocab_parallel=False)
    assert whole["lm_head"].sharding.spec == jax.sharding.PartitionSpec()
    b = _logits(mesh, whole, _prompt(), vocab_parallel=False)
    np.testing.assert_array_equal(_logits(mesh, split, _prompt()), b)


def test_device_draws_do_not_depend_on_the_mesh():
    four = llama.init_params(CFG, make_mesh((4,), (AXIS,)), AXIS, jnp.bfloat16, 3, host=False)
    one = llama.init_params(CFG, make_mesh((1,), (AXIS,)), AXIS, jnp.bfloat16, 3, host=False)
    for a, b in zip(jax.tree.leaves(four), jax.tree.leaves(one)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("tp", [4, 8])
def test_repacked_columns_are_the_same_model(tp):
    """Weights drawn packed for ``tp`` ranks, repacked for one: the unsharded model's logits
    equal the TP model's within rounding (and the packing round-trips exactly)."""
    mesh = make_mesh((tp,), (AXIS,))
    drawn = llama.init_params(CFG, mesh, AXIS, jnp.bfloat16, 5, host=False)
    host = jax.tree.map(np.asarray, drawn)
    one = llama.repack_columns(host, CFG, tp, 1)
    back = llama.repack_columns(one, CFG, 1, tp)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(one["layers"]["wqkv"], host["layers"]["wqkv"])
    mesh1 = make_mesh((1,), (AXIS,))
    ref = _logits(mesh1, jax.tree.map(jnp.asarray, one), _prompt())
    tp_logits = _logits(mesh, drawn, _prompt())
    # Unfused at both sizes: only the partial sums' roundings differ (2 layers, 4 sites).
    rel = np.max(np.abs(ref - tp_logits)) / np.max(np.abs(ref))
    assert rel <= reference_tolerance("bfloat16", tp, 4), rel
    # Read without repacking, the draw is another model.
    wrong = _logits(mesh1, jax.tree.map(jnp.asarray, host), _prompt())
    assert np.max(np.abs(wrong - tp_logits)) / np.max(np.abs(ref)) > 0.1


@pytest.mark.parametrize("tp, seed", [(2, 0), (4, 1), (8, 2)])
def test_fused_tp_model_within_the_reference_tolerance(tp, seed):
    mesh, mesh1 = make_mesh((tp,), (AXIS,)), make_mesh((1,), (AXIS,))
    params = llama.init_params(CFG, mesh, AXIS, jnp.bfloat16, seed, vocab_parallel=False)
    ref_params = llama.init_params(CFG, mesh1, AXIS, jnp.bfloat16, seed)
    fused = _logits(mesh, params, _prompt(seed), vocab_parallel=False, fused=True)
    ref = _logits(mesh1, ref_params, _prompt(seed))
    rel = np.max(np.abs(ref - fused)) / np.max(np.abs(ref))
    assert rel <= reference_tolerance("bfloat16", tp, 4), rel
