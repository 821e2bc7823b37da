"""What the fusion pass reports: one :class:`Site` per all-reduce (or plain-jit matmul) it
met, fused or not with the reason, gathered in a :class:`FusionReport`."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Optional

# Site kinds: where the reduction comes from.
PSUM = "psum"  # psum inside the scope of the add and the norm
PSUM_IN_SHARD_MAP = "shard_map psum"  # psum inside a shard_map, add + norm after it
REDUCE_SCATTER = "reduce_scatter"  # psum_scatter + add + all_gather (sequence parallel)
CUSTOM_RULE_PSUM = "custom_vjp psum"  # psum inside a custom_vjp / custom_jvp
PLAIN_JIT_MATMUL = "dot_general"  # plain jit: the partitioner's all-reduce


class Reject(Exception):
    """A candidate site that is not fused; the message is the reported reason. ``late``:
    raised once the residual add after the all-reduce was found (the reason then describes
    a site, and wins over another candidate's "not followed by a residual add")."""

    def __init__(self, reason: str, late: bool = False):
        super().__init__(reason)
        self.late = late


@dataclasses.dataclass(frozen=True)
class Site:
    """One reduction met by the pass. ``where``: the path of wrappers around it (e.g.
    ``jit(model)/shard_map/scan``). ``kind``: how the sum is formed (see the constants
    above). ``reason``: why it was not fused (None when fused); ``rounding_change``: what
    rounds differently from the original, for sites fused only because
    ``allow_rounding_change`` was set; ``note``: what of the site stays unfused (e.g. an FP8
    tail the kernel does not compute the same way)."""

    where: str
    fused: bool
    reason: Optional[str]
    kind: str = PSUM
    pattern: Optional[int] = None
    tokens: Optional[int] = None
    hidden: Optional[int] = None
    dtype: Optional[str] = None
    rms_eps: Optional[float] = None
    rounding_change: Optional[str] = None
    weight_bias: Optional[float] = None  # 1.0 for Gemma's (1 + gamma)
    runs: Optional[int] = 1  # times it runs per call (scan lengths multiplied; None: a while loop)
    note: Optional[str] = None


NO_SITES_ADVICE = (
    "no all-reduce (psum / psum_scatter) and no matmul (dot_general) followed by a residual "
    "add and an RMSNorm were found: fuse rewrites psum + add + RMSNorm inside shard_map and, "
    "under plain jax.jit with shardings, dot_general + add + RMSNorm (the partitioner's "
    "all-reduce); docs/fusion_pass.md lists the forms"
)


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A reduction or matmul that no site was found for, listed when nothing fused: where it
    is, the op (``psum``, ``reduce_scatter``, ``dot_general``) and its output shape, the ops
    that read its result (value-preserving ones looked through), and what stopped the
    match."""

    where: str
    op: str
    shape: tuple
    followed_by: tuple
    reason: str

    def line(self) -> str:
        after = ", ".join(self.followed_by) or "nothing"
        return f"{self.op} {list(self.shape)} at {self.where}, then {after}: {self.reason}"


NEAR_MISSES_SHOWN = 4  # in report.line(); report.near_misses has them all


@dataclasses.dataclass
class FusionReport:
    sites: list
    near_misses: list = dataclasses.field(default_factory=list)
    # Seconds the pass took at this trace: analysis and workspace plan, the creation of the
    # workspaces, and the re-trace of the rewritten program (not the trace of the function
    # itself); of which analysis_s the first and allocate_s the second. They are apart
    # because creating a kernel workspace is a collective among the ranks' processes (the
    # peers' memory handles are exchanged), whose time is the slowest rank's, not the
    # analysis's.
    pass_s: float = 0.0
    analysis_s: float = 0.0
    allocate_s: float = 0.0

    @property
    def fused(self) -> list:
        return [s for s in self.sites if s.fused]

    @property
    def not_fused(self) -> list:
        return [s for s in self.sites if not s.fused]

    def fused_runs(self) -> Optional[int]:
        """Fused calls per run of the function (scan bodies count their length; every cond
        branch counts, so an upper bound there), or None when one sits in a while loop."""
        runs = [s.runs for s in self.fused]
        return None if any(r is None for r in runs) else sum(runs)

    def reasons(self) -> Counter:
        """{reason: number of sites} of the sites left unfused."""
        return Counter(s.reason for s in self.not_fused)

    def line(self) -> str:
        """vLLM-style one-line summary."""
        text = (
            f"jax_fusedar.fuse: fused {len(self.fused)} of {len(self.sites)} all-reduce + "
            f"residual + RMSNorm site(s)"
        )
        if not self.sites:
            return f"{text}: {NO_SITES_ADVICE}{self._near_misses_text()}"
        runs = self.fused_runs()
        if runs is not None and runs != len(self.fused):
            text += f" ({runs} fused calls per run, loops counted)"
        if self.not_fused:
            text += "; not fused: " + "; ".join(f"{n} x {r}" for r, n in self.reasons().items())
        if not self.fused:
            text += self._near_misses_text()
        return text

    def _near_misses_text(self) -> str:
        if not self.near_misses:
            return ""
        shown = self.near_misses[:NEAR_MISSES_SHOWN]
        more = len(self.near_misses) - len(shown)
        text = "; near misses: " + "; ".join(n.line() for n in shown)
        return text + (f"; and {more} more (report.near_misses)" if more else "")

    def as_dict(self) -> dict:
        return {
            "fused": len(self.fused),
            "sites": [dataclasses.asdict(s) for s in self.sites],
            "near_misses": [dataclasses.asdict(n) for n in self.near_misses],
            "pass_s": self.pass_s,
            "analysis_s": self.analysis_s,
            "allocate_s": self.allocate_s,
        }
