"""What the benchmarks (``python -m benchmarks.jax_bench``, ``python -m benchmarks.torch_bench``)
share: their argument types and the check of ``--out``, the statistics of a set of timed
samples (median, p10, p90, count), a progress bar, the colours that pair a fused series
with its baseline, matplotlib figures written to files, and the JSON + plot files at the
end. Imports neither jax nor torch (numpy is the package's one dependency; tqdm and
matplotlib are optional)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

DTYPES = ("bfloat16", "float16", "float32")
MODES = ("auto", "oneshot", "twoshot")
# use_oneshot of the fused op for each --modes entry.
USE_ONESHOT = {"auto": None, "oneshot": True, "twoshot": False}


# --- arguments ---------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def int_list(text: str) -> list:
    values = [positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers")
    return sorted(set(values))


def seed(text: str) -> int:
    """A seed numpy's generators and torch's both take: an integer in [0, 2**32)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 2**32)")
    return value


def mode_list(text: str) -> list:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"modes must be a comma-separated subset of {','.join(MODES)}, got {text!r}"
        )
    return [m for m in MODES if m in modes]


def check_out_dir(path, files) -> "str | None":
    """Why results cannot be written to ``files`` in the folder ``path`` (created here if
    missing), or None. Called before anything is measured, so a bad --out costs no run."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a folder"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create the folder {out}: {e.strerror or e}"
    for name in files:
        if (out / name).is_dir():
            return f"{out / name} is a folder, so {name} cannot be written there"
    try:  # the folder exists; can we write in it?
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write_check_"):
            pass
    except OSError as e:
        return f"cannot write in the folder {out}: {e.strerror or e}"
    return None


# --- statistics ----------------------------------------------------------------------------


def summary(samples: Sequence[float]) -> dict:
    """median, p10, p90 (numpy's linear interpolation between order statistics) and the
    sample count n of a set of timings; what every table row and JSON entry reports."""
    values = np.asarray(list(samples), dtype=np.float64)
    if values.size == 0:
        raise ValueError("no samples")
    p10, median, p90 = np.percentile(values, [10, 50, 90])
    return {"median": float(median), "p10": float(p10), "p90": float(p90), "n": int(values.size)}


def spread(s: dict) -> str:
    """A summary as the tables print it: ``median [p10, p90]``."""
    return f"{s['median']:.2f} [{s['p10']:.2f}, {s['p90']:.2f}]"


# --- figures -------------------------------------------------------------------------------

# A fused series and its baseline share a colour (one per size), drawn solid and dashed.
FUSED_STYLE = "-"
BASELINE_STYLE = "--"


class _StderrBar:
    """The progress bar when tqdm is not installed: one redrawn line on stderr."""

    def __init__(self, total: int):
        self.total, self.n, self.desc = total, 0, ""

    def set_description(self, desc: str) -> None:
        self.desc = desc
        self._draw()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def close(self) -> None:
        sys.stderr.write("\n")

    def _draw(self) -> None:
        width = 30
        done = width * self.n // max(self.total, 1)
        sys.stderr.write(
            f"\r[{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} {self.desc:<40}"
        )
        sys.stderr.flush()


def progress_bar(total: int, unit: str):
    """tqdm on stderr when installed, else a one-line bar; either has set_description,
    update and close."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _StderrBar(total)
    return tqdm(total=total, unit=unit, file=sys.stderr)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (never needs a display), or None when
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def size_colours(plt, sizes) -> dict:
    """One colour per size (matplotlib's cycle), the same in every panel, so that a fused
    series and its baseline pair by colour."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {size: cycle[i % len(cycle)] for i, size in enumerate(sizes)}


def save_figure(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(
    out_dir: Path, name: str, report: dict, plot: Callable[[dict, Path], bool]
) -> None:
    """Writes ``<name>.json`` and, through ``plot`` (False: no matplotlib), ``<name>.png``
    under ``out_dir``, saying what was written."""
    json_path = Path(out_dir) / f"{name}.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {json_path}")
    png_path = Path(out_dir) / f"{name}.png"
    if plot(report, png_path):
        print(f"wrote {png_path}")
    else:
        print(
            f"note: matplotlib is not installed, so no {png_path} "
            "(pip install matplotlib to get the plot)"
        )
