"""GPU: the README's python blocks marked ``# Needs 2 GPUs`` (the torch_compat example), each
run verbatim as a script under torchrun with one process per GPU (what the block's first line
says); tests/test_readme.py runs every other block on CPU."""

import os
import subprocess
import sys

import pytest

from tests.test_readme import REPO, gpu_blocks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("line,code", gpu_blocks(), ids=lambda v: str(v)[:12])
def test_readme_gpu_block_runs_under_torchrun(line, code, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs torch with CUDA and 2 GPUs")
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(
        code + "\nprint('README block done on rank', dist.get_rank() "
        "if dist.is_initialized() else tp_rank)\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    r = subprocess.run(
        [*torchrun, "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, f"README.md:{line} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert r.stdout.count("README block done on rank") == 2, r.stdout
