"""``exchange.Channel`` over a torch.distributed (c10d) key-value store.

The TP group's members exchange their device, host and CUDA IPC handles through the store
that ``torch.distributed.init_process_group`` created (``_get_default_store()``), never
through a collective: a collective over the wrong group is how vLLM's DP+TP runs hung, and
the store lets a missing member surface as a ``TimeoutError`` naming it instead of a hang.

Keys come from ``exchange.exchange_key`` (unique per group and workspace); this module
only moves bytes. The store's own timeout is left alone (torch.distributed uses it too):
every wait passes this channel's timeout explicitly.
"""

from __future__ import annotations

import datetime
from typing import Dict, Mapping, Optional, Sequence


def _is_store_timeout(e: BaseException) -> bool:
    # torch >= 2.3 raises DistStoreError("Wait timeout"), older versions a RuntimeError
    # whose text says timeout; a lost connection is *not* a timeout and stays as it is.
    return isinstance(e, RuntimeError) and "timeout" in str(e).lower()


class StoreChannel:
    """Implements ``jax_fusedar.common.exchange.Channel`` on a c10d ``Store``.

    ``store`` defaults to the default process group's store (torch.distributed must be
    initialised); tests pass a ``HashStore`` or ``TCPStore``. ``process`` (this process's
    global rank) lets a barrier that times out say who never arrived.
    """

    def __init__(self, store=None, *, timeout_s: float = 120.0, process: Optional[int] = None):
        if store is None:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.store = store
        self.timeout_s = float(timeout_s)
        self.process = process

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def publish(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def fetch(self, key: str, who: str) -> bytes:
        return self.fetch_many({key: who})[key]

    def fetch_many(self, whos: Mapping[str, str]) -> Dict[str, bytes]:
        """Waits for all ``keys`` at once (one timeout in total, not one per key) and, on
        timeout, names every member whose key is still missing."""
        keys = list(whos)
        try:
            self.store.wait(keys, self._timeout)
        except RuntimeError as e:
            if not _is_store_timeout(e):
                raise
            missing = [k for k in keys if not self.store.check([k])]
            raise TimeoutError(
                f"torch_compat: {'; '.join(whos[k] for k in missing) or 'a member'} did not "
                f"publish within {self.timeout_s:g} s (store keys {missing}). Every rank of "
                f"the TP group must call create_allreduce_fusion_workspace with the same "
                f"group, in the same order"
            ) from e
        return {k: self.store.get(k) for k in keys}

    def barrier(self, key: str, processes: Sequence[int]) -> None:
        """Returns once all ``processes`` reached this barrier: each adds 1 to a counter; the
        one that completes it sets a "done" key that everybody waits for (c10d's ``wait``
        waits for a key to exist, not for a counter value)."""
        expected = len(processes)
        if self.process is not None:
            self.store.set(f"{key}/arrived/{self.process}", b"1")
        arrived = self.store.add(f"{key}/count", 1)
        if arrived > expected:
            raise RuntimeError(
                f"barrier {key}: {arrived} arrivals for {expected} processes "
                f"(the key was reused: exchange keys must be unique)"
            )
        if arrived == expected:
            self.store.set(f"{key}/done", b"1")
        try:
            self.store.wait([f"{key}/done"], self._timeout)
        except RuntimeError as e:
            if not _is_store_timeout(e):
                raise
            count = self.store.add(f"{key}/count", 0)
            absent = ""
            if self.process is not None:
                late = [p for p in processes if not self.store.check([f"{key}/arrived/{p}"])]
                absent = f"; not arrived: global ranks {late}"
            raise TimeoutError(
                f"torch_compat: barrier {key}: only {count} of {expected} processes "
                f"{sorted(processes)} arrived within {self.timeout_s:g} s{absent}"
            ) from e
