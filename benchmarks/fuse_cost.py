"""What ``jax_fusedar.fuse`` costs: its analysis time per layer, and the fused program's
lower + compile time against the original's, measured in one run (a script, not a timed
test).

    python -m benchmarks.fuse_cost                     # 8/48/80-layer decoders, both modes
    python -m benchmarks.fuse_cost --layers 8 --reps 7 --json out.json
    python -m benchmarks.fuse_cost --kinds llama minimal  # also the minimal layer
    python -m benchmarks.fuse_cost --integration       # also the integration lane's models
                                                       # (run with the lane's venv), at 2
                                                       # and 8 layers (--integration-layers)
    python -m benchmarks.fuse_cost --ranks 8 --platform cuda  # one process per rank

``--ranks N`` runs one ``jax.distributed`` process per rank (rank r on GPU r % GPUs; ranks
may share a GPU: nothing runs on it, only XLA's compiler works) and fuses with the workspace
backend ``"auto"``: on GPUs the kernel, so the fused program that is compiled holds its
custom calls, as a user's on GPUs does; without ``--ranks`` the sites compile as XLA's
fallback (backend ``"xla"``, the only one on CPUs).

The decoders are pre-norm Llama layers (q/k/v projections, rotary embeddings, grouped-query
causal attention, the out-projection, a SwiGLU MLP; ``--kinds minimal``: attention reduced to
one value projection, the smallest body around two sites) in one ``shard_map`` over ``tp``,
``psum`` after each row-parallel matmul, unrolled (a Python loop) or scanned over stacked
weights (``lax.scan``: fuse rotates the loop). Hidden 256 over 8 CPU devices: the pass's cost
depends on the program's size, not on the arrays'. For each model and repetition, from empty
caches:

* trace: ``jax.make_jaxpr`` of the original (what any jit pays);
* the pass, as ``fused.analyze(...)`` reports it, without the trace of the function:
  ``report.analysis_s`` (analysis: finding and proving the sites, the workspace plan),
  ``report.allocate_s`` (creating the workspaces: on GPUs with the kernel a collective
  among the rank processes, which exchange memory handles) and ``report.pass_s`` (the
  whole pass: those and the re-trace of the rewritten program);
* lower + compile of the traced ``jax.jit(original)`` and ``jax.jit(fused)`` (StableHLO,
  then XLA's compile), in wall time and in the process's CPU time (the compiler's work,
  which other load on a shared machine changes less): what the rewritten program costs
  beyond the pass; for a scanned decoder also of the loop rotated by hand without ``fuse``
  (``_rotated_by_hand``): what the rotation alone costs.

Printed: medians with the spread (min-max) over the repetitions, the analysis and the whole
pass per layer, and the ratios of the fused program's lower + compile to the original's
(wall, CPU). Targets: 10 ms per layer (checked for the analysis and for the whole pass less
the workspaces' creation, which is paid once per workspace shape, not per layer), lower +
compile <= 1.1x the original's (checked for both clocks). Only the public API is used
(``jax_fusedar.fuse``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

# Set by ``--ranks`` in each rank process it starts: "rank world port gpu".
_RANK = os.environ.get("FUSE_COST_RANK")
_FLAGS = "--xla_force_host_platform_device_count=8"  # one process: 8 host devices
if _RANK is None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if _FLAGS not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAGS}".strip()
else:
    # Eight ranks fit on one GPU: each takes memory as it needs it.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_fusedar as jf  # noqa: E402

HIDDEN, FFN, TOKENS, EPS = 256, 512, 16, 1e-5
HEADS, KV_HEADS, HEAD_DIM, ROPE_THETA = 16, 8, 16, 10000.0
TARGET_MS_PER_LAYER, TARGET_COMPILE_RATIO = 10.0, 1.1
# The fused all-reduce's custom call (a prefix of its versioned FFI target) in compiled HLO.
_KERNEL = "jax_fusedar_allreduce_fusion"


def _rms_norm(x, g):
    f = x.astype(jnp.float32)
    y = f * jax.lax.rsqrt(jnp.mean(f * f, -1, keepdims=True) + EPS)
    return (y * g.astype(jnp.float32)).astype(x.dtype)


def _rope(x):
    """Llama's rotary embedding (rotate-half) of x [T, heads, HEAD_DIM] at positions 0..T-1."""
    half = HEAD_DIM // 2
    freq = ROPE_THETA ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None, None] * freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _llama_attention(h, p):
    """Grouped-query causal self-attention on this rank's heads; the out-projection's
    partial sum (before the all-reduce)."""
    t = h.shape[0]
    q = _rope((h @ p["wq"]).reshape(t, -1, HEAD_DIM))
    k = _rope((h @ p["wk"]).reshape(t, -1, HEAD_DIM))
    v = (h @ p["wv"]).reshape(t, -1, HEAD_DIM)
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32) / HEAD_DIM**0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("hts,shd->thd", jax.nn.softmax(s, -1), v.astype(jnp.float32))
    return o.reshape(t, -1).astype(h.dtype) @ p["wo"]


