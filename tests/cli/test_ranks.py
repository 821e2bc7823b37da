"""The demo's process launching (jax_fusedar/cli/ranks.py, rank_process.py): the plan for
every GPU count, each rank process's start, failing ranks, ``--bench`` on shared GPUs, and
the demo as one process per rank on CPUs (gloo) against the unsharded reference."""

import argparse
import json
import re
import subprocess
import sys
import textwrap
import time

import pytest

from jax_fusedar.cli import ranks
from jax_fusedar.common.limits import SUPPORTED_WORLD_SIZES
from tests.cli.test_cli import run_cli
from tests.cpu_devices import xla_flags


@pytest.mark.parametrize(
    "tp, processes, gpus, world, per_rank, shared",
    [
        (None, "auto", 0, 8, False, False),  # CPUs: the 8 virtual devices
        (None, "auto", 1, 2, True, True),  # one GPU: 2 ranks share it
        (None, "auto", 2, 2, False, False),  # one GPU per rank: one process
        (None, "auto", 8, 8, False, False),
        (8, "auto", 1, 8, True, True),
        (4, "auto", 2, 4, True, True),  # 4 ranks on 2 GPUs: r % 2
        (4, "auto", 8, 4, False, False),  # one process, 4 of the 8 GPUs
        (2, "per-rank", 0, 2, True, False),  # forced: ranks on CPUs
        (2, "per-rank", 4, 2, True, False),  # forced on GPUs, each its own GPU
    ],
)
def test_plan(tp, processes, gpus, world, per_rank, shared):
    p = ranks.plan(tp, processes, gpus)
    assert (p.world, p.gpus, p.per_rank, p.shared_gpus) == (world, gpus, per_rank, shared)
    assert p.platform == ("cuda" if gpus else "cpu")


def test_plan_refuses_one_process_for_more_ranks_than_gpus():
    match = r"--processes one: .*--tp 8 needs 8 GPUs where this machine has 1; use --processes auto"
    with pytest.raises(ValueError, match=match):
        ranks.plan(8, "one", 1)


@pytest.mark.parametrize("gpus, devices", [(1, [0] * 8), (2, [0, 1] * 4), (8, list(range(8)))])
def test_rank_r_drives_gpu_r_mod_gpus(gpus, devices):
    p = ranks.Plan(world=8, gpus=gpus, per_rank=True)
    assert [p.device_of(r) for r in range(8)] == devices


def test_one_process_sees_exactly_the_tp_group():
    # On CPUs the process makes exactly the TP group's devices, --tp given or not; with
    # every GPU nothing changes; ranks in processes of their own set their own.
    for args, config in [
        ((4, "auto", 8), {"jax_cuda_visible_devices": "0,1,2,3"}),
        ((4, "auto", 0), {"jax_num_cpu_devices": 4}),
        ((None, "auto", 0), {"jax_num_cpu_devices": 8}),
        ((None, "auto", 8), {}),
        ((8, "auto", 8), {}),
        ((2, "per-rank", 0), {}),
    ]:
        assert ranks.single_process_config(ranks.plan(*args)) == config, args


@pytest.mark.parametrize(
    "xla_flags, count",
    [
        ("", None),
        ("--xla_backend_optimization_level=0", None),
        ("--xla_force_host_platform_device_count=4", 4),
        ("--xla_force_host_platform_device_count=4 --xla_force_host_platform_device_count=2", 2),
        ("--xla_force_host_platform_device_count=4x", None),
    ],
)
def test_the_users_xla_flags_count_is_read(xla_flags, count):
    assert ranks.host_devices({"XLA_FLAGS": xla_flags}) == count
    assert ranks.host_devices({}) is None


def test_on_cpus_the_default_tp_is_the_users_count_else_8():
    assert ranks.plan(None, "auto", 0, host_devices=4).world == 4
    assert ranks.plan(None, "auto", 0, host_devices=None).world == 8
    assert ranks.plan(2, "auto", 0, host_devices=4).world == 2  # --tp wins
    match = r"XLA_FLAGS sets --xla_force_host_platform_device_count=3, which the demo takes "
    match += r"as its TP size on CPUs: world size 3 is not supported.*; pass --tp 2, 4, 8 or 16"
    with pytest.raises(ValueError, match=match):
        ranks.plan(None, "auto", 0, host_devices=3)


@pytest.mark.parametrize(
    "plan, line",
    [
        (None, "devices: 2 x cpu (platform cpu), world size 2"),
        (ranks.Plan(world=2, gpus=0, per_rank=True), "devices: 2 x cpu (platform cpu), world"),
        (
            ranks.Plan(world=2, gpus=1, per_rank=True),
            "devices: 2 ranks on 1 x cpu (platform cpu; the ranks share it), world size 2",
        ),
        (
            ranks.Plan(world=8, gpus=2, per_rank=True),
            "devices: 8 ranks on 2 x cpu (platform cpu; the ranks share them, rank r on GPU "
            "r % 2), world size 8",
        ),
    ],
)
def test_the_devices_line_says_when_ranks_share_gpus(plan, line):
    # (Here the devices are this test process's 8 CPU devices; the GPU test reads "2 ranks
    # on 1 x NVIDIA H200".)
    from jax_fusedar.cli import setup

    world = plan.world if plan else 2
    text = setup.describe_devices(world, "trtllm", plan)
    assert text.startswith(line.replace("world size 2", f"world size {world}")), text
    assert text.endswith(", backend trtllm: FlashInfer kernel")


