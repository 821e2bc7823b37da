"""Runs one function in N processes (one TP rank each, rank r on GPU ``r % gpu_count``: ranks
sharing a GPU time-slice their kernels) with a tiny message channel, and shared GPU-test bits.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

import numpy as np


class Channel:
    """All-to-all mailbox between the ranks of one run (pickled Python objects)."""

    def __init__(self, rank, inboxes, timeout_s, results=None):
        self.rank, self.inboxes, self.timeout_s = rank, inboxes, timeout_s
        self.world = len(inboxes)
        self._early = {}
        self._results = results

    def note(self, **facts):
        """Hands ``facts`` to run_ranks at once (merged per rank): they reach the test even if
        this process later ends without a result, if sent well before an ``os._exit``."""
        if self._results is not None:
            self._results.put((self.rank, "note", facts))

    def all_gather(self, tag, obj, timeout_s=None):
        """Every rank's ``obj`` for ``tag``; TimeoutError naming the ranks that did not send."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        for r, box in enumerate(self.inboxes):
            if r != self.rank:
                box.put((tag, self.rank, obj))
        got = {self.rank: obj}
        while len(got) < self.world:
            key = next((k for k in self._early if k[0] == tag), None)
            if key is not None:
                got[key[1]] = self._early.pop(key)
                continue
            try:
                t, src, o = self.inboxes[self.rank].get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(got))
                raise TimeoutError(
                    f"rank {self.rank}: ranks {missing} never sent {tag!r}"
                ) from None
            if t == tag:
                got[src] = o
            else:
                self._early[(t, src)] = o
        return [got[r] for r in range(self.world)]

    def barrier(self, tag, timeout_s=None):
        self.all_gather(tag, None, timeout_s)

    def close(self):
        """Flushes what this rank sent (a rank about to be killed must, or lose its last puts)."""
        for r, box in enumerate(self.inboxes):
            if r != self.rank:
                box.close()
                box.join_thread()


def child_main(fn, rank, world, inboxes, results, timeout_s, kwargs):
    """A rank process's body: fn's result (or traceback) to the results queue."""
    # SIGUSR1 prints every thread's stack: run_ranks asks a rank that hangs where it waits.
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        chan = Channel(rank, inboxes, timeout_s, results)
        results.put((rank, "ok", fn(rank, world, chan, **kwargs)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *, timeout_s: float = 600.0, allow_exit=(), **kwargs):
    """fn(rank, world, channel, **kwargs) in `world` spawned processes: their results. A rank
    that exits without one fails the run, unless its exit code is in ``allow_exit``: then its
    result is {"rank", "exitcode", "exited_at" (``time.monotonic()`` when seen, within 1 s),
    "notes" (its ``channel.note``s)}."""
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(world)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=child_main, args=(fn, r, world, inboxes, results, timeout_s, kwargs))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out, errors, exited, reported, notes = {}, [], {}, set(), {}
    deadline = time.monotonic() + timeout_s

    def take(item):
        rank, status, payload = item
        if status == "note":
            notes.setdefault(rank, {}).update(payload)
            return
        reported.add(rank)
        (out.__setitem__(rank, payload) if status == "ok" else errors.append(payload))

    try:
        while len(reported) < world:
            try:
                take(results.get(timeout=0.25))
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            if dead:
                seen = time.monotonic()
                # A process flushes its queue before it exits: a dead rank with nothing left
                # to read sent no result.
                try:
                    while True:
                        take(results.get(timeout=0.5))
                except queue.Empty:
                    pass
                for r in (r for r in dead if r not in reported):
                    reported.add(r)
                    code = procs[r].exitcode
                    if code in allow_exit:
                        exited[r] = dict(
                            rank=r, exitcode=code, exited_at=seen, notes=notes.get(r, {})
                        )
                    else:
                        errors.append(f"rank {r} exited with {code} without a result")
            if time.monotonic() > deadline:
                raise queue.Empty
    except queue.Empty:
        missing = sorted(set(range(world)) - reported)
        errors.append(
            f"timed out after {timeout_s} s waiting for ranks {missing}\n"
            + where_they_wait([procs[r] for r in missing])
        )
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] if r in out else exited[r] for r in range(world)]