def _llama_mlp(h, p):
    """SwiGLU on this rank's FFN slice; the down-projection's partial sum."""
    return (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


# A layer kind: (attention block, MLP block, {weight: (shape, spec)}). Each block returns
# this rank's partial sum, which the layer all-reduces (psum) and adds to the residual.
KINDS = {
    "llama": (
        _llama_attention,
        _llama_mlp,
        dict(
            wq=((HIDDEN, HEADS * HEAD_DIM), P(None, "tp")),
            wk=((HIDDEN, KV_HEADS * HEAD_DIM), P(None, "tp")),
            wv=((HIDDEN, KV_HEADS * HEAD_DIM), P(None, "tp")),
            wo=((HEADS * HEAD_DIM, HIDDEN), P("tp")),
            w_gate=((HIDDEN, FFN), P(None, "tp")),
            w_up=((HIDDEN, FFN), P(None, "tp")),
            w_down=((FFN, HIDDEN), P("tp")),
        ),
    ),
    # Attention reduced to one value projection: the smallest body around two sites, where
    # the rotation's fixed cost (the peeled norm) weighs most.
    "minimal": (
        lambda h, p: jnp.tanh(h @ p["wv"]) @ p["wo"],
        lambda h, p: jax.nn.silu(h @ p["w_up"]) @ p["w_down"],
        dict(
            wv=((HIDDEN, HIDDEN), P(None, "tp")),
            wo=((HIDDEN, HIDDEN), P("tp")),
            w_up=((HIDDEN, FFN), P(None, "tp")),
            w_down=((FFN, HIDDEN), P("tp")),
        ),
    ),
}


def _layer(kind, x, p):
    attention, mlp, _ = KINDS[kind]
    h = _rms_norm(x, p["attn_norm"])
    x = x + jax.lax.psum(attention(h, p), "tp")
    h = _rms_norm(x, p["mlp_norm"])
    return x + jax.lax.psum(mlp(h, p), "tp")


def _rotated_by_hand(kind, params, x):
    """The scanned decoder rotated as ``fuse`` rotates it, written by hand without the
    fused op: the first norm before the loop, each iteration ending with the next layer's
    norm (gamma's stack shifted by one, the final norm's gamma last). Its lower + compile
    against the original's is the cost of the rotation alone."""
    attention, mlp, _ = KINDS[kind]
    stack = params["layers"]
    g_next = jnp.concatenate([stack["attn_norm"][1:], params["final_norm"][None]])

    def step(carry, p):
        x, h = carry
        p, g = p
        x = x + jax.lax.psum(attention(h, p), "tp")
        h = _rms_norm(x, p["mlp_norm"])
        x = x + jax.lax.psum(mlp(h, p), "tp")
        return (x, _rms_norm(x, g)), None

    h0 = _rms_norm(x, stack["attn_norm"][0])
    (_, h), _ = jax.lax.scan(step, (x, h0), (stack, g_next))
    return h


def decoder(layers: int, scan: bool, by_hand: bool = False, kind: str = "llama"):
    """(fn, args, mesh, axis, layers) of a pre-norm decoder of ``layers`` layers of
    ``kind`` (``KINDS``; ``by_hand``: scanned, rotated by hand, ``_rotated_by_hand``)."""
    tp = jax.device_count()  # 8 host devices, or one per rank process (--ranks)
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16
    weights = KINDS[kind][2]

    def layer_params():
        p = {
            k: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), dt)
            for k, (shape, _) in weights.items()
        }
        return dict(p, attn_norm=jnp.ones((HIDDEN,), dt), mlp_norm=jnp.ones((HIDDEN,), dt))

    specs = dict({k: spec for k, (_, spec) in weights.items()}, attn_norm=P(), mlp_norm=P())
    per_layer = [layer_params() for _ in range(layers)]
    if scan:
        params = {k: jnp.stack([p[k] for p in per_layer]) for k in specs}
        pspecs = {k: P(None, *s) for k, s in specs.items()}
    else:
        params, pspecs = per_layer, [specs] * layers
    params = dict(layers=params, final_norm=jnp.ones((HIDDEN,), dt))
    pspecs = dict(layers=pspecs, final_norm=P())

    def body(params, x):
        if by_hand:
            return _rotated_by_hand(kind, params, x)
        if scan:
            x, _ = jax.lax.scan(lambda x, p: (_layer(kind, x, p), None), x, params["layers"])
        else:
            for p in params["layers"]:
                x = _layer(kind, x, p)
        return _rms_norm(x, params["final_norm"])

    fn = jax.shard_map(body, mesh=mesh, in_specs=(pspecs, P()), out_specs=P(), check_vma=False)
    x = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), dt)
    return fn, _replicated((params, x), mesh), mesh, "tp", layers


