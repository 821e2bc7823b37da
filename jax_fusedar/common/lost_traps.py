"""Ends a process whose kernel recorded a failure but whose trap the GPU driver never
reported, instead of leaving it waiting forever.

A kernel that detects a failure (the handshake's mismatch or timeout, a wait past
``timeout_s``) writes the rank's failure record to pinned host memory, prints it and traps:
the trap makes the stream fail, so that the process's synchronization raises. With ranks
that share a GPU, two ranks detecting the same mismatch trap at the same moment, and the
driver has been seen to report only one of them: on one H200 (driver 580.159.04), two ranks
on one GPU called with 16 and 17 tokens under the handshake, both printed the mismatch and
trapped, the kernel log showed one Xid 43 (for the process whose synchronization raised),
and the other process's cudaStreamSynchronize spun on, its CUDA context healthy, for as long
as anyone waited.

So every live rank (native ``Rank``) is watched by one thread per process: once its failure
record is set, the process has ``GRACE_S`` seconds for the trap to reach its CUDA context
(then every CUDA call in the process fails, which ``mem_info`` probes). If the context is
still healthy after that, the trap was lost: the record is printed to stderr and the process
ends with ``EXIT_CODE``, a detected failure ending in bounded time instead of a hang. A
process that got its error carries on as before (its context is already unusable: restart
it). The record's text is kept from the pass that first saw it: a rank destroyed after that
(its destroy then waits on the same stream) is still ended with it. The end happens whatever
stderr is (closed, None in a detached process, a broken pipe): writing the record is best
effort, the exit is not.

Framework-neutral: the JAX and torch workspaces register their ranks here.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref

GRACE_S = 15.0
POLL_S = 0.5
EXIT_CODE = 70  # EX_SOFTWARE

_lock = threading.Lock()
# [weakref to rank, device, first time its record was seen or None, the record's text then]
_watched: list = []
_thread = None


def watch(rank, device: int) -> None:
    """Watches ``rank`` (a native Rank: ``failure()`` reads its record) on CUDA ``device``
    until it is destroyed or garbage collected (a weak reference: watching never keeps a
    rank, or its GPU memory, alive)."""
    global _thread
    ref = weakref.ref(rank)
    with _lock:
        _watched.append([ref, int(device), None, ""])
        if _thread is None:
            _thread = threading.Thread(target=_loop, name="jax_fusedar-lost-traps", daemon=True)
            _thread.start()


def _record(rank) -> str:
    if rank is None:
        return ""
    try:
        return rank.failure()
    except Exception:  # noqa: BLE001 - destroyed: nothing left to read
        return ""


def _alive(rank) -> bool:
    return rank is not None and bool(getattr(rank, "alive", True))


def context_failed(device: int, native_module=None) -> bool:
    """Whether the process's CUDA context on ``device`` reports an error (after a trap
    that reached it, every CUDA call does)."""
    if native_module is None:
        from . import native

        native_module = native.ext
    try:
        native_module.mem_info(device)
    except RuntimeError:
        return True
    return False


def check_once(now: float, *, probe=context_failed, end=None) -> None:
    """One pass over the watched ranks (the thread's body; callable directly in tests):
    ``probe(device)`` says whether the context reported an error, ``end(record, device)``
    ends the process."""
    end = _end if end is None else end
    with _lock:
        entries = list(_watched)
    for entry in entries:
        ref, device, seen, kept = entry
        rank = ref()
        # A record seen before outlives its rank: destroyed, it reads "" (or raises).
        text = _record(rank) or kept
        if not text:
            if not _alive(rank):
                _forget(entry)  # gone before any record: nothing to watch
            continue
        if seen is None:
            entry[2], entry[3] = now, text
            continue
        if now - seen < GRACE_S:
            continue
        if probe(device):
            _forget(entry)  # the trap was reported: the process got its error
            continue
        end(text, device)


def _forget(entry) -> None:
    with _lock:
        if entry in _watched:
            _watched.remove(entry)


def _end(text: str, device: int) -> None:
    """Prints the record and the reason, then ends the process with EXIT_CODE: the exit
    happens whatever the writing does (a closed or missing stderr, a broken pipe), so that
    the watcher's loop never retries an end forever."""
    try:
        try:
            import ctypes

            ctypes.CDLL(None).fflush(None)  # device printf output still buffered in C stdio
        except Exception:  # noqa: BLE001 - best effort
            pass
        _write_stderr(
            f"{text}\njax_fusedar: the kernel trapped on this failure {GRACE_S:.0f} s ago, but "
            f"the GPU driver has not reported the trap to this process (CUDA device {device} "
            f"still looks healthy, so its synchronization would wait forever; seen when ranks "
            f"sharing a GPU trap at the same moment). Ending the process with exit code "
            f"{EXIT_CODE}.\n"
        )
    finally:
        os._exit(EXIT_CODE)


def _write_stderr(message: str) -> None:
    """Best effort: sys.stderr, else (None, closed, a broken pipe) file descriptor 2, else
    nothing."""
    try:
        sys.stderr.write(message)
        sys.stderr.flush()
        return
    except Exception:  # noqa: BLE001 - None, closed, BrokenPipeError, ...
        pass
    try:
        data = message.encode("utf-8", "replace")
        while data:
            data = data[os.write(2, data) :]
    except Exception:  # noqa: BLE001 - descriptor 2 closed or its pipe broken too
        pass


def _loop() -> None:
    while True:
        time.sleep(POLL_S)
        try:
            # Looked up at each pass (not bound as defaults) so that a test process can
            # stand in for the CUDA probe.
            check_once(time.monotonic(), probe=context_failed, end=_end)
        except Exception:  # noqa: BLE001 - the watcher must never take the process down
            pass
