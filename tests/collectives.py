"""The collectives of a lowered or compiled program, read from its text (StableHLO for the CPU
tests, the compiled HLO for the GPU tests; no JAX imported): each op with the element type
and shape of every array it produces, so that a test can compare what two programs move
(count, element types, bytes). A collective's bytes are those of its results (a
reduce-scatter's shards, an all-gather's gathered arrays), the same measure for both."""

from __future__ import annotations

import dataclasses
import math
import re

# StableHLO op names and their HLO spellings (an async pair counts once, at its start).
COLLECTIVES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "collective_permute": "collective-permute",
    "collective_broadcast": "collective-broadcast",
}

# Bytes per element, by size; StableHLO and HLO spellings of each type.
ELEMENT_BYTES = {
    **dict.fromkeys(["f64", "i64", "s64"], 8),
    **dict.fromkeys(["f32", "i32", "s32"], 4),
    **dict.fromkeys(["bf16", "f16", "i16", "s16"], 2),
    **dict.fromkeys(["f8E4M3FN", "f8E5M2", "f8e4m3fn", "f8e5m2", "i8", "ui8", "s8", "u8"], 1),
    **dict.fromkeys(["i1", "pred"], 1),
}


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # the StableHLO name (COLLECTIVES' keys)
    arrays: tuple  # ((element type, shape), ...) of its results

    @property
    def bytes(self) -> int:
        return sum(ELEMENT_BYTES[t] * math.prod(s) for t, s in self.arrays)

    @property
    def element_types(self) -> tuple:
        return tuple(sorted({t for t, _ in self.arrays}))


_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-zA-Z][\w]*)>")
# "stablehlo.all_reduce"(%x) ... ({ region }) : (operand types) -> result types
_STABLEHLO_OP = re.compile(r'"?stablehlo\.(' + "|".join(COLLECTIVES) + r')"?[ (]', re.MULTILINE)


def _stablehlo_results(text: str, start: int) -> str:
    """The result types of the op that starts at ``start``: what follows the first ``->``
    after its signature's ``) : (`` (past its region, if any), up to the end of the line."""
    sig = text.index(" : (", start)
    arrow = text.index("->", sig)
    end = text.find("\n", arrow)
    return text[arrow + 2 : end if end >= 0 else len(text)]


def stablehlo_collectives(text: str) -> list:
    """Every collective of a StableHLO module's text, in order."""
    found = []
    for m in _STABLEHLO_OP.finditer(text):
        results = _stablehlo_results(text, m.start()).split(" loc(")[0]
        arrays = tuple(
            (dtype, tuple(int(d) for d in dims.split("x") if d))
            for dims, dtype in _TENSOR.findall(results)
        )
        found.append(Collective(m.group(1), arrays))
    return found


_HLO_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HLO_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s("
    + "|".join(re.escape(v) for v in COLLECTIVES.values())
    + r")(-start)?\(",
    re.MULTILINE,
)
_HLO_NAMES = {v: k for k, v in COLLECTIVES.items()}


def hlo_collectives(text: str) -> list:
    """Every collective of a compiled HLO module's text (``Compiled.as_text()``), in order;
    an async ``-start`` / ``-done`` pair counts once (its start), a start's tuple result of
    (operands, results) counts its results only."""
    found = []
    for m in _HLO_OP.finditer(text):
        shapes = [
            (t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _HLO_SHAPE.findall(m.group(1))
        ]
        if m.group(3) and m.group(2) != "all-reduce" and len(shapes) % 2 == 0 and shapes:
            # e.g. all-gather-start: ((operands), (results)): the second half
            shapes = shapes[len(shapes) // 2 :]
        found.append(Collective(_HLO_NAMES[m.group(2)], tuple(shapes)))
    return found


def summary(collectives) -> dict:
    """op -> {"count", "bytes", "element_types"} over ``collectives``."""
    out = {}
    for c in collectives:
        s = out.setdefault(c.op, {"count": 0, "bytes": 0, "element_types": set()})
        s["count"], s["bytes"] = s["count"] + 1, s["bytes"] + c.bytes
        s["element_types"] |= set(c.element_types)
    return {op: dict(s, element_types=sorted(s["element_types"])) for op, s in out.items()}


def costlier(program, baseline) -> list:
    """What ``program`` (a summary) moves beyond ``baseline`` (a summary): per collective
    op, more calls, more bytes or an element type the baseline does not use; empty when the
    program is at most as costly."""
    problems = []
    for op, s in program.items():
        b = baseline.get(op, {"count": 0, "bytes": 0, "element_types": []})
        if s["count"] > b["count"]:
            problems.append(f"{op}: {s['count']} calls > {b['count']}")
        if s["bytes"] > b["bytes"]:
            problems.append(f"{op}: {s['bytes']} bytes > {b['bytes']}")
        extra = sorted(set(s["element_types"]) - set(b["element_types"]))
        if extra:
            problems.append(f"{op}: element types {extra} beyond {b['element_types']}")
    return problems