def _replicated(tree, mesh):
    """``tree``'s arrays replicated over ``mesh``. Across rank processes (``--ranks``) each
    places its own copy: every rank draws the same values (the same seed)."""
    sharding = NamedSharding(mesh, P())
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def place(a):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    return jax.tree.map(place, tree)


def _timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def measure(
    name,
    fn,
    args,
    mesh,
    axis,
    layers,
    reps,
    context=None,
    by_hand=None,
    options=None,
    backend="xla",
):
    """One row; ``by_hand``: the same program rotated by hand, whose lower + compile is
    timed in the same repetitions (the rotation's own cost); ``options``: fuse's;
    ``backend``: its workspaces' (``"auto"`` with ``--ranks``: the kernel on GPUs)."""
    import contextlib

    ctx = context or contextlib.nullcontext
    trace, analysis, allocate, whole, sites, kernel_calls = [], [], [], [], None, None
    # Lower + compile of each program: wall seconds, and the process's CPU seconds (XLA's
    # work, which the other load of a shared machine does not change).
    wall = {"original": [], "fused": [], "by_hand": []}
    cpu = {"original": [], "fused": [], "by_hand": []}
    # Every compile is timed in full: no persistent cache. MaxText's config sets one up, and
    # JAX decides once per process whether it is used: reset that decision too.
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    with ctx():
        for _ in range(reps):
            jax.clear_caches()
            trace.append(_timed(lambda: jax.make_jaxpr(fn)(*args)))
            fused = jf.fuse(fn, mesh=mesh, axis_name=axis, backend=backend, **(options or {}))
            jax.clear_caches()
            rep = fused.analyze(*args)
            # Measured inside the trace, the trace itself left out.
            analysis.append(rep.analysis_s)
            allocate.append(rep.allocate_s)
            whole.append(rep.pass_s)
            sites = (len(rep.fused), len(rep.sites), rep.fused_runs())
            # Alternated, so that neither program always compiles first (a warmer process).
            order = [("original", fn), ("fused", fused)] + (
                [("by_hand", by_hand)] if by_hand else []
            )
            for key, f in order if len(trace) % 2 else order[::-1]:
                jax.clear_caches()
                traced = jax.jit(f).trace(*args)  # (the fused one's pass: timed above)
                t, c = time.perf_counter(), time.process_time()
                compiled = traced.lower().compile()
                wall[key].append(time.perf_counter() - t)
                cpu[key].append(time.process_time() - c)
                if key == "fused":  # the kernel's calls in it (0: the sites' XLA fallback)
                    kernel_calls = compiled.as_text().count(f'custom_call_target="{_KERNEL}')
            fused.close()

    def stat(xs):
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    row = {
        "model": name,
        "layers": layers,
        "fused_sites": sites[0],
        "sites": sites[1],
        "fused_calls_per_run": sites[2],
        "platform": jax.devices()[0].platform,
        "ranks": jax.process_count(),
        "devices": jax.device_count(),
        "backend": backend,
        "kernel_calls_in_program": kernel_calls,
        "trace_s": stat(trace),
        "analysis_s": stat(analysis),
        "analysis_ms_per_layer": 1e3 * statistics.median(analysis) / layers,
        "allocate_s": stat(allocate),
        "pass_s": stat(whole),
        "pass_ms_per_layer": 1e3 * statistics.median(whole) / layers,
        "pass_less_allocation_ms_per_layer": 1e3
        * statistics.median([w - a for w, a in zip(whole, allocate)])
        / layers,
    }
    # The ratio of each repetition's pair, then their median (same caches, same load).
    for times, suffix in ((wall, ""), (cpu, "_cpu")):
        row[f"original_lower_compile{suffix}_s"] = stat(times["original"])
        row[f"fused_lower_compile{suffix}_s"] = stat(times["fused"])
        row[f"compile{suffix}_ratio"] = stat(
            [f / o for f, o in zip(times["fused"], times["original"])]
        )
        if by_hand:
            row[f"rotated_by_hand_compile{suffix}_ratio"] = stat(
                [h / o for h, o in zip(times["by_hand"], times["original"])]
            )
    return row


