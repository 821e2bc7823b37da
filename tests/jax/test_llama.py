"""The demo's Llama (jax_fusedar.models.llama) on 8 virtual CPU devices: configuration checks,
on-device weight init (the GPU demo's path), unrolled == scanned layers.

Its logits against Hugging Face's LlamaForCausalLM: tests/jax/test_transformers_parity.py.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.jax import cpu_helpers  # noqa: E402
from jax_fusedar.models import llama  # noqa: E402

cpu_helpers.require_host_devices()
MESH = jax.make_mesh((8,), ("tp",))


@pytest.mark.parametrize("change, message", [
    ({"kv_heads": 4}, "kv_heads 4 does not split over 8 tensor-parallel ranks"),
    ({"heads": 32, "kv_heads": 12}, "heads 32 is not a multiple of kv_heads 12"),
    ({"hidden": 250}, "hidden 250 is not a multiple of heads 16"),
    ({"vocab": 500}, "vocab 500 does not split over 8 tensor-parallel ranks"),
])
def test_config_that_does_not_split_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(llama.TINY, **change).check(8)


def test_llama3_8b_shapes():
    cfg = llama.LLAMA3_8B
    assert (cfg.layers, cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.head_dim) == \
        (32, 4096, 14336, 32, 8, 128)
    cfg.check(2)


def test_on_device_init_matches_the_host_init_in_shape_and_scale():
    dev = llama.init_params(llama.TINY, MESH, "tp", jnp.bfloat16, 3, host=False)
    host = llama.init_params(llama.TINY, MESH, "tp", jnp.bfloat16, 3, host=True)
    specs = llama.param_specs("tp")
    assert set(dev) == set(host) == set(specs)
    for k in dev:
        assert dev[k].shape == host[k].shape and dev[k].dtype == jnp.bfloat16
        assert dev[k].sharding.spec == specs[k]
        a, b = np.asarray(dev[k], np.float32), np.asarray(host[k], np.float32)
        assert np.std(a) == pytest.approx(np.std(b), rel=0.25), k  # 512 values at least
        assert not np.array_equal(a, b)


def test_unrolled_and_scanned_layers_agree():
    cfg = llama.TINY
    params = llama.init_params(cfg, MESH, "tp", jnp.float32, 5)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab, (2, 6)), jnp.int32)
    out = {}
    for scan in (False, True):
        fwd = jax.jit(llama.make_forward(cfg, MESH, "tp", scan=scan))
        cache = llama.init_cache(cfg, MESH, "tp", jnp.float32, 2, 8)
        logits, ck, cv = fwd(params, tokens, *cache, jnp.int32(0))
        out[scan] = (np.asarray(logits), np.asarray(ck))
        assert np.any(out[scan][1][:, :, :6] != 0) and np.all(out[scan][1][:, :, 6:] == 0)
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[True][1], out[False][1], rtol=1e-6, atol=1e-6)
