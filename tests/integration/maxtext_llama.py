"""MaxText's Llama decoder (``decoder_block: llama2``) as MaxText runs it: its ``pyconfig``
(``llama2-7b.yml``, made tiny by overrides), its mesh (``ici_tensor_parallelism=8``), its
Linen entry point, the parameters placed by its logical axis rules, plain ``jax.jit`` under
``jax.set_mesh`` + ``axis_rules``. Its defaults stay (``remat_policy: full``, its constraints
and checkpoint names, bfloat16 activations, float32 weights); ``scan_layers`` either way."""

from __future__ import annotations

import contextlib
import pathlib
from functools import partial
import sys

import jax
import jax.numpy as jnp

from .lane import Built, LaneModel, perturb_norm_weights

LAYERS = 2


def build(scan_layers: bool, layers: int = LAYERS) -> Built:
    from flax import linen as nn
    from flax.linen import partitioning as nn_partitioning
    from jax.sharding import Mesh

    import maxtext
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.configs import pyconfig
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    cfg = pyconfig.initialize(
        [sys.argv[0], str(base)],
        run_name="integration_lane",
        enable_checkpointing=False,
        hardware="cpu",
        skip_jax_distributed_system=True,
        model_name="llama2-7b",
        override_model_config=True,
        base_num_decoder_layers=layers,
        base_emb_dim=256,
        base_num_query_heads=8,
        base_num_kv_heads=8,
        head_dim=32,
        base_mlp_dim=512,
        vocab_size=512,
        max_target_length=16,
        max_prefill_predict_length=4,
        per_device_batch_size=0.25,  # a global batch of 2 over the 8 devices
        attention="dot_product",
        ici_tensor_parallelism=8,
        ici_fsdp_parallelism=1,
        scan_layers=scan_layers,
        enable_dropout=False,
    )
    mesh = Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
    model = models.transformer_as_linen(
        config=cfg, mesh=mesh, quant=None, model_mode=MODEL_MODE_TRAIN
    )
    shape = (cfg.global_batch_size_to_train_on, cfg.max_target_length)
    rng = jax.random.PRNGKey(0)
    ids = jax.random.randint(rng, shape, 0, cfg.vocab_size)
    segments = jnp.ones(shape, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(nn_partitioning.axis_rules(cfg.logical_axis_rules))
        return stack

    def init():
        return model.init(
            {"params": rng, "aqt": rng, "dropout": rng},
            ids,
            positions,
            segments,
            enable_dropout=False,
        )

    with context():
        # The parameters where MaxText's logical axis rules put them.
        specs = nn.get_partition_spec(jax.eval_shape(init))
        shardings = nn.logical_to_mesh_sharding(specs, mesh, cfg.logical_axis_rules)
        params = perturb_norm_weights(jax.jit(init, out_shardings=shardings)())

    def forward(params, ids, positions, segments):
        return model.apply(
            params,
            ids,
            positions,
            segments,
            enable_dropout=False,
            model_mode=MODEL_MODE_TRAIN,
            rngs={"aqt": rng},
        )

    return Built(forward, params, (ids, positions, segments), mesh, "tensor", context, layers)


HOW = (
    "per layer, the attention's out-projection and the MLP's down-projection (dot_general "
    "contracting the tensor-sharded dim, the partitioner's all-reduce) each + residual add + "
    "the next RMSNorm (post-attention, then the next layer's pre-attention or the final norm)"
)

MODELS = [
    LaneModel("maxtext llama2 scan_layers=true", "maxtext", 2, HOW, partial(build, True)),
    LaneModel("maxtext llama2 scan_layers=false", "maxtext", 2, HOW, partial(build, False)),
]
