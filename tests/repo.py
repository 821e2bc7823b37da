"""The repository's root, for tests that start processes in it (``python -m tests.gpu...``,
``python -m jax_fusedar``) or read its files. One definition: a test module that computes
the root from its own path breaks when it moves between test folders (it did once, in the
GPU tests, where no CPU run could notice); tests/test_repo_root.py keeps it the only one."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_code(code: str, timeout: float = 300, **env: str):
    """``python -c code`` in the repository root with the checkout first on PYTHONPATH (a
    fresh interpreter: what it imports is its own) and the environment variables ``env``
    added; the completed process, text captured."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO), **env)
    cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=timeout)
