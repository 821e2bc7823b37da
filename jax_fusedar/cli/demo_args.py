"""The demo's flags (``python -m jax_fusedar demo``), apart from the demo itself: the CLI
parses them before JAX starts, because the device count it then sets (``ranks``) is read
only once, when JAX creates its backends. Imports no JAX."""

from __future__ import annotations

LAYER_MODES = ("unrolled", "scan")


def add_arguments(parser, *, positive_int, int_list, seed, dtypes, backends) -> None:
    """The demo's flags (the CLI passes its validators, so every flag is checked alike)."""
    parser.add_argument(
        "--preset",
        choices=("auto", "tiny", "llama3-8b"),
        default="auto",
        help="model shapes: auto = llama3-8b on GPUs, tiny on CPUs",
    )
    parser.add_argument(
        "--layers", type=positive_int, default=None, help="override the preset's number of layers"
    )
    parser.add_argument("--dtype", choices=dtypes, default="bfloat16")
    parser.add_argument("--batch", type=positive_int, default=2, help="sequences decoded")
    parser.add_argument(
        "--prompt",
        type=positive_int,
        default=16,
        help="prompt length (tokens prefilled per sequence)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=8,
        help="greedy decode steps compared between fused and unfused",
    )
    parser.add_argument(
        "--layer-mode",
        choices=("both",) + LAYER_MODES,
        default="both",
        help="layers as a Python loop (unrolled), under lax.scan, or both",
    )
    parser.add_argument(
        "--norm",
        choices=("fused-friendly", "hf"),
        default="fused-friendly",
        help="RMSNorm as written in the model: gamma multiplied in float32 "
        "(fused-friendly) or in the activation dtype after a cast (Hugging "
        "Face's form: the fused norm is the rounded value, gamma's multiplication "
        "stays after it)",
    )
    parser.add_argument(
        "--allow-rounding-change",
        action="store_true",
        help="let fuse() fuse norms whose rounding differs from the kernel's",
    )
    parser.add_argument(
        "--iters",
        type=positive_int,
        default=5,
        help="timed calls of each program after warm-up (median shown)",
    )
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random weights")
    parser.add_argument(
        "--backend",
        choices=backends,
        default="auto",
        help="fused op backend: auto = the kernel on GPUs, XLA elsewhere",
    )
    parser.add_argument(
        "--bench",
        action="store_true",
        help="time decode steps and prefills fused vs unfused (below) and "
        "write bench_llama.json to --out, instead of the comparison",
    )
    parser.add_argument(
        "--bench-batches", type=int_list, default="1,16,64", help="--bench: decode batch sizes"
    )
    parser.add_argument(
        "--bench-kv",
        type=int_list,
        default="128,2048",
        help="--bench: KV cache lengths of the decode steps",
    )
    parser.add_argument(
        "--bench-prefill",
        type=int_list,
        default="1024,4096",
        help="--bench: prefill lengths (batch 1)",
    )
    parser.add_argument(
        "--bench-prefill-layers",
        choices=("both",) + LAYER_MODES + ("none",),
        default="scan",
        help="--bench: layer modes of the prefills (each "
        "unrolled 32-layer program costs a long compile)",
    )
    parser.add_argument(
        "--bench-steps",
        type=positive_int,
        default=20,
        help="--bench: back-to-back calls per timed run",
    )
    parser.add_argument(
        "--bench-budget-s",
        type=positive_int,
        default=None,
        help="--bench: start no new case after this many seconds (the JSON "
        "lists the cases left out)",
    )
    parser.add_argument("--out", default="bench_out", help="--bench: folder for the JSON")
    parser.add_argument(
        "--moe",
        action="store_true",
        help="the decoder with mixture-of-experts MLPs (routed experts, expert "
        "parallel, plus a shared expert) combined by jax_fusedar's MoE finalize "
        "op, against the same model written plainly (jax_fusedar/cli/moe_demo.py)",
    )
