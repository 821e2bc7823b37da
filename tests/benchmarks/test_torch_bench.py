"""CPU tests of ``python -m benchmarks.torch_bench``, of the anchor loader
(tools/flashinfer_anchor.py) and of the anchor comparison's plumbing (tests/gpu/anchor.py,
tests/gpu/workers/anchor_compare.py). No GPU: stand-ins for the CUDA parts (a fake runtime,
fake ``allreduce_fusion``s doing the kernel's math in numpy, a fake anchor folder); process
spawning and the gloo agreement run for real."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install '.[torch]')")

from benchmarks import report  # noqa: E402
from benchmarks import torch_bench as bt  # noqa: E402
from jax_fusedar.common import plan as rules  # noqa: E402
from tools import flashinfer_anchor as fa  # noqa: E402

from tests.cpu_devices import run_module  # noqa: E402
from tests.gpu import anchor  # noqa: E402
from tests.gpu.harness import bound_problems, draw_case  # noqa: E402
from tests.gpu.workers import anchor_compare as ac  # noqa: E402
from tests.repo import REPO, run_code  # noqa: E402

TIMEOUT_COMPARE = "--timeout-compare --no-anchor --no-nccl --no-symm-mem --no-fp8"


# --- arguments and the CLI hook --------------------------------------------------------------


def test_options_and_the_variants_they_time():
    a = bt.parse_args([])  # the requested sweep
    assert a.tokens == [1, 16, 128, 1024, 4096] and a.hidden == [4096, 8192]
    assert a.dtype == "bfloat16" and a.world == 2 and a.timeout_compare is False
    assert a.iters >= 1 and a.repeats >= 1 and not a.no_anchor
    assert bt.variant_keys(a) == [
        f"{i}:{h}" for i in bt.IMPLS if i != "ours_no_timeout" for h in ("eager", "graph")
    ]  # that one: --timeout-compare
    assert "ours_no_timeout" not in " ".join(bt.variant_keys(a))
    a = bt.parse_args(
        "--tokens 16,1,16 --hidden 1024 --dtype float16 --world 4 "
        "--no-graph --no-fp8 --no-nccl --no-anchor".split()
    )
    assert a.tokens == [1, 16] and a.hidden == [1024] and a.world == 4
    assert bt.variant_keys(a) == ["ours:eager", "symm_mem:eager"]
    a = bt.parse_args(TIMEOUT_COMPARE.split())
    assert a.timeout_compare is True and ("ours", "ours_no_timeout") in bt.RATIOS
    keys = "ours:eager ours:graph ours_no_timeout:eager ours_no_timeout:graph"
    assert bt.variant_keys(a) == keys.split()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--world", "3"], "world size 3"),
        (["--hidden", "4100"], "multiple of 8"),
        (["--hidden", "4100", "--dtype", "float32"], "--hidden 4100: hidden_dim=4100 cannot"),
        (["--tokens", "0"], "not positive"),
        (["--framework", "jax"], "unrecognized arguments: --framework"),
        (["--seed", "-5"], "argument --seed: -5 is not in"),
        (["--modes", "threeshot"], "argument --modes"),
    ],
)
def test_bad_arguments_are_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bt.parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.slow
def test_command_without_gpu_says_so(monkeypatch):
    monkeypatch.setenv("JAX_FUSEDAR_ANCHOR", str(REPO / "no-such"))
    r = run_module("benchmarks.torch_bench", "--tokens", 1, "--hidden", 1024, timeout=300)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs CUDA GPUs" in r.stderr and "JAX_FUSEDAR_ANCHOR" in r.stderr
    assert "FlashInfer anchor unavailable: no anchor folder at" in r.stderr


@pytest.mark.slow
def test_torch_bench_path_imports_no_jax():
    code = "import sys; from benchmarks import torch_bench; torch_bench.parse_args([])"
    r = run_code(code + "; print('jax' in sys.modules)", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


# --- plan, report, table, plot ---------------------------------------------------------------


def test_plan_uses_the_ops_own_policy_and_one_workspace():
    sizes, cases = bt.plan_cases([1, 16, 128, 1024, 4096], [4096, 8192], "bfloat16", 2)
    assert (sizes.max_token_num, sizes.hidden_dim) == (4096, 8192)
    assert [(c.tokens, c.hidden) for c in cases] == [
        (m, h) for h in (4096, 8192) for m in (1, 16, 128, 1024, 4096)
    ]
    for c in cases:
        call = rules.Call(rules.DENSE_RULE, c.tokens, c.hidden, "bfloat16", sizes)
        assert c.oneshot == (rules.kernel_choice(call) == "oneshot")
        assert c.mode == ("oneshot" if c.oneshot else "twoshot") and not c.skipped
    assert cases[0].mode == "oneshot"  # 1 token: two-shot cannot run


def _rank_result(rank, scale):
    cases = []
    for tokens, mode in ((1, "oneshot"), (1024, "twoshot")):
        us = {
            "ours:eager": [10.0 * scale, 11.0 * scale, 12.0 * scale],
            "anchor:eager": [20.0, 21.0, 22.0],
            "nccl:eager": [40.0, 40.0, 40.0],
            "ours:graph": [5.0, 5.0, 5.0],
            "anchor:graph": [5.0, 6.0, 7.0],
        }
        skipped = dict.fromkeys(["symm_mem:eager", "symm_mem:graph"], "symm reason")
        skipped["nccl:graph"] = "capture failed: X"
        if rank == 1 and tokens == 1024:
            del us["anchor:graph"]  # timed on one rank only
        case = {"tokens": tokens, "hidden": 4096, "mode": mode}
        cases.append(dict(case, us_repeats=us, skipped=skipped))
    return {"rank": rank, "cases": cases, "notes": {"ours_workspace": "ws"}}


def _report(scale1=1.0, anchor=None, ranks=None, **kw):
    """The report of two ranks' results (rank 1's eager times ``scale1`` times rank 0's), with
    the arguments ``kw`` changed."""
    args = bt.parse_args(["--tokens", "1,1024", "--hidden", "4096", "--no-fp8"])
    vars(args).update(kw)
    ranks = ranks or [_rank_result(0, 1.0), _rank_result(1, scale1)]
    return bt.build_report(ranks, args, {"device_name": "fake", "torch": "x"}, anchor or {})


def test_report_takes_the_slowest_ranks_median_and_ratios():
    rep = _report(2.0, anchor={"requested": True, "path": "/a", "problem": None})
    json.dumps(rep)  # serializable
    (c0, c1), e = rep["cases"], "ours:eager"
    # Rank 1's median 22 > rank 0's 11; the slowest rank's samples give the spread.
    assert (c0["us"][e], c0["us_per_rank"][e], c0["slowest_rank"][e]) == (22.0, [11.0, 22.0], 1)
    assert c0["stats"][e] == report.summary([20.0, 22.0, 24.0])
    assert c0["stats"][e]["n"] == 3 and c0["stats"][e]["p90"] == 23.6
    assert c0["us"]["anchor:graph"] == 6.0 and c0["us_repeats"][e][1] == [20.0, 22.0, 24.0]
    ratios = {"ours/anchor:eager": 22.0 / 21.0, "ours/nccl:eager": 22.0 / 40.0}
    ratios["ours/anchor:graph"] = 5.0 / 6.0
    assert {k: c0["ratios"][k] for k in ratios} == pytest.approx(ratios)
    assert "ours/symm_mem:eager" not in c0["ratios"]
    assert c0["skipped"]["symm_mem:eager"] == "symm reason"
    assert "anchor:graph" not in c1["us"]
    assert c1["skipped"]["anchor:graph"] == "not timed on every rank"
    assert rep["config"]["fp32_acc"] is True and rep["config"]["world_size"] == 2


def test_table_lists_times_ratios_and_skip_reasons():
    lines = bt.format_table(_report()).splitlines()
    assert lines[0].startswith("[eager]") and any(x.startswith("[graph]") for x in lines)
    # A row per case and variant: median [p10, p90] of the slowest rank, its sample count.
    eager = lines[: next(i for i, x in enumerate(lines) if x.startswith("[graph]"))]
    rows = {tuple(x.split()[:4]): x.split()[4:] for x in eager if x.split()[:2] == ["1", "4096"]}
    case = ("1", "4096", "oneshot")
    assert rows[(*case, "ours")] == ["11.00", "[10.20,", "11.80]", "3"]
    assert rows[(*case, "anchor")] == ["21.00", "[20.20,", "21.80]", "3"]
    assert rows[(*case, "nccl")] == ["40.00", "[40.00,", "40.00]", "3"]
    assert (*case, "symm_mem") not in rows  # skipped
    # Then the ratios of the medians.
    cells = next(
        x.split() for x in eager if x.split()[:3] == list(case) and x.split()[3] not in bt.IMPLS
    )
    assert cells[3] == f"{11 / 21:.3f}" and cells[4] == f"{11 / 40:.3f}" and cells[5] == "-"
    assert any("symm reason" in x and "symm_mem:eager" in x for x in lines)
    assert any("capture failed: X" in x for x in lines)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    assert bt.plot(_report(), tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_pairs_ours_and_each_baseline_by_colour(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    figures = []
    monkeypatch.setattr(report, "save_figure", lambda plt, fig, path: figures.append(fig))
    ranks = [_rank_result(0, 1.0), _rank_result(1, 1.0)]
    for r in ranks:  # a second hidden size, so that the sizes need colours of their own
        r["cases"] += [dict(c, hidden=8192) for c in r["cases"]]
    assert bt.plot(_report(ranks=ranks, hidden=[4096, 8192]), tmp_path / "b.png")
    (fig,) = figures
    titles = [ax.get_title() for ax in fig.axes]
    assert "eager: ours vs anchor" in titles and "eager: ours vs nccl" in titles
    ax = fig.axes[titles.index("eager: ours vs anchor")]
    lines = {line.get_label(): line for line in ax.get_lines()}
    colours = set()
    for hidden in (4096, 8192):
        ours, anchor = lines[f"ours, hidden {hidden}"], lines[f"anchor, hidden {hidden}"]
        assert ours.get_color() == anchor.get_color()
        assert (ours.get_linestyle(), anchor.get_linestyle()) == ("-", "--")
        colours.add(ours.get_color())
    assert len(colours) == 2


def test_the_table_shows_the_timeouts_on_off_ratio():
    a = bt.parse_args(f"{TIMEOUT_COMPARE} --tokens 16 --hidden 4096".split())
    us = {"ours:eager": [10.0, 10.2], "ours:graph": [6.0]}
    us |= {"ours_no_timeout:eager": [10.0], "ours_no_timeout:graph": [6.0]}
    case = {"tokens": 16, "hidden": 4096, "mode": "oneshot", "policy": "auto"}
    rank = {"cases": [dict(case, us_repeats=us, skipped={})]}
    rep = bt.build_report([rank, rank], a, {}, {})
    c = rep["cases"][0]
    assert c["ratios"]["ours/ours_no_timeout:eager"] == pytest.approx(10.1 / 10.0)
    assert c["ratios"]["ours/ours_no_timeout:graph"] == pytest.approx(1.0)
    table = bt.format_table(rep)
    assert "on/off" in table and "1.010" in table and "1.000" in table


# --- the per-rank driver with a fake runtime --------------------------------------------------


class FakeRuntime:
    def __init__(self, capture_fails=()):
        self.log, self.capture_fails = [], set(capture_fails)

    def agree(self, reason):
        self.log.append(("agree", reason))
        return reason

    def sync(self):
        self.log.append(("sync",))

    def time_eager(self, fn, iters, repeats):
        for _ in range(iters):
            fn()
        return [1.0] * repeats

    def capture(self, fn, iters, warmup):
        if fn.name in self.capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return ("graph", fn.name)

    def time_graph(self, graph, iters, repeats):
        return [0.5] * repeats

    def release(self, graph):
        self.log.append(("release", graph))


class Counter:
    def __init__(self, name, fail_after=None):
        self.name, self.calls, self.fail_after = name, 0, fail_after

    def __call__(self):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise ValueError("not implemented for Half\nsecond line")


def test_run_cases_times_skips_and_agrees():
    cases = [bt.Case(1, 256, True), bt.Case(16, 256, False)]
    cases.append(bt.Case(8, 256, None, {"ours": "does not fit"}))
    made = {}

    def factory(name, fail=None, fail_after=None):
        def make(case):
            if fail:
                raise bt.Skip(fail)
            made[(name, case.tokens)] = Counter(name, fail_after)
            return made[(name, case.tokens)]

        return make

    factories = {"ours": factory("ours"), "anchor": factory("anchor", fail="no anchor")}
    factories |= {"nccl": factory("nccl"), "symm_mem": factory("symm_mem", fail_after=0)}
    keys = "ours:eager ours:graph anchor:eager anchor:graph nccl:eager nccl:graph symm_mem:eager"
    rt = FakeRuntime(capture_fails={"nccl"})
    out = bt.run_cases(rt, cases, factories, keys.split(), iters=3, repeats=2, warmup=2)
    assert [e["mode"] for e in out] == ["oneshot", "twoshot", None]
    e = out[0]
    assert e["us_repeats"] == {
        "ours:eager": [1.0, 1.0],
        "ours:graph": [0.5, 0.5],
        "nccl:eager": [1.0, 1.0],
    }
    assert e["skipped"]["anchor:eager"] == e["skipped"]["anchor:graph"] == "Skip: no anchor"
    assert e["skipped"]["nccl:graph"].startswith("capture failed: RuntimeError: operation")
    assert e["skipped"]["symm_mem:eager"] == "ValueError: not implemented for Half"
    assert made[("ours", 1)].calls == 2 + 3  # warm-up + one timed loop
    assert out[2]["skipped"]["ours:eager"] == "does not fit"
    assert out[2]["skipped"]["nccl:graph"] == "infeasible"
    assert ("release", ("graph", "ours")) in rt.log and ("release", None) in rt.log


def test_modes_force_both_builds_alike_or_say_why():
    a = bt.parse_args(["--modes", "twoshot,auto", "--tokens", "1,4096", "--hidden", "8192"])
    assert a.modes == ["auto", "twoshot"]
    sizes, cases = bt.plan_cases(a.tokens, a.hidden, a.dtype, a.world, a.modes)
    assert [(c.tokens, c.policy, c.mode) for c in cases] == [
        (1, "auto", "oneshot"),
        (1, "twoshot", None),
        (4096, "auto", "oneshot"),
        (4096, "twoshot", "twoshot"),
    ]
    assert "more tokens than ranks" in cases[1].skipped["ours"]
    factories = {"ours": lambda case: Counter("ours")}
    out = bt.run_cases(
        FakeRuntime(), cases, factories, ["ours:eager"], iters=1, repeats=1, warmup=0
    )
    rep = bt.build_report([{"cases": out}, {"cases": out}], a, {}, {})
    assert [c["policy"] for c in rep["cases"]] == ["auto", "twoshot", "auto", "twoshot"]
    text = bt.format_table(rep)
    assert " twoshot(forced) " in text and "more tokens than ranks" in text


# --- process launch and the gloo agreement, for real on CPU ----------------------------------


def _agree_worker(rank, port, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        rt = bt.CudaRuntime(torch, dist, device=0)
        got = [rt.agree(None), rt.agree("bad thing" if rank == 1 else None)]
        Path(out_dir, f"{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def _failing_worker(rank):
    if rank == 1:
        raise RuntimeError("rank one broke")
    time.sleep(60)


def _sleeping_worker(rank):
    time.sleep(60)


@pytest.mark.slow
def test_launch_and_agreement_over_gloo(tmp_path):
    bt.launch(_agree_worker, 2, (bt._free_port(), str(tmp_path)), timeout_s=120)
    for r in range(2):
        assert json.loads((tmp_path / f"{r}.json").read_text()) == [None, "rank 1: bad thing"]


@pytest.mark.slow
def test_launch_raises_a_ranks_error_and_ends_the_others():
    t0 = time.monotonic()
    with pytest.raises(Exception, match="rank one broke"):
        bt.launch(_failing_worker, 2, (), timeout_s=120)
    assert time.monotonic() - t0 < 50


def test_launch_kills_ranks_past_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running"):
        bt.launch(_sleeping_worker, 2, (), timeout_s=2)
    assert time.monotonic() - t0 < 40


# --- the anchor loader ------------------------------------------------------------------------


def test_anchor_path_precedence(monkeypatch, tmp_path):
    assert fa.resolve_anchor_path(None, env={}) == fa.DEFAULT_ANCHOR
    assert fa.DEFAULT_ANCHOR == REPO / ".anchor" / "anchor-flashinfer"
    env = {fa.ANCHOR_ENV_VAR: str(tmp_path)}
    assert fa.resolve_anchor_path(None, env=env) == tmp_path
    assert fa.resolve_anchor_path(str(tmp_path / "x"), env=env) == tmp_path / "x"


def test_missing_anchor_fails_with_a_clear_message(tmp_path):
    where = tmp_path / "nowhere"
    with pytest.raises(fa.AnchorUnavailable) as e:
        fa.load_anchor(where)
    msg = str(e.value)
    assert f"no anchor folder at {where}" in msg
    assert "--anchor" in msg and "JAX_FUSEDAR_ANCHOR" in msg
    assert "flashinfer" not in sys.modules
    (tmp_path / "half" / "flashinfer").mkdir(parents=True)
    with pytest.raises(fa.AnchorUnavailable, match="missing flashinfer/comm/allreduce.py"):
        fa.load_anchor(tmp_path / "half")
    assert anchor.problem(where) == f"no anchor folder at {where}"


def test_anchor_environment_adds_the_cuda_libs_once(tmp_path):
    libs = fa.CUDA_LIB_DIR
    env = fa.anchor_environment(tmp_path, env={"LD_LIBRARY_PATH": f"/a:{libs}"})
    assert env["LD_LIBRARY_PATH"] == f"/a:{libs}"
    env = fa.anchor_environment(tmp_path, env={})
    assert env["LD_LIBRARY_PATH"] == libs
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "ws")
    assert env["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"


def _fake_anchor(root: Path, broken=False) -> Path:
    a = root / "anchor-flashinfer"
    heavy = "raise ImportError('heavy __init__ ran')\n"  # the real ones import far more
    files = {
        "ws/.cache/flashinfer/0.7.2.post1/90a/cached_ops/trtllm_comm/trtllm_comm.so": "",
        "flashinfer/__init__.py": heavy,
        "flashinfer/comm/__init__.py": heavy,
        "flashinfer/jit/__init__.py": "",
        "site/tvm_ffi/__init__.py": "",
        "flashinfer/jit/core.py": textwrap.dedent("""
            class JitSpecNvcc:
                def build(self):
                    raise RuntimeError("nvcc must never run")
        """),
        "flashinfer/comm/allreduce.py": textwrap.dedent(f"""
            import os
            import tvm_ffi  # from the anchor's site/
            from flashinfer.jit import core
            {"raise OSError('libcudart.so.13: cannot open shared object file')" if broken else ""}
            SEEN = {{k: os.environ.get(k) for k in ("FLASHINFER_WORKSPACE_BASE",
                                                    "FLASHINFER_CUDA_ARCH_LIST")}}
            def create_allreduce_fusion_workspace(**kw):
                return kw
            def allreduce_fusion(**kw):
                return kw
            BUILD = core.JitSpecNvcc().build()
        """),
    }
    for name, text in files.items():
        (a / name).parent.mkdir(parents=True, exist_ok=True)
        (a / name).write_text(text)
    return a


def test_anchor_loader_stubs_packages_and_never_builds(tmp_path):
    a = _fake_anchor(tmp_path)
    code = textwrap.dedent(f"""
        import json, sys
        from tools import flashinfer_anchor as fa
        fi = fa.load_anchor({str(a)!r})
        again = fa.load_anchor({str(a)!r})
        ws = fa.create_anchor_workspace(fi, world_size=2, rank=0, max_token_num=8,
                                        hidden_dim=64, dtype="bf16", group=None)
        print(json.dumps({{"same": fi is again, "seen": fi.SEEN, "build": fi.BUILD,
                          "backend": ws["backend"], "site": sys.path[0]}}))
    """)
    r = run_code(code, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {
        "same": True,
        "seen": {"FLASHINFER_WORKSPACE_BASE": str(a / "ws"), "FLASHINFER_CUDA_ARCH_LIST": "9.0a"},
        "build": None,
        "backend": "trtllm",
        "site": str(a / "site"),
    }


def test_anchor_loader_reports_import_failures_and_foreign_flashinfer(tmp_path):
    broken = _fake_anchor(tmp_path / "a", broken=True)
    good = _fake_anchor(tmp_path / "b")
    code = textwrap.dedent(f"""
        import sys, types
        from tools import flashinfer_anchor as fa
        try:
            fa.load_anchor({str(broken)!r})
        except fa.AnchorUnavailable as e:
            print("1", e)
        print("2", [n for n in sys.modules if n.startswith("flashinfer")])
        other = types.ModuleType("flashinfer")
        other.__path__ = ["/site-packages/flashinfer"]
        sys.modules["flashinfer"] = other
        try:
            fa.load_anchor({str(good)!r})
        except fa.AnchorUnavailable as e:
            print("3", e)
    """)
    r = run_code(code, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    unavailable = "FlashInfer anchor unavailable:"
    assert lines[0].startswith(f"1 {unavailable} importing it failed: OSError: libcudart.so.13"), (
        lines
    )
    assert lines[1] == "2 []"  # the stubs are rolled back
    assert lines[2].startswith(f"3 {unavailable} another 'flashinfer' is already imported"), lines


# --- the anchor comparison's plumbing with fake allreduce_fusions ----------------------------


def _round(a, npdt):
    return np.asarray(a, np.float32).astype(npdt).astype(np.float32)


OPTIONAL = set(
    "output residual_out norm_out quant_out scale_out residual_in rms_gamma scale_factor "
    "block_quant_group_size".split()
)


def fake_allreduce_fusion(xs, rank, npdt, corrupt=None, refuse=()):
    """The kernel's math in numpy (fp32 sums rounded to the dtype, the norm in fp32, then
    quant_oracle's quantizers on the rounded norm), writing into the torch outputs."""
    from tests.oracles import quant_oracle

    def fn(*, input, workspace, pattern, launch_with_pdl, rms_eps, use_oneshot, fp32_acc, **kw):
        assert set(kw) <= OPTIONAL, set(kw) - OPTIONAL  # FlashInfer's names only
        kw = dict.fromkeys(OPTIONAL) | kw
        if pattern in refuse:
            raise ValueError(f"pattern {pattern} is not supported")
        assert launch_with_pdl and use_oneshot is not None and workspace == "ws"
        assert np.array_equal(input.float().numpy(), xs[rank].astype(np.float32))
        s = _round(sum(x.astype(np.float32) for x in xs), npdt)
        dt = input.dtype
        norm_out, quant_out, scale_out = (kw[k] for k in ("norm_out", "quant_out", "scale_out"))
        if pattern == 0:
            return kw["output"].copy_(torch.from_numpy(s).to(dt))
        r = _round(s + kw["residual_in"].float().numpy(), npdt)
        kw["residual_out"].copy_(torch.from_numpy(r).to(dt))
        inv = 1.0 / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + np.float32(rms_eps))
        y = _round(r * inv * kw["rms_gamma"].float().numpy(), npdt)
        if norm_out is not None:
            norm_out.copy_(torch.from_numpy(y).to(dt))
        yq = y.astype(npdt)
        if pattern in (2, 4):
            q = quant_oracle.fp8_static(yq, float(kw["scale_factor"].item()))
        elif pattern in (10, 11):
            q, sc = quant_oracle.fp8_dynamic(yq, "ieee")
            scale_out.copy_(torch.from_numpy(sc))
        elif pattern in (8, 9):
            q, buf = quant_oracle.fp8_group(yq, kw["block_quant_group_size"])
            m = q.shape[0]
            scale_out.copy_(torch.from_numpy(buf[:, :m].T.copy()))
            k, t = buf.shape  # the MN padding of all but the last pack is zeroed
            torch.as_strided(scale_out, (k, t), (t, 1))[:-1, m:] = 0
        else:
            return norm_out
        quant_out.view(torch.uint8).copy_(torch.from_numpy(np.asarray(q).view(np.uint8)))
        if corrupt == pattern:
            quant_out.view(torch.uint8)[0, 0] ^= 1
        return norm_out if norm_out is not None else quant_out

    return fn


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_anchor_compare_case_counts_bytes_and_oracle_errors(dtype_name):
    npdt = ac._np_dtype(dtype_name)
    m, hidden = 6, 512  # group 128: 4 groups, K = 1 pack; T = 8 (MN padding)
    xs, res, gam = draw_case(5, 2, m, hidden)
    xs = [x.astype(npdt) for x in xs]
    res, gam = res.astype(npdt), gam.astype(npdt)
    result, stats = ac.new_result(0, "cpu", "x", "fake"), ac.new_stats()
    calls = {
        "ours": (fake_allreduce_fusion(xs, 0, npdt, refuse=(8,)), "ws"),
        "anchor": (fake_allreduce_fusion(xs, 0, npdt, corrupt=11), "ws"),
    }
    case = dict(xs=xs, res=res, gam=gam, m=m, hidden=hidden, oneshot=True, patterns=ac.PATTERNS)
    where = dict(rank=0, device="cpu", dtype_name=dtype_name, result=result, stats=stats)
    ac.run_case(torch, calls, **where, **case)
    json.dumps(result)
    assert result["cases"] == 1 and result["calls"] == 2 * 2 * 8 - 2
    assert list(result["refused"]) == ["ours p8"]
    assert "pattern 8 is not supported" in result["refused"]["ours p8"]
    assert result["return_mismatch"] == [] and result["unwritten"] == {"ours": 0, "anchor": 0}
    diffs = {k: d["differing"] for k, d in result["diffs"].items()}
    assert diffs == {**{k: 0 for k in diffs}, "p11:quant_out": 2}  # one byte x 2 fp32_acc
    assert "p8:quant_out" not in diffs and "p9:scale_out" in diffs
    assert result["diffs"]["p9:scale_out"]["bytes"] == 2 * 1 * 8 * 4  # whole (K, T) buffer
    ours, anc = stats["ours"], stats["anchor"]
    assert ours["allreduce"] <= 1.0 and ours["residual"] <= 1.0 and ours["norm"] <= 3.0
    # The accumulation bounds, both fp32_acc settings (the fake sums in float32 either way).
    assert not bound_problems(ours, dtype_name, 4) and ours["norm_own"] > 0, ours
    assert ours["worse"] == 0 and sum(ours["steps1"].values()) == 0
    assert ours["dyn_scale_ulps"] == 0.0 and ours["group_scale_mismatch"] == 0
    assert ours["elements"] == 5 * m * hidden  # 4, 2, 11, 10, 9 (8 refused)
    assert anc["elements"] == 6 * m * hidden
    assert anc["worse"] + sum(anc["steps1"].values()) == 1  # the corrupted code


