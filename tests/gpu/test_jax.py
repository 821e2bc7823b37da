"""GPU: the XLA FFI custom call under jit + shard_map, one `jax.distributed` process per rank
(tests/gpu/workers/jax_multiprocess.py; 2, 4 or 8, rank r on GPU r % G), XLA's command
buffers forced on (min graph size 1) or off. Bounds: harness.bound_problems."""

import os

import pytest

from tests.gpu.harness import bound_problems, gpu_count, needs_gpus, random_seed, report
from tests.gpu.harness import run_ranks_with_port, sweep_params, world_params
from tests.gpu.workers import jax_multiprocess

pytestmark = pytest.mark.gpu

# XLA wraps the custom call in a dynamic-slice fusion when an operand is a slice (gamma[l]),
# so that command type is enabled too; min graph size 1 forces capture of short sequences.
CMDBUF_ON = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
    "DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"
)
CMDBUF_OFF = "--xla_gpu_enable_command_buffer="
CMDBUF = {"on": CMDBUF_ON, "off": CMDBUF_OFF}


def _run(name, task, xla_flags, world=2, **kw):
    """jax_multiprocess's ``task`` at ``world`` ranks, reported as ``name``."""
    res = run_ranks_with_port(
        jax_multiprocess.worker,
        world,
        timeout_s=900,
        xla_flags=xla_flags,
        task=task,
        seed=random_seed(),
        **kw,
    )
    report(name, res)
    return res


def parity_problems(res, world):
    """Every rank's worst errors against the bounds (harness.bound_problems)."""
    problems = []
    for r in res:
        for dtype, w in r["worst"].items():
            if dtype == "destroyed_workspace_error":
                continue
            if not w["cases"] > 0:
                problems.append(f"rank {r['rank']} {dtype}: no cases")
            problems += bound_problems(w, dtype, world, f"rank {r['rank']}")
    return problems


# Command buffers on and off at 2 ranks, each a quick and a full sweep; 4 and 8 ranks with
# command buffers on, the quick sweep (slow: ranks share the GPUs).
@pytest.mark.parametrize(
    "cmdbuf, world, sweep",
    [
        *sweep_params(before=("on", 2), id="cmdbuf_on-world2-{}"),
        *sweep_params(before=("off", 2), id="cmdbuf_off-world2-{}"),
        *world_params((), (4, 8), before=("on",), after=("quick",), id="cmdbuf_on-{}-quick"),
    ],
)
def test_jax_parity(cmdbuf, world, sweep):
    """Patterns 1 and 0, one- and two-shot, fp32_acc True and False, 3 dtypes."""
    quick = sweep == "quick"
    tokens = (1, 17, 129) if quick else (1, 16, 17, 128, 129, 1000)
    hiddens = (1024, 7168) if quick else (1024, 4096, 7168)
    name = f"jax_parity_{cmdbuf}_world{world}"
    res = _run(name, "parity", CMDBUF[cmdbuf], world, tokens=tokens, hiddens=hiddens)
    for r in res:
        assert "exists in this process" in r["worst"].pop("destroyed_workspace_error")
    problems = parity_problems(res, world)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", world_params())
def test_jax_ten_thousand_calls_in_a_loop(world):
    """Calls checked in-graph against the oracle; 1,000 where ranks share GPUs (their kernels
    take turns, about 3 ms a call on one H200: a longer loop catches no more races)."""
    own = gpu_count() >= world
    calls = int(os.environ.get("JAX_FUSEDAR_LOOP_CALLS", 10000 if world == 2 and own else 1000))
    res = _run(f"jax_loop_world{world}", "loop", CMDBUF_ON, world, calls=calls, m=16, hidden=4096)
    for r in res:
        assert r["loop"]["violations"] == 0, r


