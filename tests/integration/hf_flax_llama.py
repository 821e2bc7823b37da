"""``transformers``' ``FlaxLlamaForCausalLM`` (4.x, the last releases with Flax models), tiny,
random weights cast by its own ``to_bf16``, bfloat16 compute; partitioned as Flax models of
``transformers`` are: regular expressions over the parameter paths give each kernel
Megatron's PartitionSpec, and ``__call__`` runs under plain ``jax.jit``, where the
partitioner inserts the all-reduces."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from .lane import Built, LaneModel, place

LAYERS = 2
TP = "tp"
# (pattern over "/".join(path), spec): the first match wins; the rest is replicated.
PARTITION_RULES = [
    (r"self_attn/(q_proj|k_proj|v_proj)/kernel$", P(None, TP)),
    (r"self_attn/o_proj/kernel$", P(TP, None)),
    (r"mlp/(gate_proj|up_proj)/kernel$", P(None, TP)),
    (r"mlp/down_proj/kernel$", P(TP, None)),
]


def spec_of(path) -> P:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    for pattern, spec in PARTITION_RULES:
        if re.search(pattern, name):
            return spec
    return P()


def build(layers: int = LAYERS) -> Built:
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    model = FlaxLlamaForCausalLM(config, dtype=jnp.bfloat16, _do_init=False)
    params = model.to_bf16(model.init_weights(jax.random.PRNGKey(0), (2, 16)))
    mesh = jax.make_mesh((8,), (TP,), axis_types=(AxisType.Auto,))
    params = place(params, mesh, spec_of)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, config.vocab_size)

    def forward(params, ids):
        return model(ids, params=params, train=False).logits

    return Built(forward, params, (ids,), mesh, TP, layers=layers)


HOW = (
    "per layer, o_proj and down_proj (dot_general contracting the tp-sharded dim) each + "
    "residual add + the next FlaxLlamaRMSNorm (post_attention_layernorm, then the next "
    "layer's input_layernorm or the final norm)"
)

MODELS = [LaneModel("transformers FlaxLlamaForCausalLM", "transformers", 2, HOW, build)]