def test_anchor_compare_outputs_are_poisoned_in_flashinfers_layout():
    outs, bufs = ac._outputs(torch, 9, 6, 512, torch.bfloat16, "cpu")
    assert set(outs) == {"residual_out", "norm_out", "quant_out", "scale_out"}
    assert outs["scale_out"].shape == (6, 1) and outs["scale_out"].stride() == (1, 8)
    assert bufs["scale_out"].shape == (1, 8) and bool((bufs["scale_out"] == -1).all())
    assert bool(outs["norm_out"].isnan().all())
    assert bool((outs["quant_out"].view(torch.uint8) == 0xFF).all())
    host = ac._host(torch, bufs, "bfloat16", 6)
    assert ac._unwritten("quant_out", host["quant_out"], 6) == 6 * 512
    assert ac._unwritten("scale_out", host["scale_out"], 6) == 6
    outs, bufs = ac._outputs(torch, 10, 3, 256, torch.float16, "cpu")
    assert set(outs) == {"residual_out", "quant_out", "scale_out"}
    assert outs["scale_out"].shape == (3, 1) and outs["scale_out"].dtype == torch.float32


# --- every variant's call against the real APIs ----------------------------------------------


def _anchor_params(func_name):
    """Parameter names (all, required) of a function in the anchor's FlashInfer allreduce.py
    ($JAX_FUSEDAR_ANCHOR or <repo>/.anchor/anchor-flashinfer), read with ast (the module
    itself needs CUDA and Python 3.12 to import)."""
    src = fa.resolve_anchor_path() / "flashinfer" / "comm" / "allreduce.py"
    if not src.exists():
        pytest.skip(f"no FlashInfer source at {src}")
    tree = ast.parse(src.read_text())
    a = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func_name).args
    required = [x.arg for x in a.args[: len(a.args) - len(a.defaults)]]
    return {x.arg for x in a.args + a.kwonlyargs}, required