@pytest.mark.parametrize(
    "platforms, sees", [(None, True), ("cpu", False), ("cuda,cpu", True), ("gpu", True)]
)
def test_jax_platforms_cpu_means_no_gpus(platforms, sees):
    env = {} if platforms is None else {"JAX_PLATFORMS": platforms}
    assert ranks.jax_sees_gpus(env) is sees


@pytest.mark.parametrize("gpus", [0, 1])
def test_rank_environment(gpus):
    parent = {"PATH": "/bin", "JAX_CUDA_VISIBLE_DEVICES": "3", "NCCL_NVLS_ENABLE": "1"}
    env = ranks.rank_env(ranks.Plan(world=8, gpus=gpus, per_rank=True), parent)
    assert env["PATH"] == "/bin"
    # 8 processes on one GPU: memory on demand, never NVLink multicast.
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    # The GPU first (the default backend), the CPU for host callbacks.
    assert env["JAX_PLATFORMS"] == ("cuda,cpu" if gpus else "cpu")
    assert "JAX_CUDA_VISIBLE_DEVICES" not in env  # a rank picks its GPU itself
    assert env.get("JAX_NUM_CPU_DEVICES") == (None if gpus else "1")


def test_rank_command_carries_the_demo_flags():
    p = ranks.Plan(world=4, gpus=1, per_rank=True)
    cmd = ranks.rank_command(p, 3, 1234, "/tmp/x", ["--steps", "2", "--moe"])
    assert cmd[:3] == [sys.executable, "-m", "jax_fusedar.cli.rank_process"]
    from jax_fusedar.cli import rank_process

    opts = rank_process.parser().parse_args(cmd[3:])
    got = (opts.rank, opts.world, opts.gpus, opts.port, opts.result_dir)
    assert got == (3, 4, 1, 1234, "/tmp/x")
    assert opts.demo_argv == ["--", "--steps", "2", "--moe"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise SystemExit(f"error: {message}")


def test_demo_bench_refuses_shared_gpus():
    args = argparse.Namespace(command="demo", tp=None, processes="auto", bench=True)
    match = r"--bench: 2 ranks would share 1 GPU: ranks sharing a GPU take turns on it"
    with pytest.raises(SystemExit, match=match):
        ranks.dispatch(args, ["demo", "--bench"], _Parser(prog="demo"), gpus=1)


def test_bad_tp_is_refused_before_anything_starts():
    r = run_cli("demo", "--tp", "3")
    assert r.returncode == 2
    assert "--tp: invalid _tp value" not in r.stderr
    assert re.search(
        r"argument --tp: world size 3 is not supported: the fused all-reduce "
        rf"kernel is built for TP groups of {', '.join(map(str, SUPPORTED_WORLD_SIZES))} ranks",
        r.stderr,
    ), r.stderr


# The launcher's handling of failing ranks: fake rank processes, no JAX.
ONE_FAILED = "rank 1 exited with 3; the end of its output:\nrank 1: something went wrong"
FAKE_RANK = textwrap.dedent("""
    import sys, time
    rank = int(sys.argv[sys.argv.index("--rank") + 1])
    mode = sys.argv[-1]
    if mode == "one_fails" and rank == 1:
        print("rank 1: something went wrong", flush=True)
        sys.exit(3)
    if mode == "one_fails":
        time.sleep(600)  # a rank left waiting for the failed one
    if mode == "pass":
        import json, pathlib
        d = sys.argv[sys.argv.index("--result-dir") + 1]
        tokens = {"scan": [1, 2] if rank != 2 or "disagree" not in sys.argv else [1, 3]}
        pathlib.Path(d, f"rank{rank}.json").write_text(json.dumps({"rank": rank,
                                                                   "tokens": tokens}))
""")


@pytest.mark.parametrize(
    "argv, code, lines",
    [
        (["one_fails"], 1, ["stopping ranks [0, 2]: another rank failed", ONE_FAILED]),
        (["pass"], 0, []),
        (["disagree", "pass"], 1, ["FAIL: the ranks decoded different tokens"]),
    ],
    ids=["a_failing_rank_stops_the_others", "ranks_that_agree", "ranks_that_disagree"],
)
def test_the_launcher_on_fake_ranks(tmp_path, monkeypatch, capsys, argv, code, lines):
    script = tmp_path / "fake_rank.py"
    script.write_text(FAKE_RANK)

    def command(p, rank, port, result_dir, demo_argv):
        return [sys.executable, script, "--rank", str(rank), "--result-dir", result_dir, *demo_argv]

    monkeypatch.setattr(ranks, "rank_command", command)
    monkeypatch.setattr(ranks, "GRACE_S", 1.0)
    monkeypatch.setattr(ranks, "STOP_WAIT_S", 2.0)
    got = ranks.launch(ranks.Plan(world=3, gpus=0, per_rank=True), argv, prog="demo")
    out = capsys.readouterr().out
    assert got == code, out
    for line in lines:
        assert line in out


# --- the demo as one process per rank on CPUs
@pytest.mark.slow
@pytest.mark.parametrize("tp, extra", [(2, ()), (4, ("--layer-mode", "scan")), (2, ("--moe",))])
def test_demo_one_process_per_rank_against_the_unsharded_reference(tp, extra):
    # The flags the CLI would set itself (8 host devices), with the CPU tests' fast compile.
    argv = ["demo", "--processes", "per-rank", "--tp", tp, *"--steps 3 --prompt 8".split()]
    r = run_cli(*argv, *extra, xla_flags=xla_flags(8))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    out = r.stdout
    assert f"over {tp} ranks, one process per rank on CPUs (gloo)" in out
    assert f"world size {tp}, backend xla" in out
    assert "'reference' = the" in out and "unsharded on one device of rank 0" in out
    assert "timings: none" in out and "tok/s" not in out
    modes = ["moe"] if "--moe" in extra else (["scan"] if "scan" in extra else ["unrolled", "scan"])
    errs = re.findall(
        r"max logits error (\S+) \(relative to max \|logits\| (\S+): (\S+); "
        r"tolerance (\S+) = eps \+ (?:sites|layers) \* \(eps \+ sqrt\(world\) \* "
        r"eps / 2\)",
        out,
    )
    assert len(errs) == len(modes)
    for _, scale, rel, tol in errs:
        assert float(scale) > 0 and 0 <= float(rel) <= float(tol)
    for mode in modes:
        assert f"PASS ({mode})" in out


@pytest.mark.slow
def test_demo_run_as_ranks_reports_a_setup_error_from_the_ranks():
    """A configuration the ranks cannot run (here a preset --moe does not have) fails in
    every rank process with the demo's own message, and the launcher exits 2."""
    argv = "demo --moe --preset llama3-8b --processes per-rank --tp 2".split()
    r = run_cli(*argv, xla_flags=None)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert (
        "error (rank 0): --moe has the presets tiny (CPUs) and small (GPUs, picked by "
        "--preset auto), not llama3-8b" in r.stderr
    )


# Put on the rank processes' PYTHONPATH: records each rank's end (its --rank, when it
# ended, whether jax.distributed.shutdown() ran) in $END_RECORD_DIR/<pid>.json.
RECORD_END = textwrap.dedent("""
    import json, os, sys, time
    import jax

    _exit, _shutdown = os._exit, jax.distributed.shutdown
    state = {"shutdown": False}

    def shutdown():
        state["shutdown"] = True
        _shutdown()

    def exit_(code):
        rank = int(sys.argv[sys.argv.index("--rank") + 1]) if "--rank" in sys.argv else None
        path = os.path.join(os.environ["END_RECORD_DIR"], f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"rank": rank, "at": time.time(), "code": code, **state}, f)
        _exit(code)

    jax.distributed.shutdown, os._exit = shutdown, exit_
""")


@pytest.mark.slow
def test_the_ranks_end_in_order_and_clean(tmp_path, monkeypatch):
    """Every rank ends after the last barrier, without JAX's shutdown, rank 0 last: JAX's PJRT
    client keeps a watch call open to rank 0's coordination service, and ended by JAX's exit
    handler, or with that service gone first, it printed a WatchTasksAsync trace after PASS."""
    site, records = tmp_path / "site", tmp_path / "records"
    site.mkdir(), records.mkdir()
    (site / "sitecustomize.py").write_text(RECORD_END)
    monkeypatch.setenv("END_RECORD_DIR", str(records))
    argv = "demo --processes per-rank --tp 2 --layer-mode scan --steps 1 --prompt 4".split()
    r = run_cli(*argv, pythonpath=[site], xla_flags=xla_flags(8))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "PASS (scan)" in r.stdout
    ends = sorted((json.loads(p.read_text()) for p in records.iterdir()), key=lambda e: e["rank"])
    assert [(e["rank"], e["code"], e["shutdown"]) for e in ends] == [(0, 0, False), (1, 0, False)]
    assert ends[0]["at"] >= ends[1]["at"], ends  # rank 0, the service's host, ends last
    assert "WatchTasksAsync" not in r.stdout + r.stderr


def test_rank_zero_waits_until_the_others_have_ended():
    """wait_gone: a process that has ended counts as gone before its parent reaps it (a
    zombie runs no more); one still running is waited for until the timeout."""
    from jax_fusedar.cli.rank_process import wait_gone

    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert wait_gone([quick.pid], 20.0)  # ended, not yet reaped: a zombie
        assert quick.poll() == 0
        t0 = time.monotonic()
        assert not wait_gone([quick.pid, slow.pid], 0.3)
        assert time.monotonic() - t0 >= 0.3
    finally:
        slow.kill()
        slow.wait()
    assert wait_gone([slow.pid], 1.0)
