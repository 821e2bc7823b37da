#!/usr/bin/env python3
"""Fetch FlashInfer's kernel headers without installing flashinfer-python.

jax_fusedar compiles FlashInfer's header-only fused all-reduce kernel. The headers
ship inside the flashinfer-python wheel, whose dependencies (torch, CUTLASS DSL,
cuda-tile, ...) a JAX-only user does not want. This downloads the pinned wheel with
``pip download --no-deps`` and unpacks only ``flashinfer/data/include/flashinfer/**``
into ``third_party/flashinfer/include`` (git-ignored), where the build looks for it.

Usage: python tools/fetch_flashinfer_headers.py [--wheel PATH] [--dest DIR]
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile
import zipfile

VERSION = "0.7.2.post1"
ROOT = pathlib.Path(__file__).resolve().parent.parent
PREFIX = "flashinfer/data/include/"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", help="use this flashinfer-python wheel instead of downloading")
    ap.add_argument("--dest", default=str(ROOT / "third_party" / "flashinfer"))
    args = ap.parse_args()
    dest = pathlib.Path(args.dest)
    marker = dest / "VERSION"
    if marker.exists() and marker.read_text().strip() == VERSION:
        print(f"FlashInfer {VERSION} headers already in {dest}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            subprocess.check_call(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                 f"flashinfer-python=={VERSION}", "-d", tmp])
            wheel = str(next(pathlib.Path(tmp).glob("flashinfer_python-*.whl")))
        n = 0
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith(PREFIX + "flashinfer/") and not name.endswith("/"):
                    target = dest / "include" / name[len(PREFIX):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(name))
                    n += 1
    if n == 0:
        print(f"no headers under {PREFIX} in {wheel}", file=sys.stderr)
        return 1
    marker.write_text(VERSION + "\n")
    print(f"unpacked {n} FlashInfer {VERSION} headers into {dest / 'include'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