class FakeDist:
    def __init__(self):
        self.calls = []

    def all_reduce(self, t, group=None):
        self.calls.append(("all_reduce", tuple(t.shape), group))


def test_variant_calls_bind_to_torch_compat_and_flashinfer():
    import torch_compat

    ours_sig = inspect.signature(torch_compat.allreduce_fusion)
    fi_names, fi_required = _anchor_params("allreduce_fusion")
    calls = []

    def ours(**kw):
        ours_sig.bind(**kw)  # TypeError on a wrong name
        calls.append(("ours", kw))

    def anchor(**kw):
        assert set(kw) <= fi_names and set(fi_required) <= set(kw), set(kw) - fi_names
        calls.append(("anchor", kw))

    def symm_op(buf, x, op, group_name, out):
        calls.append(("symm", buf.shape, x.shape, op, group_name, out.shape))
        buf.copy_(x)
        out.copy_(2 * buf)  # two ranks with the same partial sum

    args, dist = bt.parse_args(["--tokens", "4", "--hidden", "256"]), FakeDist()

    def variants(rank):
        v = bt.Variants(torch, dist, args, rank=rank, device=0, shared_gpu=False)
        v.dev = torch.device("cpu")
        return v

    v = variants(1)
    v.tc, v.fi = SimpleNamespace(allreduce_fusion=ours), SimpleNamespace(allreduce_fusion=anchor)
    v.ours_ws, v.anchor_ws, v.nccl_group = "ws", "fi_ws", "nccl"
    v.symm_buf = torch.empty(4 * 256, dtype=torch.bfloat16)
    v.symm_op, v.symm_copy, v.symm_group_name = symm_op, True, "0"
    case = bt.Case(4, 256, False)
    norms = {impl: factory(case)() for impl, factory in v.factories().items()}
    by = {}
    for c in calls:
        by.setdefault(c[0], []).append(c)
    (_, k1), (_, k4) = by["ours"]
    assert k1["pattern"] == 1 and k4["pattern"] == 4
    for kw in (k1, k4):
        assert kw["use_oneshot"] is False and kw["fp32_acc"] is True
        assert kw["launch_with_pdl"] is True and kw["workspace"] == "ws"
        assert kw["input"].shape == (4, 256) and kw["rms_gamma"].shape == (256,)
        assert kw["input"].dtype == kw["residual_in"].dtype == torch.bfloat16
        assert "output" not in kw
    assert k4["quant_out"].dtype == torch.float8_e4m3fn and k4["quant_out"].shape == (4, 256)
    assert k4["scale_factor"].dtype == torch.float32 and k4["scale_factor"].shape == (1,)
    (_, a1), (_, a4) = by["anchor"]
    assert a1["workspace"] == a4["workspace"] == "fi_ws" and a1["use_oneshot"] is False
    assert a1["output"].shape == (4, 256) and a4["pattern"] == 4
    assert set(a4) - set(k4) == {"output"}
    assert dist.calls == [("all_reduce", (4, 256), "nccl")]
    assert by["symm"] == [("symm", (4, 256), (4, 256), "sum", "0", (4, 256))]
    for impl in ("nccl", "symm_mem"):
        assert norms[impl].shape == (4, 256) and norms[impl].dtype == torch.bfloat16
        assert bool(torch.isfinite(norms[impl].float()).all()), impl
    # Rank-dependent inputs: another rank draws other partial sums.
    assert not torch.equal(variants(0)._inputs(case)[0], v._inputs(case)[0])
    assert torch.equal(v._inputs(case)[0], v._inputs(case)[0])


