"""Every ```python block of README.md runs, verbatim, in order and in one namespace, in a
fresh process with no device count set (as a reader pastes them into one interpreter of a
new shell: the README makes its 8 CPU devices itself); so do those of the docs pages in
``RUN_PAGES``, a process a page, on 8 CPU devices. A README block whose first line starts
with ``# Needs 2 GPUs`` must compile here and its ``comm.<function>(...)`` calls bind to
torch_compat's signatures (tests/gpu/test_readme.py runs it on two GPUs). A block whose first
line names a script (``# two_node.py ARGS...``) is launched by the test in ``SCRIPT_TESTS``.
"""

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_devices import FAST_COMPILE_FLAG, xla_flags
from tests.repo import REPO
from tests.skips import needs_native


README = REPO / "README.md"
# Docs pages whose python blocks run here too (each page in its own process).
RUN_PAGES = ["docs/jax_api.md", "docs/multinode.md"]
GPU_MARKER = "# Needs 2 GPUs"
SCRIPT_HEADER = re.compile(r"# (\w+\.py)\b")
# script name -> the test file (under tests/) that launches it
SCRIPT_TESTS = {"two_node.py": "jax/test_multinode.py"}


def python_blocks(page=README):
    """[(line number of the block's first code line, code)] of every ```python block."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)
    ]


def script_blocks(page=README):
    return [(n, code) for n, code in python_blocks(page) if SCRIPT_HEADER.match(code)]


def cpu_blocks(page=README):
    return [
        (n, code)
        for n, code in python_blocks(page)
        if not code.startswith(GPU_MARKER) and not SCRIPT_HEADER.match(code)
    ]


def gpu_blocks(page=README):
    return [(n, code) for n, code in python_blocks(page) if code.startswith(GPU_MARKER)]


def run_blocks(page, blocks, *, fresh_shell=False):
    """Runs the blocks in one fresh process on CPU devices; returns its stdout. With
    ``fresh_shell`` the process has no device count set (as in a new shell: the blocks must
    make their devices themselves), only the CPU tests' fast-compile flag; else 8 CPU
    devices."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=FAST_COMPILE_FLAG if fresh_shell else xla_flags(8),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    for var in ("JAX_NUM_CPU_DEVICES", "JAX_FUSEDAR_STRICT", "JAX_FUSEDAR_ALLREDUCE_BACKEND"):
        env.pop(var, None)
    r = subprocess.run(
        [sys.executable, "-c", RUNNER.replace("README.md", page)],
        input=json.dumps(blocks),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert r.returncode == 0, f"a {page} block failed:\n{r.stdout}\n{r.stderr[-6000:]}"
    ran = re.findall(r"ran README block at line (\d+)", r.stdout)
    assert [int(n) for n in ran] == [n for n, _ in blocks]
    return r.stdout


# Runs in the child: execs each block under its README line number (so a traceback points
# at the README), then reports a few facts about what the blocks computed.
RUNNER = r"""
import json, sys
import numpy as np
blocks = json.loads(sys.stdin.read())
ns = {"__name__": "__readme__"}
for line, code in blocks:
    exec(compile("\n" * (line - 1) + code, "README.md", "exec"), ns)
    print(f"ran README block at line {line}", flush=True)
facts = {}
for name in ("residual_out", "norm_out", "norm", "stream", "moe_norm"):
    if name in ns:
        a = np.asarray(ns[name]).astype(np.float32)
        facts[name] = {"shape": list(a.shape), "finite": bool(np.isfinite(a).all())}
print("FACTS " + json.dumps(facts))
"""


@pytest.mark.slow
def test_readme_python_blocks_run_in_a_fresh_shell():
    blocks = cpu_blocks()
    assert len(blocks) >= 4, "the README lost its allreduce_fusion / fuse / jit / MoE examples"
    out = run_blocks("README.md", blocks, fresh_shell=True)
    facts = json.loads(out.split("FACTS ", 1)[1])
    # The last assignment wins: the fuse block's call (x [4, 512]), and the jit block's outputs.
    assert facts["residual_out"] == facts["norm_out"] == {"shape": [4, 512], "finite": True}
    assert facts["norm"] == facts["stream"] == {"shape": [4, 32, 1024], "finite": True}
    assert facts["moe_norm"] == {"shape": [4, 512], "finite": True}


# jax_api.md's export example serves its artifact on CPU, which compiles the cuda branch's
# kernel call against its host twin: that needs the native module (exporting does not:
# tests/jax/test_export.py runs the exporting side without it).
@pytest.mark.parametrize(
    "page", [pytest.param("docs/jax_api.md", marks=needs_native), "docs/multinode.md"]
)
def test_docs_python_blocks_run_on_8_cpu_devices(page):
    blocks = cpu_blocks(REPO / page)
    if page == "docs/jax_api.md":
        assert blocks, "docs/jax_api.md lost its export example"
    for _, code in python_blocks(REPO / page):
        assert not code.startswith(GPU_MARKER), f"{page}: GPU blocks run only from the README"
    if blocks:
        run_blocks(page, blocks)


def test_gpu_blocks_compile_and_call_torch_compat_as_it_is():
    blocks = gpu_blocks()
    assert blocks, "the README's torch example is expected to be marked as needing GPUs"
    torch_compat = pytest.importorskip("torch_compat")
    checked = 0
    for line, code in blocks:
        tree = ast.parse(code, filename=f"README.md:{line}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "comm"
            ):
                fn = getattr(torch_compat, node.func.attr)  # AttributeError if renamed
                try:
                    inspect.signature(fn).bind(
                        *node.args, **{k.arg: k.value for k in node.keywords}
                    )
                except TypeError as e:
                    raise AssertionError(
                        f"README.md:{line + node.lineno - 1}: comm.{node.func.attr}: {e}"
                    ) from None
                checked += 1
    assert checked >= 2


def test_every_python_block_is_run_here_or_marked():
    """No block is silently left out: each is either executed above or carries the marker
    (and then runs on GPUs); a marker anywhere but the first line does not count."""
    for line, code in python_blocks():
        assert code.startswith(GPU_MARKER) or GPU_MARKER not in code, line
    assert len(cpu_blocks()) + len(gpu_blocks()) + len(script_blocks()) == len(python_blocks())


@pytest.mark.parametrize("page", ["README.md", *RUN_PAGES])
def test_every_script_is_launched_by_a_test(page):
    names = [SCRIPT_HEADER.match(code).group(1) for _, code in script_blocks(REPO / page)]
    if page == "docs/multinode.md":
        assert names, "docs/multinode.md lost its two-node script"
    for name in names:
        assert name in SCRIPT_TESTS, f"{page} script {name} is run by no test"
        test_file = Path(__file__).parent / SCRIPT_TESTS[name]
        assert f"# {name}" in test_file.read_text(), f"{test_file.name} does not launch {name}"