@pytest.mark.parametrize("cmdbuf", ["on", "off"], ids=["cmdbuf_on", "cmdbuf_off"])
def test_jax_64_layer_model(cmdbuf):
    """64 bf16 layers drift from exact arithmetic whatever the all-reduce: the fused model is
    held to the unfused one's accuracy; host launches show command-buffer replay."""
    res = _run(
        f"jax_model_{cmdbuf}", "model", CMDBUF[cmdbuf], layers=64, m=16, hidden=1024, ffn=2048
    )
    problems = []
    for r in res:
        m = r["model"]
        if not (m["finite"] and m["fused_vs_f64"] <= 1.25 * m["unfused_vs_f64"] + 1e-3):
            problems.append(f"rank {r['rank']}: fused model less accurate than unfused: {m}")
        runs = m["host_launches_per_run"]
        if cmdbuf == "off" and runs != [64] * len(runs):
            problems.append(f"rank {r['rank']}: expected 64 host launches per run, got {runs}")
        if cmdbuf == "on" and not all(n < 64 for n in runs):
            # Captured calls replay from the CUDA graph without running the handler.
            problems.append(
                f"rank {r['rank']}: the fused calls were not replayed from a "
                f"command buffer (host launches per run {runs})"
            )
    assert not problems, "\n".join(problems)


# Gradient bounds: per gradient tensor, the fused model's error against the float64 oracle
# (tests/gpu/workers/jax_grad.py; in ulps of the tensor's largest magnitude) may exceed the
# unfused model's by twice the forward norm bound (3 bf16 / 8 fp32 ulps). Why: the backward
# is the unfused model's own code (jax_fusedar/ops/transforms.py) run on the kernel's
# residual_out, which for 2 ranks is the reference's bit for bit; the two models differ
# only in the forward norm_out (the kernel's fast-math rsqrt, within those bounds), which
# reaches the gradients through the next layer's matmul and the loss, once per layer.
GRAD_SLACK_ULPS = {"bfloat16": 2 * 3.0, "float32": 2 * 8.0}


@needs_gpus(2, "the unfused twin's psum runs on NCCL, which refuses two ranks on one GPU")
def test_jax_gradients_of_the_fused_model():
    res = _run("jax_grad", "grad", CMDBUF_OFF, layers=2, tokens=16, hidden=1024, ffn=2048)
    problems = []
    for r in res:
        for dtype, s in r["grad"].items():
            if s["backend"] != "trtllm" or s["custom_calls"] < 2:
                problems.append(
                    f"rank {r['rank']} {dtype}: the kernel is not in the gradient "
                    f"program ({s['backend']}, {s['custom_calls']} custom calls)"
                )
            problems += [
                f"rank {r['rank']} {dtype} d{name}: {e}"
                for name, e in s["grads"].items()
                if not (
                    e["finite"]
                    and e["fused_ulps"] <= e["unfused_ulps"] + GRAD_SLACK_ULPS[dtype]
                    and e["fused_rel"] <= 1.25 * e["unfused_rel"] + 1e-3
                )
            ]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "world, sweep",
    [
        *sweep_params(before=(2,), id="world2-{}"),
        *world_params((), (4, 8), after=("quick",), id="{}-quick"),
    ],
)
def test_jax_quantized_fp8_patterns(world, sweep):
    quick = sweep == "quick"
    tokens = (1, 17, 128) if quick else (1, 16, 17, 128, 1024)
    hiddens = (1024,) if quick else (1024, 4096, 8192)
    res = _run(f"jax_quant_world{world}", "quant", CMDBUF_ON, world, tokens=tokens, hiddens=hiddens)
    for r in res:
        q = r["quant"]
        # Twins (pattern with / without norm_out) agree on every residual and scale; their
        # codes may differ by one step where a different launch geometry reorders the norm's
        # fp32 reduction (seen: 5 to 9 of 8.4 M codes at 1024 x 8192 two-shot, bf16).
        assert q["cases"] > 0 and q["twin_other_diffs"] == 0, q
        assert q["twin_code_steps1"] <= 1e-5 * q["elements"], q
        assert q["rerun_diffs"] == 0, q  # same program, same inputs: same bytes
        assert q["worse"] == 0, q  # never more than one e4m3 code from the oracle
        # One-code steps come from fast-math division near an e4m3 midpoint: rare.
        assert sum(q["steps1"].values()) <= 1e-3 * 3 * q["elements"], q
        assert q["dyn_scale_ulps"] <= 2.0 and q["group_scale_mismatch"] == 0, q
        assert q["dequant_violations"] == 0, q
        problems = bound_problems(q, "bfloat16", world, f"rank {r['rank']}")
        assert not problems, (problems, q)  # fp16 cases: the same measures, in fp16 ulps
        assert "need an sm100+ GPU" in q["nvfp4_refused"], q


