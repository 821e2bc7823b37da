"""Argument types and checks of the command line (``python -m jax_fusedar``). Imports neither
jax nor torch."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")


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
    """A seed numpy's generators and JAX's keys both take: an integer in [0, 2**32)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 2**32)")
    return value


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
