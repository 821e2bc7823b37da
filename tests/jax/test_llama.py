"""The demo's Llama (jax_fusedar.models.llama) on 8 virtual CPU devices: configuration checks,
on-device weight init (the GPU demo's path), unrolled == scanned layers. Its logits against
Hugging Face's LlamaForCausalLM: tests/jax/test_transformers_parity.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.jax import cpu_helpers
from jax_fusedar.models import llama

cpu_helpers.require_host_devices()
MESH = jax.make_mesh((8,), ("tp",))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kv_heads": 4}, "kv_heads 4 does not split over 8 tensor-parallel ranks"),
        ({"heads": 32, "kv_heads": 12}, "heads 32 is not a multiple of kv_heads 12"),
        ({"hidden": 250}, "hidden 250 is not a multiple of heads 16"),
        ({"vocab": 500}, "vocab 500 does not split over 8 tensor-parallel ranks"),
    ],
)
def test_config_that_does_not_split_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(llama.TINY, **change).check(8)


def test_llama3_8b_shapes():
    c = llama.LLAMA3_8B
    shapes = (c.layers, c.hidden, c.ffn, c.heads, c.kv_heads, c.head_dim)
    assert shapes == (32, 4096, 14336, 32, 8, 128)
    c.check(2)


@pytest.mark.slow
def test_on_device_init_matches_the_host_init_in_shape_and_scale():
    dev = llama.init_params(llama.TINY, MESH, "tp", jnp.bfloat16, 3, host=False)
    host = llama.init_params(llama.TINY, MESH, "tp", jnp.bfloat16, 3, host=True)
    specs = llama.param_specs("tp")
    flat = lambda t, **kw: dict(jax.tree_util.tree_flatten_with_path(t, **kw)[0])  # noqa: E731
    d, h = flat(dev), flat(host)
    s = flat(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert set(d) == set(h) == set(s) and len(d) == 9
    for k in d:
        assert d[k].shape == h[k].shape and d[k].dtype == jnp.bfloat16
        assert d[k].sharding.spec == s[k], k
        a, b = np.asarray(d[k], np.float32), np.asarray(h[k], np.float32)
        assert np.std(a) == pytest.approx(np.std(b), rel=0.25), k  # 512 values at least
        assert not np.array_equal(a, b)


def test_packed_projections_give_each_rank_its_own_q_k_v_and_gate_up():
    """pack_columns: split over tp ranks by columns, rank r's block is [q_r | k_r | v_r]."""
    cfg, tp = llama.TINY, 8
    w = llama.init_params_numpy(cfg, 11)
    tree = llama.from_hf_layout(w, tp)
    qkv, gu = tree["layers"]["wqkv"], tree["layers"]["w_gate_up"]
    nq, nkv, nf = cfg.heads * cfg.head_dim // tp, cfg.kv_heads * cfg.head_dim // tp, cfg.ffn // tp
    cols = {"wq": nq, "wk": nkv, "wv": nkv, "w_gate": nf, "w_up": nf}

    def packed(*names):  # rank after rank, that rank's columns of each of ``names``
        return np.concatenate(
            [w[n][..., r * cols[n] : (r + 1) * cols[n]] for r in range(tp) for n in names], -1
        )

    np.testing.assert_array_equal(qkv, packed("wq", "wk", "wv"))
    np.testing.assert_array_equal(gu, packed("w_gate", "w_up"))


@pytest.mark.slow
def test_unrolled_and_scanned_layers_agree():
    """Scanned (stacked weights), unrolled on stacked weights and unrolled on per-layer
    weights (llama.arrange): one model."""
    cfg = llama.TINY
    params = llama.init_params(cfg, MESH, "tp", jnp.float32, 5)
    per_layer = llama.arrange(params, MESH, "tp", scan=False)
    assert isinstance(per_layer["layers"], list) and len(per_layer["layers"]) == cfg.layers
    assert per_layer["layers"][1]["wqkv"].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert llama.arrange(params, MESH, "tp", scan=True) is params
    with pytest.raises(ValueError, match="stacked"):
        llama.arrange(per_layer, MESH, "tp", scan=True)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab, (2, 6)), jnp.int32)
    out, runs = {}, [("scan", True, params), ("unrolled", False, params)]
    for name, scan, p in runs + [("unrolled per layer", False, per_layer)]:
        fwd = jax.jit(llama.make_forward(cfg, MESH, "tp", scan=scan))
        cache = llama.init_cache(cfg, MESH, "tp", jnp.float32, 2, 8)
        logits, ck, cv = fwd(p, tokens, *cache, jnp.int32(0))
        out[name] = (np.asarray(logits), np.asarray(ck))
        assert np.any(out[name][1][:, :, :6] != 0) and np.all(out[name][1][:, :, 6:] == 0)
    for name in ("unrolled", "unrolled per layer"):
        np.testing.assert_allclose(out[name][0], out["scan"][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[name][1], out["scan"][1], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out["unrolled"][0], out["unrolled per layer"][0])
