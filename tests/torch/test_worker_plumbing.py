"""CPU run of the GPU tests' shared pieces, so the GPU run has the best chance to pass first
time: the plumbing and checks of tests/gpu/workers/torch_workers.py and parity_jax_torch.py
with a simulated kernel, and the parity test's JAX phase on JAX's CPU reference path."""

import numpy as np
import pytest
import torch

import torch_compat
from torch_compat import library

from tests.gpu.harness import bound_problems, draw_case, free_port, run_ranks
from tests.gpu.workers import parity_jax_torch as par
from tests.gpu.workers import torch_workers as tw
from tests.torch import rounding_check as rc
from tests.torch.fakes import fake_workspace
from tests.torch.test_library import _ref_fused
from tests.torch.test_library import fake_workspace as fake_workspace_world1


class SimTC:
    """torch_compat for the workers: the real argument checks (on a FakeRank workspace), then
    the kernel simulated over the group's inputs ``xs`` (all ranks, of the call dtype): sum,
    + residual and fp32 norm each rounded to T, quantized with tests/oracles/quant_oracle.py."""

    def __init__(self, xs):
        self.xs = xs
        self.calls = []

    def allreduce_fusion(self, input, workspace, pattern, **kw):
        ret = torch_compat.allreduce_fusion(input, workspace, pattern, **kw)
        self.calls.append((pattern, kw.get("use_oneshot"), kw.get("fp32_acc")))
        dt = input.dtype
        s = sum(x.float() for x in self.xs).to(dt)
        if pattern == 0:
            kw["output"].copy_(s)
            return ret
        r = (s.float() + kw["residual_in"].float()).to(dt)
        y = rc.rms_norm_f32(r, kw["rms_gamma"], kw["rms_eps"], kw["weight_bias"]).to(dt)
        kw["residual_out"].copy_(r)
        if kw.get("norm_out") is not None:
            kw["norm_out"].copy_(y)
        if pattern != 1:
            sf, group = kw.get("scale_factor"), kw.get("block_quant_group_size")
            q, sc = rc.oracle_quantize(pattern, y.float().numpy(), sf, group)
            kw["quant_out"].view(torch.uint8).copy_(q)
            if sc is not None:
                kw["scale_out"].copy_(sc)
        return ret


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("m, oneshot", [(1, True), (17, False)])
def test_workers_plumbing_and_checks_with_a_simulated_kernel(cpu_stream, dtype, m, oneshot):
    hidden, dt = 512, tw._torch_dtype(torch, dtype)
    xs, res, gam = draw_case(7, 2, m, hidden)
    xs = [tw.to_torch(torch, a, dt, "cpu") for a in xs]
    res, gam = (tw.to_torch(torch, a, dt, "cpu") for a in (res, gam))
    ws = fake_workspace(max_tokens=32, hidden=hidden)
    sim = SimTC(xs)
    res64, gam64 = res.double().numpy(), gam.double().numpy()
    ref = tw.group_oracle([x.double().numpy() for x in xs], res64, gam64)
    sf = tw.static_scale(ref)
    got = {}
    for p in (0, 1) + tw.FP8_PATTERNS:
        outs = tw.new_outputs(torch, p, m, hidden, dt, "cpu")
        tw.call_pattern(sim, ws, p, xs[0], res, gam, outs, sf=torch.tensor([sf]), oneshot=oneshot)
        got[p] = tw.outputs_to_numpy(torch, outs)
    assert [c[0] for c in sim.calls] == [0, 1, 2, 4, 10, 11, 8, 9]
    assert all(c[1] is oneshot and c[2] is True for c in sim.calls)
    assert [a[0] for a, _ in ws._rank_obj.launches] == [0, 1, 2, 4, 10, 11, 8, 9]
    e = tw.plain_errors({**got[0], **got[1]}, ref, res64, gam64, dtype, 0.0)
    assert e["nans"] == 0 and e["allreduce"] <= 0.5 and e["residual"] <= 1.0
    assert e["norm"] <= 3.0, e
    stats = tw.quant_stats(tw.new_quant_stats(), got, ref, res64, gam64, dtype, sf, tw.GROUP, "sim")
    assert stats["worse"] == 0 and stats["poisoned"] == 0 and stats["twin_diffs"] == [], stats
    assert sum(stats["steps1"].values()) == 0 and stats["dyn_scale_ulps"] == 0.0, stats
    assert stats["group_scale_mismatch"] == 0 and stats["residual"] <= 1.0, stats
    # The checks fail when they should: a code two steps off, an unwritten scale, a twin.
    bad = {p: dict(v) for p, v in got.items()}
    bad[4]["quant_out"] = got[4]["quant_out"].copy()
    bad[4]["quant_out"][0, 0] ^= 0x02  # the sign bit kept, the magnitude's code 2 steps off
    bad[11]["scale_out"] = got[11]["scale_out"].copy()
    bad[11]["scale_out"][0, 0] = np.nan
    stats = tw.quant_stats(tw.new_quant_stats(), bad, ref, res64, gam64, dtype, sf, tw.GROUP, "bad")
    assert stats["worse"] + stats["steps1"]["static"] >= 1 and stats["poisoned"] >= 1
    assert any(d[0] == "static q" for d in stats["twin_diffs"]), stats
    unwritten = dict(got[1])
    unwritten["norm_out"] = got[1]["norm_out"].copy()
    unwritten["norm_out"][0, 0] = np.nan
    assert tw.plain_errors(unwritten, ref, res64, gam64, dtype, 0.0)["nans"] == 1


