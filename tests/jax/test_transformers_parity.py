"""The demo's Llama (jax_fusedar.models.llama), unfused and fused by jax_fusedar.fuse, against
Hugging Face transformers' LlamaForCausalLM (built in code, eager attention) with the same
weights: a model no one here wrote. float32, TP over 8 CPU devices: the two differ only in
float32 summation order, so the logits agree to a few float32 ulps of the accumulated
magnitudes: 2e-5 of max|logits| (measured: about 1e-6). Greedy tokens agree at every step."""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tests.jax import cpu_helpers  # noqa: E402
import jax_fusedar as jf  # noqa: E402
from jax_fusedar.models import llama  # noqa: E402

cpu_helpers.require_host_devices()

CFG = llama.TINY
SEED = 7
PROMPT, STEPS, BATCH = 12, 8, 2
REL_TOL = 2e-5


def hf_model(cfg, weights):
    conf = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    conf._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(conf).eval()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    sd = {"lm_head.weight": t(weights["lm_head"].T), "model.norm.weight": t(weights["final_norm"])}
    sd["model.embed_tokens.weight"] = t(weights["embed"])
    names = {f"w{p}": f"self_attn.{p}_proj" for p in "qkvo"}
    names.update({f"w_{p}": f"mlp.{p}_proj" for p in ("gate", "up", "down")})
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = t(weights["attn_norm"][i])
        sd[p + "post_attention_layernorm.weight"] = t(weights["mlp_norm"][i])
        for ours, theirs in names.items():
            sd[p + theirs + ".weight"] = t(weights[ours][i].T)  # torch: [out, in]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


@pytest.fixture(scope="module")
def setup():
    """transformers' logits of the prompt, its greedy tokens and their logits; the JAX side."""
    model = hf_model(CFG, llama.init_params_numpy(CFG, SEED))
    prompt = np.random.default_rng(SEED).integers(0, CFG.vocab, (BATCH, PROMPT))
    with torch.no_grad():
        ids = torch.from_numpy(prompt)
        first, toks, steps = model(ids).logits.numpy(), [], []
        for _ in range(STEPS):
            last = model(ids).logits[:, -1]
            nxt = last.argmax(-1)
            steps.append(last.numpy())
            toks.append(nxt.numpy())
            ids = torch.cat([ids, nxt[:, None]], 1)
    mesh = jax.make_mesh((8,), ("tp",))
    ref = dict(
        ref_prompt_logits=first, ref_tokens=np.stack(toks, 1), ref_step_logits=np.stack(steps)
    )
    params = llama.init_params(CFG, mesh, "tp", jnp.float32, SEED)
    return dict(ref, mesh=mesh, params=params, prompt=jnp.asarray(prompt, jnp.int32))


def rel_err(got, ref):
    return np.max(np.abs(np.asarray(got) - ref)) / np.max(np.abs(ref))


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_llama_matches_transformers_unfused_and_fused(setup, scan):
    mesh = setup["mesh"]
    params = llama.arrange(setup["params"], mesh, "tp", scan=scan)
    fwd = llama.make_forward(CFG, mesh, "tp", scan=scan)
    fused = jf.fuse(fwd, mesh=mesh, axis_name="tp", backend="xla")
    for name, prog in (("unfused", jax.jit(fwd)), ("fused", jax.jit(fused))):
        cache = llama.init_cache(CFG, mesh, "tp", jnp.float32, BATCH, PROMPT + STEPS)
        logits, _, _ = prog(params, setup["prompt"], *cache, jnp.int32(0))
        assert rel_err(logits, setup["ref_prompt_logits"]) <= REL_TOL, name
        toks, step_logits = llama.greedy_decode(prog, prog, params, setup["prompt"], *cache, STEPS)
        np.testing.assert_array_equal(toks, setup["ref_tokens"], err_msg=name)
        assert rel_err(step_logits, setup["ref_step_logits"]) <= REL_TOL, (name, "decode")
    rep = fused.report
    assert len(rep.fused) == len(rep.sites) == (2 if scan else 2 * CFG.layers), rep.line()
    assert rep.fused_runs() == 2 * CFG.layers
    assert {s.dtype for s in rep.sites} == {"float32"}