def test_anchor_workspace_is_always_trtllm():
    names, required = _anchor_params("create_allreduce_fusion_workspace")
    seen = {}
    fi = SimpleNamespace(create_allreduce_fusion_workspace=lambda **kw: seen.update(kw))
    kw = dict(world_size=2, rank=1, max_token_num=8, hidden_dim=64, dtype=torch.bfloat16, group="g")
    fa.create_anchor_workspace(fi, **kw)
    assert seen["backend"] == "trtllm" and set(seen) <= names
    assert seen == {"backend": "trtllm", **kw}


def _fake_worker(rank, args, port, result_dir):
    """Stands in for torch_bench._worker in spawned processes: the real plan and driver, a
    fake runtime and fake variants."""
    _, cases = bt.plan_cases(args.tokens, args.hidden, args.dtype, args.world, args.modes)
    factories = {i: (lambda case, i=i: Counter(i)) for i in bt.IMPLS}
    rt = FakeRuntime(capture_fails={"symm_mem"})
    out = bt.run_cases(rt, cases, factories, bt.variant_keys(args), iters=2, repeats=3, warmup=1)
    machine = {"torch": "fake", "device_name": "Fake GPU"}
    payload = {"rank": rank, "device": rank, "cases": out, "notes": {"port": port}}
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(dict(payload, machine=machine)))


