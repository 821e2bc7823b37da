"""GPU: the README's python blocks marked ``# Needs 2 GPUs``, each run verbatim under torchrun
(tests/test_readme.py runs every other block on CPU)."""

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
    done = (
        "print('README block done on rank', dist.get_rank() if dist.is_initialized() else tp_rank)"
    )
    script.write_text(code + "\n" + done + "\n")
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    r = subprocess.run(
        [*run, str(script)],
        env=dict(os.environ, PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, f"README.md:{line} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert r.stdout.count("README block done on rank") == 2, r.stdout
