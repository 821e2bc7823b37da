"""GPU: jax_fusedar.fuse on the style models (tests/models/styles.py), the FlashInfer kernel
in place of every fused site, two ranks as two ``jax.distributed`` processes (sharing GPU 0
on a one-GPU machine). Per style: every site fused, one fused custom call per site in the
compiled HLO, and the fused model as accurate as the same model unfused on one device
against its float32 run (tests/gpu/fuse_styles.py). The styles whose fused program keeps
XLA collectives (sequence parallelism gathers the residual shard) run only with a GPU per
rank and are reported as skipped otherwise."""

import pytest

from tests.gpu.harness import report

pytestmark = pytest.mark.gpu

STYLES = [
    "per_linear_llama",
    "sequence_parallel_llama",
    "sequence_parallel_llama_norm_after_gather",
    "megatron_mlp",
    "plain_jit_llama_auto",
    "plain_jit_llama_explicit",
    "gemma_pre_norm",
    "hf_flax_llama",
    "hf_flax_llama_f32_weights",
    "hf_flax_llama_float32",
    "annotated_llama",
    "annotated_llama_per_token",
    "annotated_llama_gamma_einsum",
    "annotated_llama_bias_allow",
    "scanned_llama_plain_jit",
    "scanned_llama_shard_map",
]
# Llama-like sizes a kernel call sees in decode-to-prefill ranges, small enough for a minute.
CONFIG = dict(batch=2, seq=64, hidden=1024, heads=8, head_dim=128, ffn=2048, layers=2)


def test_style_models_fused_on_gpus():
    from tests.gpu import fuse_styles
    from tests.gpu.harness import random_seed, run_ranks_with_port

    res = run_ranks_with_port(
        fuse_styles.worker,
        2,
        timeout_s=1500,
        seed=random_seed(1 << 30),
        styles=STYLES,
        config=CONFIG,
    )
    report("gpu_fuse_styles", res)
    problems = fuse_styles.check(res, STYLES)
    assert not problems, "\n".join(problems)
