"""How the benchmarks (``python -m jax_fusedar bench``, ``python -m torch_compat.bench``)
report: a progress bar, matplotlib figures written to files, and the JSON + plot files at the
end. Imports neither jax nor torch (tqdm and matplotlib are optional)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable


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
