"""``python -m jax_fusedar``: a bad JAX_FUSEDAR_* variable ends the run with one ``error:``
line naming it (exit 2) before any work, whichever the variable and the command (before,
``JAX_FUSEDAR_STRICT=maybe ... bench`` started timing and died with a traceback at the
first traced call)."""

import pytest

from tests.cli.test_cli import refused, run_cli
from tests.common.test_environment import BAD

COMMANDS = {
    "demo": ["demo", "--steps", "1", "--prompt", "4", "--iters", "1"],
    "demo-bench": ["demo", "--bench", "--bench-batches", "1", "--bench-kv", "16"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("var,value,message", BAD)
def test_a_bad_variable_is_one_error_line_before_any_work(
    monkeypatch, tmp_path, command, var, value, message
):
    for other, _, _ in BAD:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, value)
    r = run_cli(*COMMANDS[command], "--out", tmp_path / "out", timeout=300)
    refused(r, message)
    assert r.stderr.startswith("python -m jax_fusedar: error: "), r.stderr
    assert not (tmp_path / "out").exists()  # nothing was set up, not even the --out folder


def test_help_is_still_shown(monkeypatch):
    monkeypatch.setenv("JAX_FUSEDAR_STRICT", "maybe")
    r = run_cli("demo", "--help", timeout=300)
    assert r.returncode == 0 and "--preset" in r.stdout, r.stdout + r.stderr