def _fmt(s):
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def print_row(r):
    def ok(good):
        return "ok" if good else "OVER"

    ok_a = r["analysis_ms_per_layer"] <= TARGET_MS_PER_LAYER
    ok_p = r["pass_less_allocation_ms_per_layer"] <= TARGET_MS_PER_LAYER
    ok_c = r["compile_ratio"]["median"] <= TARGET_COMPILE_RATIO
    ok_cpu = r["compile_cpu_ratio"]["median"] <= TARGET_COMPILE_RATIO
    print(
        f"{r['model']:<44} fused {r['fused_sites']}/{r['sites']} "
        f"({r['fused_calls_per_run']} calls/run, {r['kernel_calls_in_program']} kernel "
        f"calls in the program) | trace {_fmt(r['trace_s'])} s | "
        f"analysis {_fmt(r['analysis_s'])} s = {r['analysis_ms_per_layer']:.2f} ms/layer "
        f"[{ok(ok_a)}], workspaces created in {_fmt(r['allocate_s'])} s, whole pass "
        f"{_fmt(r['pass_s'])} s = {r['pass_ms_per_layer']:.2f} ms/layer, less the "
        f"workspaces' creation {r['pass_less_allocation_ms_per_layer']:.2f} ms/layer "
        f"[{ok(ok_p)}] | lower+compile orig {_fmt(r['original_lower_compile_s'])}"
        f" s, fused {_fmt(r['fused_lower_compile_s'])} s, ratio {_fmt(r['compile_ratio'])} "
        f"[{ok(ok_c)}], CPU time ratio {_fmt(r['compile_cpu_ratio'])} [{ok(ok_cpu)}]"
        + (
            f" | rotated by hand, no fuse: ratio {_fmt(r['rotated_by_hand_compile_ratio'])}, "
            f"CPU time {_fmt(r['rotated_by_hand_compile_cpu_ratio'])}"
            if "rotated_by_hand_compile_ratio" in r
            else ""
        ),
        flush=True,
    )


def integration_models(layer_counts):
    """The integration lane's models (tests/integration: their packages must be installed,
    tools/integration.sh's venv), each with each number of layers its code takes."""
    sys.path.insert(0, os.getcwd())
    from tests.integration.models import MODELS

    for m in MODELS:
        for n in layer_counts:
            try:
                b = m.build(layers=n)
            except ValueError as e:
                print(f"{m.name}, {n} layers: not built ({e})", flush=True)
                continue
            name = f"{m.name}, {n} layers"
            yield name, b.fn, (b.params, *b.inputs), b.mesh, b.axis_name, b.layers, b.context