@pytest.mark.slow
def test_main_end_to_end_with_a_fake_worker(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bt, "_worker", _fake_worker)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    out = tmp_path / "out"
    argv = "--tokens 1,16 --hidden 1024 --modes auto,twoshot".split()
    rc = bt.main([*argv, "--out", str(out), "--anchor", str(tmp_path / "no-anchor")])
    assert rc == 0
    text = capsys.readouterr()
    assert "[eager]" in text.out and "[graph]" in text.out and "wrote" in text.out
    assert "FlashInfer anchor unavailable: no anchor folder" in text.err
    rep = json.loads((out / "bench_torch.json").read_text())
    assert rep["anchor"]["problem"].startswith("no anchor folder")
    assert [(c["tokens"], c["policy"], c["mode"]) for c in rep["cases"]] == [
        (1, "auto", "oneshot"),
        (1, "twoshot", None),
        (16, "auto", "oneshot"),
        (16, "twoshot", "twoshot"),
    ]
    c = rep["cases"][2]
    assert c["us"]["ours:eager"] == 1.0 and c["ratios"]["ours/anchor:graph"] == 1.0
    assert c["skipped"]["symm_mem:graph"].startswith("capture failed")
    assert rep["machine"]["devices"] == [0, 1]
    if importlib.util.find_spec("matplotlib"):
        assert (out / "bench_torch.png").exists()
