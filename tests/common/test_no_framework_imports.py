"""The framework-neutral layer stays neutral: every ``jax_fusedar.common`` module (and the
jax-free command-line helpers) imports in a fresh interpreter without importing jax or torch,
and ``import torch_compat`` brings in torch but never jax. Checked in subprocesses, because a
test process has usually imported both already."""
import json
import os
import pkgutil
import subprocess
import sys

import pytest

import jax_fusedar.common

from tests.repo import REPO


COMMON_MODULES = sorted(f"jax_fusedar.common.{m.name}"
                        for m in pkgutil.iter_modules(jax_fusedar.common.__path__))
# The command-line pieces the torch benchmark shares (python -m jax_fusedar's own entry point
# must not start JAX either: it sets XLA_FLAGS before JAX reads them).
JAX_FREE_CLI = ["jax_fusedar.cli.argtypes", "jax_fusedar.cli.report", "jax_fusedar.cli.main"]


def _imported_after(modules):
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_the_common_layer_is_all_there():
    # A module added to common/ is checked below automatically; this guards the listing.
    names = {m.rsplit(".", 1)[1] for m in COMMON_MODULES}
    assert {"arguments", "backend_choice", "call_check", "exchange", "join", "launch_mode",
            "lifecycle", "limits", "native", "patterns", "quant_layouts", "results", "sizing",
            "tp_groups"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("module", COMMON_MODULES + JAX_FREE_CLI)
def test_module_imports_neither_jax_nor_torch(module):
    roots = _imported_after([module])
    assert module.split(".")[0] in roots  # it did import
    assert not roots & {"jax", "jaxlib", "torch"}, sorted(roots & {"jax", "jaxlib", "torch"})


@pytest.mark.slow
def test_torch_compat_imports_no_jax():
    pytest.importorskip("torch")
    roots = _imported_after(["torch_compat", "torch_compat.bench"])
    assert "torch" in roots
    assert not roots & {"jax", "jaxlib"}
