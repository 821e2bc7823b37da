"""Prints the integration lane's table (markdown, for docs/fusion_pass.md: what lane.measure
measures, a row a model). Run in the lane's venv: ``tools/integration.sh table``
(``python -m tests.integration.table [--json FILE]``)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys

from tests.cpu_devices import use_host_devices

use_host_devices()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip() or "-"
    except OSError:
        return "-"


def _fused(v) -> str:
    text = f"{v.fused} of {v.found}"
    if v.found_in_program != v.found:
        text += f" ({v.fused_in_program} of {v.found_in_program} in the program)"
    return text


def _why(v) -> str:
    parts = [f"{n} x {r}" for r, n in v.reasons.items()]
    parts += [f"{n} x rounding change: {r}" for r, n in v.rounding_changes.items()]
    return "; ".join(parts) or ("no site found" if not v.found else "-")


def _diff(v) -> str:
    if not v.fused:
        return "-"
    fwd = "bit-identical" if v.forward_bits_equal else f"{v.forward_rel:.2f}"
    grad = "-" if v.grad_rel is None else f"{v.grad_rel:.2f}"
    return f"{fwd} / {grad}"


def markdown(rows) -> str:
    import jax

    head = (
        f"{datetime.date.today().isoformat()}, commit {_commit()}, JAX {jax.__version__}, "
        f"Python {platform.python_version()}, 8 CPU devices, {platform.machine()}, "
        f"XLA_FLAGS `{os.environ.get('XLA_FLAGS', '')}`"
    )
    lines = [
        head,
        "",
        "| model | package | counted | fused (default) | reasons (default) | "
        "fused (`allow_rounding_change`) | reasons / rounding changes | forward / grad "
        "(eps_T, flag) | analysis ms (default, flag) | lower + compile s: original, fused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d, f = r.default, r.rounding
        lines.append(
            f"| {r.model} | {r.package} {r.version} | {r.counted} | {_fused(d)} | {_why(d)} | "
            f"{_fused(f)} | {_why(f)} | {_diff(f)} | "
            f"{d.analysis_s * 1e3:.0f}, {f.analysis_s * 1e3:.0f} | "
            f"{r.original_lower_compile_s:.2f}, {d.lower_compile_s:.2f} |"
        )
    lines += ["", "How the sites are counted:", ""]
    lines += [f"- {r.model}: {r.how_counted}." for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the measurements to this file")
    parser.add_argument("--only", help="the models whose name contains this")
    args = parser.parse_args(argv)
    from .lane import measure
    from .models import MODELS

    rows = [measure(m) for m in MODELS if not args.only or args.only in m.name]
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
