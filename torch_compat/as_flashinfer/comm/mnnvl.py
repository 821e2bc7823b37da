"""``flashinfer.comm.mnnvl``: the communicator interface FlashInfer's workspaces take
(``comm_backend=``), and its torch.distributed implementation, which vLLM and SGLang pass
(SGLang subclasses it). torch_compat exchanges over the group's c10d store and only checks
that a ``comm_backend`` describes the same group (``workspace._check_comm_backend``); the
MNNVL memory classes are absent (they need NVLink multicast, which torch_compat never uses)."""

from __future__ import annotations

from typing import Any, Protocol, Tuple, runtime_checkable

IS_TORCH_COMPAT = True


@runtime_checkable
class CommBackend(Protocol):
    """What a communicator offers (MPI's names): rank and size in the group, gathering and
    broadcasting Python objects, a barrier, and splitting into sub-groups."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def allgather(self, data: Any) -> Tuple[Any, ...]: ...

    def bcast(self, data: Any, root: int) -> Any: ...

    def barrier(self) -> None: ...

    def Split(self, color: int, key: int) -> "CommBackend": ...


class TorchDistBackend:
    """:class:`CommBackend` over a torch.distributed group (None: the default group).
    ``bcast``'s ``root`` is group-local, as MPI's is."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "TorchDistBackend needs torch.distributed: call "
                "torch.distributed.init_process_group() first"
            )
        self._group = group
        self._dist = dist

    @property
    def group(self) -> Any:
        return self._group

    def Get_rank(self) -> int:
        return self._dist.get_rank(self._group)

    def Get_size(self) -> int:
        return self._dist.get_world_size(self._group)

    def allgather(self, data: Any) -> Tuple[Any, ...]:
        gathered = [None] * self.Get_size()
        self._dist.all_gather_object(gathered, data, group=self._group)
        return tuple(gathered)

    def bcast(self, data: Any, root: int) -> Any:
        # broadcast_object_list takes a global rank; root is the group's.
        src = root if self._group is None else self._dist.get_global_rank(self._group, root)
        box = [data]
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)

    def Split(self, color: int, key: int) -> "TorchDistBackend":
        """The sub-group of the ranks with this ``color``, ordered by ``key``. Collective
        over the group; every rank creates every sub-group (torch's rule for new groups),
        then all wait at a barrier so none tears down a rendezvous a peer is still in."""
        infos = self.allgather((color, key, self._dist.get_rank()))
        colors = sorted({c for c, _, _ in infos})
        ranks = [[g for _, g in sorted((k, g) for c, k, g in infos if c == col)] for col in colors]
        mine, _ = self._dist.new_subgroups_by_enumeration(ranks)
        self.barrier()
        return TorchDistBackend(group=mine)


__all__ = ["CommBackend", "TorchDistBackend"]