def _compared_cases(meta, data, world):
    """Phase 2 of the parity test with the simulated kernel: (case, compare_case's result)
    for every case of phase 1's files and every rank of ``world``."""
    ws = fake_workspace(max_tokens=32, hidden=256, world=world)
    for c in meta["cases"]:
        dt = tw._torch_dtype(torch, c["dtype"])
        xs = [tw.to_torch(torch, data[f"c{c['case']}/x{r}"], dt, "cpu") for r in range(world)]
        for rank in range(world):
            out = par.compare_case(torch, SimTC(xs), ws, "cpu", data, c, rank, lambda: None, world)
            yield c, out


@pytest.mark.slow
def test_parity_phase1_on_cpu_and_phase2_logic_with_a_simulated_kernel(tmp_path, cpu_stream):
    pytest.importorskip("jax")
    phase = dict(timeout_s=600, out_dir=str(tmp_path), hiddens=(256,), platform="cpu")
    dtypes = ("bfloat16", "float16")
    (jres,) = run_ranks(par.jax_phase, 1, **phase, seed=3, tokens=(1, 17), dtypes=dtypes)
    assert jres["cases"] == 6 and set(jres["backends"].values()) == {"xla"}, jres
    meta, data = par.load(str(tmp_path))
    assert meta["world"] == 2
    assert meta["outputs"] == {
        "0": ["allreduce_out"],
        "1": ["norm_out", "residual_out"],
        "2": ["quant_out", "residual_out"],
        "4": ["norm_out", "quant_out", "residual_out"],
        "8": ["quant_out", "residual_out", "scale_out"],
        "9": ["norm_out", "quant_out", "residual_out", "scale_out"],
        "10": ["quant_out", "residual_out", "scale_out"],
        "11": ["norm_out", "quant_out", "residual_out", "scale_out"],
    }
    total = {}
    for c, out in _compared_cases(meta, data, world=2):
        for p, d in out["diffs"].items():
            for name, n in d.items():
                assert isinstance(n, int), (c, p, name, n)  # same shapes on both sides
                total[(p, name)] = total.get((p, name), 0) + n
        for side in ("torch", "jax"):
            w = out[side]
            assert w["nans"] == 0 and w["allreduce"] <= 1.0 and w["residual"] <= 1.0
            assert w["norm"] <= 3.0, (side, w)
            q = out[f"quant_{side}"]
            assert q["worse"] == 0 and q["poisoned"] == 0, (side, q)
            assert q["group_scale_mismatch"] == 0, (side, q)
    # Every output of every pattern was compared; JAX's reference path rounds like the
    # kernel, so the sum, residual and scales agree exactly with the simulation.
    assert len(total) == 22, total
    for key in ((0, "output"), (1, "residual_out"), (9, "scale_out"), (8, "scale_out")):
        assert total[key] == 0, (key, total)
    print("differing elements, JAX CPU reference vs simulated kernel:", total)


@pytest.mark.slow
def test_parity_phase1_as_four_rank_processes_on_cpu(tmp_path, cpu_stream):
    """The JAX phase as one `jax.distributed` process per rank over gloo (as where GPUs are
    fewer than ranks); phase 2 at 4 ranks: every output compared, within the bounds."""
    pytest.importorskip("jax")
    phase = dict(timeout_s=600, out_dir=str(tmp_path), hiddens=(256,), platform="cpu")
    phase.update(port=free_port(), seed=5, tokens=(1, 9), dtypes=("bfloat16",))
    res = run_ranks(par.jax_rank_phase, 4, **phase)
    assert [r["world"] for r in res] == [4] * 4 and res[0]["cases"] == 3, res
    meta, data = par.load(str(tmp_path))
    assert meta["world"] == 4 and len(meta["cases"]) == 3
    compared = 0
    for c, out in _compared_cases(meta, data, world=4):
        compared += sum(isinstance(n, int) for d in out["diffs"].values() for n in d.values())
        for side in ("torch", "jax"):
            w = out[side]
            assert w["nans"] == 0 and not bound_problems(w, "bfloat16", 4), (side, w)
            assert "residual_bound" in w and "norm_own" in w, w
            assert not bound_problems(out[f"quant_{side}"], "bfloat16", 4)
    assert compared == 3 * 4 * 22


@pytest.mark.parametrize("norm", ["manual", "F.rms_norm"])
def test_fusion_pass_model_on_cpu(gloo_world1, norm):
    shape = dict(m=8, hidden=256, layers=4, seed=5, device="cpu", norm=norm)
    model, args, ref64 = tw.build_tp_model(torch, gloo_world1, 0, 1, **shape)
    gm = tw.trace_tp_model(torch, model, args)
    ar = torch.ops._c10d_functional.all_reduce.default
    assert tw.count_targets(gm, ar) == 4
    unfused = gm(*args)
    ws = fake_workspace_world1(max_tokens=8, hidden=256)  # the group's ranks: [0]
    with torch.library._scoped_library("torch_compat", "IMPL") as lib:
        lib.impl("allreduce_residual_rmsnorm", _ref_fused, "CPU")
        # The manual form rounds before gamma: fused only when asked (docs/torch.md).
        assert torch_compat.fuse_allreduce_rmsnorm(gm, ws) == (4 if norm != "manual" else 0)
        allow = norm == "manual"
        fused = torch_compat.fuse_allreduce_rmsnorm(gm, ws, allow_rounding_change=allow)
        assert fused == (4 if allow else 0)
        assert tw.count_targets(gm, library.ALLREDUCE_RESIDUAL_RMSNORM) == 4
        assert tw.count_targets(gm, ar) == 0
        fused = gm(*args)
    c = tw.compare_models(torch, fused, unfused, ref64)
    assert c["finite"] and c["fused_vs_f64"] <= 1.25 * c["unfused_vs_f64"] + 2.0**-8, c
    assert c["fused_vs_unfused"] <= 2e-2, c
