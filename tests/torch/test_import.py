"""Importing torch_compat: without torch it says what to install; with torch it costs little
more than torch itself (inductor, which takes about as long again, is imported only when
the fusion pass is used with it)."""

import statistics

import pytest

from tests.repo import run_code

# A finder that refuses torch and its submodules, as an environment without torch would.
NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
"""


def test_without_torch_the_error_names_the_extra():
    # The framework-neutral layer still imports.
    result = run_code(
        NO_TORCH + "try:\n    import torch_compat\nexcept ImportError as e:\n"
        "    print(type(e).__name__, e)\nimport jax_fusedar.common.patterns\nprint('common ok')\n"
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.startswith("ImportError torch_compat needs PyTorch: "), first
    assert "pip install 'jax_fusedar[torch]'" in first
    assert second == "common ok"


TIMED = "import time; t = time.perf_counter(); import {mod}; print(time.perf_counter() - t)"


@pytest.mark.slow
def test_import_costs_under_1_3x_import_torch():
    # Fresh interpreters, alternating, so both see the same load on a shared machine; the
    # median of each is compared (one slow start does not decide).
    times = {"torch": [], "torch_compat": []}
    for _ in range(5):
        for mod in times:
            result = run_code(TIMED.format(mod=mod))
            assert result.returncode == 0, result.stderr
            times[mod].append(float(result.stdout.split()[-1]))
    t_torch, t_ours = (statistics.median(times[m]) for m in ("torch", "torch_compat"))
    assert t_ours < 1.3 * t_torch, times
    code = "import sys, torch_compat; print(sorted(m for m in sys.modules if 'inductor' in m))"
    assert "torch._inductor" not in run_code(code).stdout