def run_ranks_with_port(fn, world: int, **kwargs):
    """run_ranks with ``port``, a free localhost port for the ranks' rendezvous."""
    return run_ranks(fn, world, port=free_port(), **kwargs)


def where_they_wait(procs) -> str:
    """For processes that do not answer: state, kernel wait channel and stack (a wait in the
    GPU driver shows there), and their Python stacks (SIGUSR1, see ``child_main``)."""
    import signal

    lines = []
    for p in procs:
        if not p.is_alive():
            lines.append(f"pid {p.pid}: exited with {p.exitcode}")
            continue
        info = []
        for name in ("wchan", "stack"):
            try:
                with open(f"/proc/{p.pid}/{name}") as f:
                    info.append(f"{name}: {f.read().strip()}")
            except OSError as e:
                info.append(f"{name}: unreadable ({e.strerror})")
        try:
            with open(f"/proc/{p.pid}/status") as f:
                info += [line.strip() for line in f if line.startswith("State:")]
        except OSError:
            pass
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except OSError:
            pass
        lines.append(f"pid {p.pid}: " + "; ".join(info))
    time.sleep(1.0)  # let the stacks reach stderr before the processes are killed
    return "\n".join(lines)


_CLONE_NEWNS, _CLONE_NEWUTS = 0x00020000, 0x04000000
_MS_REC, _MS_PRIVATE, _MS_BIND = 0x4000, 1 << 18, 0x1000


def simulate_host(name: str) -> None:
    """Makes this process (and its children) look like host ``name``: private UTS and mount
    namespaces, /etc/hosts resolving it to 127.0.0.1 (gloo resolves its own host name). Needs
    root (CAP_SYS_ADMIN); OSError otherwise."""
    import ctypes
    import tempfile

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"simulate_host({name!r}): {what}: {os.strerror(err)}")

    check(libc.unshare(_CLONE_NEWUTS | _CLONE_NEWNS), "unshare(CLONE_NEWUTS | CLONE_NEWNS)")
    socket.sethostname(name)
    # Mounts made from here on stay in this namespace.
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    with open("/etc/hosts") as f:
        hosts = f.read()
    with tempfile.NamedTemporaryFile("w", prefix=f"hosts-{name}-", delete=False) as f:
        f.write(f"{hosts.rstrip()}\n127.0.0.1 {name}\n")
    bind = libc.mount(f.name.encode(), b"/etc/hosts", None, _MS_BIND, None)
    check(bind, "mount --bind over /etc/hosts")
    os.unlink(f.name)  # the mount keeps it alive


def simulated_hosts_problem():
    """Why this machine cannot ``simulate_host`` (probed in a throwaway process), or None."""
    from tests.gpu.case_runs import run_python

    probe = "from tests.gpu.harness import simulate_host; simulate_host('jf-probe')"
    r = run_python(["-c", probe], env=None, timeout=60)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def gpu_count() -> int:
    from jax_fusedar.common import native

    return native.gpu_count()


def device_for(rank: int) -> int:
    return rank % max(1, gpu_count())


def needs_gpus(count: int, why: str):
    """A skip mark for tests that cannot share GPUs (one process driving several devices,
    XLA's psum or NCCL, which refuse two ranks on one GPU)."""
    import pytest

    return pytest.mark.skipif(gpu_count() < count, reason=f"needs {count} GPUs: {why}")


def world_params(quick=(2,), worlds=(2, 4, 8), *, before=(), after=(), id="{}"):
    """pytest parameters ``(*before, world, *after)`` at the suite's world sizes (ids world2, ...
    in the ``id`` template), those not in ``quick`` marked slow (left out of the quick lane)."""
    import pytest

    marks = lambda w: () if w in quick else pytest.mark.slow
    return [
        pytest.param(*before, w, *after, id=id.format(f"world{w}"), marks=marks(w)) for w in worlds
    ]


