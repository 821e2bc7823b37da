"""GPU: jax_fusedar.fuse on the style models (tests/models/styles.py), the kernel in place of
every fused site, each as accurate as the same model unfused (tests/gpu/fuse_styles.py)."""

import pytest

from tests.gpu import fuse_styles
from tests.gpu.harness import random_seed, report, run_ranks_with_port

pytestmark = pytest.mark.gpu

STYLES = """
per_linear_llama sequence_parallel_llama sequence_parallel_llama_norm_after_gather megatron_mlp
plain_jit_llama_auto plain_jit_llama_explicit gemma_pre_norm hf_flax_llama
hf_flax_llama_f32_weights hf_flax_llama_float32 annotated_llama annotated_llama_per_token
annotated_llama_gamma_einsum annotated_llama_bias_allow scanned_llama_plain_jit
scanned_llama_shard_map
""".split()
# Llama-like sizes a kernel call sees in decode-to-prefill ranges, small enough for a minute.
CONFIG = dict(batch=2, seq=64, hidden=1024, heads=8, head_dim=128, ffn=2048, layers=2)


def test_style_models_fused_on_gpus():
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