def _count(text: str) -> int:
    """A layer or repetition count: a whole number of at least 1 (0 layers hold no site, and
    a per-layer time of none is no figure)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of at least 1")
    return n


def _launch(argv, ranks: int, platform: str, gpus: int) -> int:
    """Runs this script once per rank (``--ranks``): rank r a ``jax.distributed`` process on
    ``platform``, on GPU r % ``gpus`` for "cuda". Rank 0 prints; the others' output is kept in
    files, shown if one fails. Each process compiles for itself: compile times are rank 0's
    (the ranks compile at the same time, on the host's cores)."""
    import socket
    import subprocess
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The parent's 8 host devices are not the ranks': each rank process has one device.
    flags = os.environ.get("XLA_FLAGS", "").replace(_FLAGS, "")
    with tempfile.TemporaryDirectory(prefix="fuse_cost_ranks_") as logs:
        procs, logged = [], []
        for r in range(ranks):
            env = dict(
                os.environ,
                FUSE_COST_RANK=f"{r} {ranks} {port} {r % gpus}",
                JAX_PLATFORMS=platform,
                XLA_FLAGS=flags.strip(),
            )
            log = None if r == 0 else open(os.path.join(logs, f"rank{r}.log"), "w")
            logged += [log] if log else []
            cmd = [sys.executable, "-m", "benchmarks.fuse_cost", *argv]
            to = dict(stdout=log, stderr=subprocess.STDOUT) if log else {}
            procs.append(subprocess.Popen(cmd, env=env, **to))
        # Until all have ended or one has failed (a nonzero exit).
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            time.sleep(0.2)
        failed = next((r for r, p in enumerate(procs) if p.poll()), None)
        for p in procs:  # after a failure, the others would wait for that rank forever
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logged:
            log.close()
        if failed is None:
            return 0
        if failed:
            with open(os.path.join(logs, f"rank{failed}.log")) as f:
                sys.stderr.write(f"rank {failed} failed (exit {procs[failed].returncode}):\n")
                sys.stderr.write("".join(f.readlines()[-40:]))
        return procs[failed].returncode or 1


def _visible_gpus() -> int:
    """The GPUs a rank process may choose from: those CUDA_VISIBLE_DEVICES names, else those
    ``nvidia-smi -L`` lists (0 without it). An outside tool: the benchmarks use only the
    public API, which counts no GPUs."""
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in smi.stdout.splitlines())


def _join_ranks() -> None:
    """This rank process's place in the ``jax.distributed`` group ``_launch`` started."""
    rank, world, port, gpu = map(int, _RANK.split())
    cpu = os.environ["JAX_PLATFORMS"] == "cpu"
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=world,
        process_id=rank,
        local_device_ids=None if cpu else [gpu],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=_count, nargs="+", default=[8, 48, 80])
    ap.add_argument("--modes", nargs="+", default=["unrolled", "scanned"])
    ap.add_argument("--kinds", nargs="+", default=["llama"], choices=sorted(KINDS))
    ap.add_argument("--reps", type=_count, default=5)
    ap.add_argument("--integration", action="store_true")
    ap.add_argument("--only-integration", action="store_true")
    ap.add_argument("--integration-layers", type=_count, nargs="+", default=[2, 8])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--ranks",
        type=_count,
        help="one jax.distributed process per rank instead of 8 host devices in one; fuse's "
        "workspaces on backend 'auto' (the kernel on GPUs, its custom calls compiled)",
    )
    ap.add_argument("--platform", choices=["cpu", "cuda"], default="cpu", help="of --ranks")
    a = ap.parse_args(argv)
    if a.ranks and (a.integration or a.only_integration):
        ap.error("--ranks: the integration models build their meshes of 8 host devices")
    if a.ranks and _RANK is None:
        gpus = _visible_gpus() if a.platform == "cuda" else 1
        if not gpus:
            ap.error(
                "--platform cuda: no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, else nvidia-smi -L)"
            )
        return _launch(sys.argv[1:] if argv is None else list(argv), a.ranks, a.platform, gpus)
    if _RANK is not None:
        _join_ranks()
    lead = jax.process_index() == 0  # the one that prints and writes
    backend = "xla" if _RANK is None else "auto"
    say = print if lead else (lambda *args, **kw: None)
    say(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices"
        f" in {jax.process_count()} process(es), fuse's backend {backend!r}",
        flush=True,
    )
    rows = []
    if not a.only_integration:
        for kind, layers, mode in itertools.product(a.kinds, a.layers, a.modes):
            scanned = mode == "scanned"
            fn, args, mesh, axis, n = decoder(layers, scanned, kind=kind)
            hand = decoder(layers, True, by_hand=True, kind=kind)[0] if scanned else None
            name = f"{kind} decoder {mode} {layers} layers"
            rows.append(
                measure(name, fn, args, mesh, axis, n, a.reps, by_hand=hand, backend=backend)
            )
            if lead:
                print_row(rows[-1])
    if a.integration or a.only_integration:
        # With allow_rounding_change: Equinox's sites fuse only so (the others the same either
        # way), and a row where nothing fused would measure nothing.
        rounding = dict(allow_rounding_change=True)
        for name, fn, args, mesh, axis, n, ctx in integration_models(a.integration_layers):
            rows.append(measure(name, fn, args, mesh, axis, n, a.reps, ctx, options=rounding))
            print_row(rows[-1])
    if a.json and lead:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
