"""Every import of the project's own modules inside tests resolves, including the ones
inside functions. The GPU workers import lazily (inside the worker functions, which run only
on GPU machines), so a module that moved breaks them only there: a JAX timeout worker still
imported ``tests.oracle`` after the oracles moved to ``tests.oracles``. Resolved here
statically, with ast, without running any worker."""

import ast
import importlib
import importlib.util

import pytest

from tests.cpu_devices import use_host_devices
from tests.repo import REPO

OURS = ("tests", "jax_fusedar", "torch_compat")
# Resolving imports runs test modules of tests/jax, which need the 8 CPU devices their
# conftest.py sets up (pytest does not load it when this file runs alone).
use_host_devices()


def _own_imports():
    for path in sorted((REPO / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and node.module.split(".")[0] in OURS
            ):
                for alias in node.names:
                    yield path, node.lineno, node.module, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in OURS:
                        yield path, node.lineno, alias.name, None


def _resolves(module: str, name) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    if name is None or name == "*":
        return True
    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return True
    # A submodule not yet imported (only packages have them).
    return hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}") is not None


def test_every_own_import_in_the_tests_resolves():
    pytest.importorskip("jax")
    # The optional front ends, left out where their framework is not installed.
    optional = {
        "torch_compat": "torch",
        "jax_fusedar.flax": "flax",
        "jax_fusedar.equinox": "equinox",
    }
    skip = [ours for ours, dep in optional.items() if importlib.util.find_spec(dep) is None]
    broken = []
    for path, line, module, name in _own_imports():
        if any(module == s or module.startswith(s + ".") for s in skip):
            continue
        try:
            ok = _resolves(module, name)
        except ImportError:
            ok = False
        if not ok:
            what = f"from {module} import {name}" if name else f"import {module}"
            broken.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not broken, "imports that no longer resolve:\n" + "\n".join(broken)