def _compute_capability_major() -> int:
    from jax_fusedar.common import native

    try:
        return int(native.require().compute_capability(0)[0])
    except Exception:  # no native module or no GPU: the gpu marker skips anyway
        return 0


@pytest.mark.skipif(
    _compute_capability_major() < 10,
    reason="NVFP4 runs on sm100+ (Blackwell) only; on older GPUs its refusal "
    "is checked by test_jax_quantized_fp8_patterns",
)
@pytest.mark.parametrize("sweep", sweep_params())
def test_jax_nvfp4_patterns_on_blackwell(sweep):
    quick = sweep == "quick"
    tokens = (1, 17, 128) if quick else (1, 16, 17, 128, 129, 1024)
    # 1040 / 16 = 65 scale columns: the swizzled layout pads them to 68.
    hiddens = (1024,) if quick else (1024, 1040, 4096, 8192)
    res = _run("jax_nvfp4", "nvfp4", CMDBUF_ON, tokens=tokens, hiddens=hiddens)
    for r in res:
        q = r["nvfp4"]
        assert q["cases"] > 0 and q["nan_outputs"] == 0, q
        assert q["residual"] <= 1.0 and q["norm"] <= 3.0, q
        # Codes: the kernel's e2m1 of x * (gs / SF) against the oracle on its own norm_out;
        # a code one step away can only come from the division's rounding near a midpoint.
        assert q["worse"] == 0, q
        assert q["steps1"] <= 1e-3 * q["codes"], q
        # Block scales e4m3(gs * amax / 6) at every defined position of both layouts.
        assert q["scale_bytes"] > 0 and q["scale_mismatch"] == 0, q
        # Twins (with / without norm_out): residuals equal; codes and scales may differ
        # only where the launch geometry reorders the norm's reduction (see the FP8 test).
        assert q["twin_residual_diffs"] == 0, q
        assert q["twin_code_diffs"] + q["twin_scale_diffs"] <= 1e-5 * q["codes"], q


def batching_problems(res, world):
    """The batching task's results against the bounds: the dense calls (vmap, N-D, a batched
    gamma) within harness.bound_problems over every element, the MoE vmap bit for bit."""
    problems = []
    for r in res:
        b = r["batching"]
        if b["dense"]["cases"] != 3 * 3:
            problems.append(f"rank {r['rank']}: {b['dense']['cases']} dense cases, not 9")
        problems += bound_problems(b["dense"], "bfloat16", world, f"rank {r['rank']}")
        if b["moe_mismatches"]:
            problems.append(f"rank {r['rank']}: {b['moe_mismatches']} MoE elements differ")
    return problems


@pytest.mark.parametrize("world", world_params())
def test_jax_batched_calls_fold_into_the_kernel(world):
    """jax.vmap and an N-D x fold the batch into tokens for the kernel (strict=True: a
    fallback would raise); a batched rms_gamma maps one call per element."""
    res = _run(f"jax_batching_world{world}", "batching", CMDBUF_OFF, world)
    problems = batching_problems(res, world)
    assert not problems, "\n".join(problems)
