#!/usr/bin/env python3
"""Fetch FlashInfer's kernel headers without installing flashinfer-python.

jax_fusedar compiles FlashInfer's header-only fused all-reduce kernel. The headers
ship inside the flashinfer-python wheel, whose dependencies (torch, CUTLASS DSL,
cuda-tile, ...) a JAX-only user does not want. This downloads the pinned wheel with
``pip download --no-deps`` and unpacks only ``flashinfer/data/include/flashinfer/**``
into ``third_party/flashinfer/include`` (git-ignored), where the build looks for it.

The CMake build runs this script itself when it finds no headers (`pip install .` is one
step; see ffi/cmake/FlashInferHeaders.cmake), so running it by hand is only needed to
fill ``third_party/`` ahead of an offline build.

Usage: python tools/fetch_flashinfer_headers.py [--wheel PATH] [--dest DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

VERSION = "0.7.2.post1"
ROOT = pathlib.Path(__file__).resolve().parent.parent
PREFIX = "flashinfer/data/include/"


def _pip_commands() -> list[list[str]]:
    """Ways to run pip, best first.

    Inside an isolated build environment (pip's or `python -m build`'s) the interpreter
    running this script may have no pip of its own; the user's pip on PATH still works,
    since `pip download` only fetches a file.
    """
    commands = [[sys.executable, "-m", "pip"]]
    for name in ("pip3", "pip"):
        found = shutil.which(name)
        if found:
            commands.append([found])
    return commands


def _download(tmp: str) -> pathlib.Path:
    spec = f"flashinfer-python=={VERSION}"
    pip = next(
        (
            c
            for c in _pip_commands()
            if subprocess.run([*c, "--version"], capture_output=True).returncode == 0
        ),
        None,
    )
    if pip is not None:
        run = subprocess.run(
            [
                *pip,
                "download",
                "--no-deps",
                "--quiet",
                "--disable-pip-version-check",
                spec,
                "-d",
                tmp,
            ],
            capture_output=True,
            text=True,
        )
        if run.returncode == 0:
            return next(pathlib.Path(tmp).glob("flashinfer_python-*.whl"))
        detail = (
            f"$ {' '.join(pip)} download --no-deps {spec}\n{(run.stderr or run.stdout).strip()}"
        )
    else:
        detail = "no working pip was found"
    raise SystemExit(
        f"could not download {spec} (offline?):\n{detail}\n\n"
        "What to do, any one of:\n"
        f"  * on a machine with network: pip download --no-deps {spec}\n"
        "    then here: python tools/fetch_flashinfer_headers.py "
        f"--wheel flashinfer_python-{VERSION}-py3-none-any.whl\n"
        "  * point FLASHINFER_INCLUDE_DIR at a directory that contains flashinfer/comm/\n"
        f"  * pip install --no-deps {spec}   (the build finds it through its metadata)\n"
        "  * build without the kernels: no nvcc on PATH and CUDACXX unset gives the "
        "reference-only package"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", help="use this flashinfer-python wheel instead of downloading")
    ap.add_argument("--dest", default=str(ROOT / "third_party" / "flashinfer"))
    args = ap.parse_args(argv)
    dest = pathlib.Path(args.dest)
    marker = dest / "VERSION"
    if marker.exists() and marker.read_text().strip() == VERSION:
        print(f"FlashInfer {VERSION} headers already in {dest}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wheel = pathlib.Path(args.wheel) if args.wheel else _download(tmp)
        n = 0
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith(PREFIX + "flashinfer/") and not name.endswith("/"):
                    target = dest / "include" / name[len(PREFIX) :]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(zf.read(name))
                    n += 1
    if n == 0:
        print(f"no headers under {PREFIX} in {wheel}", file=sys.stderr)
        return 1
    # Written last: a half-unpacked tree (an interrupted run) is fetched again.
    marker.write_text(VERSION + "\n")
    print(f"unpacked {n} FlashInfer {VERSION} headers into {dest / 'include'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
