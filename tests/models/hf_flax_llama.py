"""Llama with Hugging Face Flax's RMSNorm (``FlaxLlamaRMSNorm``): gamma multiplied after the
cast to the module's dtype. Tensor-parallel in one ``shard_map`` (psum after the o- and down
projections), the decoder layer written as Hugging Face writes it. ``weight_dtype``, the
norm weight's: the model's (loaded in bfloat16) or float32 (Flax's default param_dtype,
which makes the norm's output float32)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .common import Config, gamma, llama_layers, place_layers, self_attention
from .common import input_sharding  # noqa: F401 (each model's own, as styles.py uses it)

DP, TP = "dp", "tp"


@dataclasses.dataclass
class FlaxLlamaRMSNorm:
    epsilon: float
    dtype: object

    def __call__(self, hidden_states, weight):
        variance = jnp.asarray(hidden_states, dtype=jnp.float32)
        variance = jnp.power(variance, 2)
        variance = variance.mean(-1, keepdims=True)
        # use `jax.numpy.sqrt` as `jax.lax.rsqrt` does not match `torch.rsqrt`
        hidden_states = hidden_states / jnp.sqrt(variance + self.epsilon)
        return weight * jnp.asarray(hidden_states, dtype=self.dtype)


def init_params(cfg: Config, seed: int, dtype, weight_dtype=None):
    rng = np.random.default_rng(seed)
    names = "input_layernorm q_proj k_proj v_proj o_proj post_attention_layernorm gate_proj"
    layers = llama_layers(cfg, rng, dtype, [*names.split(), "up_proj", "down_proj"], weight_dtype)
    return dict(layers=layers, norm=gamma(rng, cfg.hidden, weight_dtype or dtype))


SPECS = {
    **dict.fromkeys(["input_layernorm", "post_attention_layernorm"], P()),
    **dict.fromkeys(["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"], P(None, TP)),
    **dict.fromkeys(["o_proj", "down_proj"], P(TP, None)),
}


def place(params, mesh):
    return place_layers(params, mesh, SPECS)


def make_forward(cfg: Config, mesh, dtype=jnp.bfloat16):
    norm = FlaxLlamaRMSNorm(cfg.eps, dtype)

    def self_attn(p, hidden):
        a = self_attention(hidden, p["q_proj"], p["k_proj"], p["v_proj"], cfg.head_dim)
        return jax.lax.psum(a @ p["o_proj"], TP)

    def mlp(p, hidden):
        act = jax.nn.silu(hidden @ p["gate_proj"]) * (hidden @ p["up_proj"])
        return jax.lax.psum(act @ p["down_proj"], TP)

    def decoder_layer(p, hidden_states):
        residual = hidden_states
        hidden_states = norm(hidden_states, p["input_layernorm"]).astype(dtype)
        hidden_states = self_attn(p, hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = norm(hidden_states, p["post_attention_layernorm"]).astype(dtype)
        hidden_states = mlp(p, hidden_states)
        return residual + hidden_states

    def body(params, x):
        for p in params["layers"]:
            x = decoder_layer(p, x)
        return norm(x, params["norm"])

    specs = dict(layers=[SPECS] * cfg.layers, norm=P())
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DP)), out_specs=P(DP))
