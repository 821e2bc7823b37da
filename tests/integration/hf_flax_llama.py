"""The Flax Llama of Hugging Face ``transformers`` (4.x, the last releases that ship Flax
models: ``FlaxLlamaForCausalLM``), tiny config, random weights cast with its own
``to_bf16``, bfloat16 compute. Tensor-parallel the way Flax models of ``transformers`` are
partitioned: regular expressions over the parameter paths give each kernel a
PartitionSpec (Megatron's: q/k/v, gate and up split over the heads / the FFN, o and down
over their inputs), the parameters are placed by them and the model's ``__call__`` runs
under plain ``jax.jit``, where the partitioner inserts the all-reduces."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .lane import Built, LaneModel, perturb_norm_weights

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
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, NamedSharding(mesh, spec_of(path))), params
    )
    params = perturb_norm_weights(params)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, config.vocab_size)

    def forward(params, ids):
        return model(ids, params=params, train=False).logits

    return Built(forward, params, (ids,), mesh, TP, lambda: jax.set_mesh(mesh), layers)


HOW = (
    "per layer, o_proj and down_proj (dot_general contracting the tp-sharded dim) each + "
    "residual add + the next FlaxLlamaRMSNorm (post_attention_layernorm, then the next "
    "layer's input_layernorm or the final norm)"
)

MODELS = [LaneModel("transformers FlaxLlamaForCausalLM", "transformers", 2, HOW, build)]
