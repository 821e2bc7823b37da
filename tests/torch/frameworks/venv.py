"""The framework venv: vLLM and SGLang pinned (requirements.txt), installed ``--no-deps`` into
a venv whose ``.pth`` adds this interpreter's site-packages (torch, transformers, pytest):
the test venv is untouched, torch not downloaded again. Kept in ``build/framework-venv`` (or
``$JAX_FUSEDAR_FRAMEWORK_VENV``), remade when requirements.txt changes."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import site
import subprocess
import sys

from tests.repo import REPO

HERE = pathlib.Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"


def _digest() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes() + sys.executable.encode()).hexdigest()


def framework_python() -> pathlib.Path:
    """The venv's interpreter, made (or remade) as needed; test processes running at once
    (pytest-xdist) wait for the one that makes it."""
    root = pathlib.Path(
        os.environ.get("JAX_FUSEDAR_FRAMEWORK_VENV", REPO / "build" / "framework-venv")
    )
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make(root)


def _make(root: pathlib.Path) -> pathlib.Path:
    python = root / "bin" / "python"
    stamp = root / "requirements.sha256"
    if python.exists() and stamp.exists() and stamp.read_text() == _digest():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    purelib = purelib.stdout.strip()
    # The test venv's packages, after the framework venv's own.
    paths = [p for p in site.getsitepackages() if os.path.isdir(p)]
    pathlib.Path(purelib, "test_venv.pth").write_text("\n".join(paths) + "\n")
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "-r", REQUIREMENTS]
    subprocess.run(list(map(str, pip)), check=True)
    stamp.write_text(_digest())
    return python


def run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs ``script`` (a file beside this one) in the framework venv from the checkout's
    root, so torch_compat is the checkout's."""
    argv, env = (
        [str(framework_python()), str(HERE / script), *args],
        dict(os.environ, PYTHONPATH=str(REPO)),
    )
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