def sweep_params(*, before=(), id="{}"):
    """A sweep's sizes ``(*before, size)``: "quick", and "full" marked slow."""
    import pytest

    return [
        pytest.param(*before, "quick", id=id.format("quick")),
        pytest.param(*before, "full", id=id.format("full"), marks=pytest.mark.slow),
    ]


def cuda_torch():
    """torch; skips the test where torch has no CUDA (a CPU build or no GPU)."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (CPU build or no GPU)")
    return torch


def bound_problems(worst: dict, dtype: str, world: int, where: str = "") -> list:
    """What is wrong with the worst errors (tests/oracles/oracle.py's) of plain outputs: the
    accumulation bounds, and at 2 ranks the ulp bounds too. A NaN fails every check."""
    from tests.oracles import oracle

    limits = {
        "allreduce_bound": 1.0,
        "residual_bound": 1.0,
        "norm_own": oracle.NORM_GIVEN_RESIDUAL_ULPS[dtype],
    }
    if world == 2:  # ulps of the intermediate magnitudes (docs/numerics.md): they assume an
        # exact float32 sum, which holds for 2 ranks of 16-bit values only
        norm = {"bfloat16": 3.0, "float16": 3.0, "float32": 8.0}[dtype]
        limits.update(allreduce=1.0, residual=1.0, norm=norm)
    return [
        f"{where} {dtype} {k} {worst[k]} > {v}".strip()
        for k, v in limits.items()
        if k in worst and not worst[k] <= v
    ]


def worst_of(into: dict, errors: dict) -> dict:
    """Per-key maxima of error dicts; a NaN stays NaN (Python's max would drop it)."""
    for k, v in errors.items():
        old = into.get(k, 0.0)
        into[k] = float("nan") if (v != v or old != old) else max(old, v)
    return into


def env_int(name, default):
    return int(os.environ.get(name, default))


def random_seed(below: int = 1 << 32) -> int:
    """A fresh random seed modulo ``below`` (never $JAX_FUSEDAR_TEST_SEED: see run_seed)."""
    return int.from_bytes(os.urandom(4), "little") % below


def run_seed() -> int:
    """$JAX_FUSEDAR_TEST_SEED (to repeat a run), else a fresh random seed."""
    env = os.environ.get("JAX_FUSEDAR_TEST_SEED")
    return int(env) if env else random_seed()


def free_port() -> int:
    """A TCP port on localhost that is free right now (for a rendezvous server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(name, obj):
    """Prints a GPU test's results and writes them to $JAX_FUSEDAR_REPORT_DIR/<name>.json."""
    out = os.environ.get("JAX_FUSEDAR_REPORT_DIR")
    if out:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(obj, f, indent=1)
    print(name, json.dumps(obj, indent=1))


def shape_cases(tokens, hiddens, world):
    """(hidden, tokens, use_oneshot) of a sweep, in one order on every rank (the kernel needs
    identical call sequences); two-shot only with more tokens than ranks."""
    return [
        (hidden, m, oneshot)
        for hidden in hiddens
        for m in tokens
        for oneshot in (True, False)
        if oneshot or m > world
    ]


def draw_case(seed, world, m, hidden, dtype=None):
    """One case's inputs from one seed (each rank rebuilds the group's, for the oracle): every
    rank's partial sum and the residual [m, hidden], gamma [hidden], float32 or ``dtype``."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((m, hidden), dtype=np.float32) for _ in range(world)]
    residual = rng.standard_normal((m, hidden), dtype=np.float32)
    gamma = rng.uniform(-2.0, 2.0, hidden).astype(np.float32)
    if dtype is not None:
        xs = [x.astype(dtype) for x in xs]
        residual, gamma = residual.astype(dtype), gamma.astype(dtype)
    return xs, residual, gamma
