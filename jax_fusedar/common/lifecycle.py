"""What every workspace does alike, JAX's (``jax_fusedar.workspace``) or torch's
(``torch_compat.workspace``): it is destroyed once (idempotently), works as a context manager,
names itself in one repr format, which shows its device memory per rank
(``bytes_per_rank``, ``sizing.workspace_bytes``), and answers the size question by
FlashInfer's element-count rule. Framework-neutral (never imports jax or torch).
"""

from __future__ import annotations

from typing import List, Optional

from . import sizing


class WorkspaceLifecycle:
    """Base of both workspaces. A subclass sets ``sizes`` (``sizing.WorkspaceSizes``) and
    ``handshake``, frees its native memory in ``_release`` and lists what its repr shows in
    ``_repr_fields``."""

    sizes: sizing.WorkspaceSizes
    handshake: bool = False
    backend: str = "trtllm"  # the JAX workspace's may be "xla" (XLA's collectives)
    _destroyed: bool = False

    @property
    def check_calls(self) -> bool:
        """``handshake``, under its name until 0.1.0."""
        return self.handshake

    @property
    def bytes_per_rank(self) -> int:
        """Device memory each rank of this workspace holds (``sizing.workspace_bytes``); 0 on
        the "xla" backend, which runs XLA's collectives and allocates nothing."""
        return self.sizes.per_rank_bytes if self.backend == "trtllm" else 0

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(f"this all-reduce fusion workspace was destroyed: {self!r}")

    def _release(self) -> None:
        """Frees the native members this process owns (called once)."""
        raise NotImplementedError

    def destroy(self) -> None:
        """Releases device memory and IPC mappings. Idempotent; every later use raises. All
        ranks must have finished their calls before any of them destroys."""
        if self._destroyed:
            return
        self._destroyed = True
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def _repr_fields(self) -> List[str]:
        raise NotImplementedError

    def __repr__(self):
        flags = (["handshake"] if self.handshake else []) + (
            ["destroyed"] if self._destroyed else []
        )
        n = self.bytes_per_rank
        size = [f"bytes_per_rank={n}" + (f" ({sizing.format_bytes(n)})" if n else "")]
        return f"{type(self).__name__}({', '.join(self._repr_fields() + size + flags)})"

    def buffer_problem(self, num_tokens: int, hidden_dim: int) -> Optional[str]:
        """Why ``num_tokens x hidden_dim`` elements do not fit the workspace, or None:
        FlashInfer's element-count rule (``sizing.buffer_fits``), so a workspace built for one
        hidden size serves any (tokens, hidden) with no more elements."""
        if sizing.buffer_fits(num_tokens, hidden_dim, self.sizes):
            return None
        return (
            f"num_tokens*hidden_dim = {num_tokens}*{hidden_dim} exceeds the workspace's "
            f"max_token_num*hidden_dim = {self.sizes.max_token_num}*{self.sizes.hidden_dim}"
        )
