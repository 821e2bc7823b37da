"""The opt-in cross-rank handshake on CPU: option parsing (with the kernel's timeout), agreement
at creation (JAX's and torch's exchanges, with fakes), the plumbing down to the native Rank, and
the core's signature packing and failure message (nvcc host program). The kernel itself runs
only in tests/gpu/test_topology.py."""

import json

import numpy as np
import pytest

from jax_fusedar.common import handshake, exchange, join, tp_groups
from tests.common.fakes import FakeStore, run_in_threads
from tests.native.fake_native import FakeRank, fake_jax_workspace
from tests.native.host_program import run_host_program


@pytest.mark.parametrize(
    "raw, on",
    [(raw, True) for raw in ["1", "true", "TRUE", " yes ", "On"]]
    + [(raw, False) for raw in [None, "", "0", "false", "No", "off"]],
)
def test_env_turns_the_check_on_or_leaves_it_off(monkeypatch, raw, on):
    if raw is None:
        monkeypatch.delenv(handshake.HANDSHAKE_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(handshake.HANDSHAKE_ENV_VAR, raw)
    assert handshake.resolve_handshake(None) is on
    assert handshake.resolve_handshake(not on) is (not on)  # an explicit argument wins


def test_env_garbage_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(handshake.HANDSHAKE_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=r"\$JAX_FUSEDAR_HANDSHAKE='maybe' is not a boolean"):
        handshake.resolve_handshake(None)


@pytest.mark.parametrize("value", [1, "yes", 0.0])
def test_handshake_argument_must_be_a_bool(value):
    with pytest.raises(TypeError, match="handshake must be True, False or None"):
        handshake.resolve_handshake(value)


KERNEL = (handshake.resolve_timeout_s, handshake.TIMEOUT_ENV_VAR)
HANDSHAKE = (handshake.resolve_handshake_timeout_s, handshake.HANDSHAKE_TIMEOUT_ENV_VAR)
TIMEOUTS = {"kernel": KERNEL, "handshake": HANDSHAKE}  # each timeout's resolver and variable
HALF = np.float32(0.5)


@pytest.mark.parametrize(
    "which, default, env, args",
    [  # The kernel's "0": wait forever (FlashInfer's behaviour); "": the default.
        (KERNEL, "DEFAULT_TIMEOUT_S", [(" 2.5 ", 2.5), ("0", 0.0), ("", 30.0)], [7, 0, HALF, 3600]),
        (HANDSHAKE, "DEFAULT_HANDSHAKE_TIMEOUT_S", [(" 2.5 ", 2.5)], [7, HALF]),
    ],
    ids=["kernel", "handshake"],
)
def test_default_env_and_argument(monkeypatch, which, default, env, args):
    resolve, var = which
    monkeypatch.delenv(var, raising=False)
    assert resolve(None) == getattr(handshake, default) == 30.0
    for raw, want in env:
        monkeypatch.setenv(var, raw)
        assert resolve(None) == want
    assert [resolve(value) for value in args] == [float(v) for v in args]  # arguments win


# The kernel's timeout takes 0 (wait forever), the handshake's does not.
@pytest.mark.parametrize(
    "which, raw, match",
    [
        ("kernel", "abc", "is not a number of seconds"),
        ("kernel", "-1", r"must be in \[0, 3600\] seconds \(0: wait"),
    ]
    + [("kernel", raw, r"must be in \[0, 3600\]") for raw in ("nan", "inf", "4000")]
    + [("handshake", "abc", "is not a number of seconds")]
    + [("handshake", raw, r"must be in \(0, 3600\]") for raw in ("0", "-1", "nan", "4000")],
)
def test_bad_timeouts_from_the_environment(monkeypatch, which, raw, match):
    resolve, var = TIMEOUTS[which]
    monkeypatch.setenv(var, raw)
    with pytest.raises(ValueError, match=rf"\${var}.*" + match):
        resolve(None)


@pytest.mark.parametrize(
    "value, error",
    [(-0.5, ValueError), (float("nan"), ValueError), (3600.5, ValueError)]
    + [(True, TypeError), ("10", TypeError), ([1], TypeError)],
)
def test_bad_kernel_timeout_arguments(value, error):
    with pytest.raises(error, match="timeout_s"):
        handshake.resolve_timeout_s(value)
    with pytest.raises(error, match="kernel_timeout_s"):
        handshake.resolve_timeout_s(value, name="kernel_timeout_s")


@pytest.mark.parametrize(
    "value, error, match",
    # The handshake's timeout has no "wait forever": 0 stays an error there.
    [(0, ValueError, r"handshake_timeout_s must be in \(0, 3600\]")]
    + [(-3.0, ValueError, "handshake_timeout_s"), (float("inf"), ValueError, "handshake_timeout_s")]
    + [(True, TypeError, "handshake_timeout_s"), ("10", TypeError, "handshake_timeout_s")],
)
def test_bad_handshake_timeout_arguments(value, error, match):
    with pytest.raises(error, match=match):
        handshake.resolve_handshake_timeout_s(value)


def test_options_must_agree(monkeypatch):
    join.check_options_agree({"a": {"handshake": True}, "b": {"handshake": True}})
    join.check_options_agree({"a": {"handshake": False}, "b": {}})  # absent = off
    with pytest.raises(ValueError, match=r"disagree on handshake: on for b; off for a, c"):
        join.check_options_agree({"a": {"handshake": False}, "b": {"handshake": True}, "c": {}})
    # Driven by join.AGREED_OPTIONS: one more entry, one more check.
    monkeypatch.setitem(join.AGREED_OPTIONS, "timeout_s", join.AgreedOption(None))
    join.check_options_agree({"a": {"timeout_s": 5.0}, "b": {"timeout_s": 5.0}})
    with pytest.raises(ValueError, match=r"disagree on timeout_s: 5.0 for a; 7.0 for b"):
        join.check_options_agree({"a": {"timeout_s": 5.0}, "b": {"timeout_s": 7.0}})


# --- JAX: agreement across processes ------------------------------------------------------------
M = exchange.Member


def _jax_agree(flags, groups_members, timeout_s=5.0):
    from jax_fusedar import workspace as jws

    store = FakeStore()
    groups = [
        tp_groups.TPGroup(tuple(range(10 * i, 10 * i + len(ms))), i)
        for i, ms in enumerate(groups_members)
    ]

    def proc(me):
        joins = [
            join.GroupJoin(
                g,
                tuple(m.process for m in ms),
                {r: m.device for r, m in enumerate(ms) if m.process == me},
            )
            for g, ms in zip(groups, groups_members)
        ]
        joins = [j for j in joins if j.my_devices]
        return jws.join_processes(
            joins, me, store.channel(timeout_s), serial=3, handshake=flags[me]
        )

    out, errors = run_in_threads(proc, flags, 4 * timeout_s)
    return out, errors, store


def test_jax_processes_that_agree_pass():
    # DP=2 x TP=2 over two processes with two GPUs each: every group spans both processes.
    gm = [[M(0, 0), M(1, 0)], [M(0, 1), M(1, 1)]]
    out, errors, store = _jax_agree({0: True, 1: True}, gm)
    assert not errors and set(out) == {0, 1}
    assert len(store.data) == 4  # one key per (group, process)
    published = [json.loads(v) for v in store.data.values()]
    assert all(p["options"] == {"handshake": True} for p in published)
    # Each process publishes the devices of its own members of the group ...
    devices = sorted(tuple(p["devices"].items()) for p in published)
    assert devices == [(("0", 0),), (("0", 1),), (("1", 0),), (("1", 1),)]
    # ... and every process ends with the same members, in TP-rank order.
    for agreed in out.values():
        assert [list(a.members) for a in agreed] == gm


def test_jax_processes_that_disagree_all_refuse():
    out, errors, _ = _jax_agree({0: True, 1: False}, [[M(0, 0), M(1, 0)]])
    assert not out and set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, ValueError)
        assert "disagree on handshake: on for process 0; off for process 1" in str(e)


def test_jax_groups_within_one_process_publish_nothing():
    gm = [[M(0, 0), M(0, 1)], [M(1, 0), M(1, 1)]]
    out, errors, store = _jax_agree({0: True, 1: False}, gm)  # separate groups: no conflict
    assert not errors and set(out) == {0, 1} and not store.data


def test_jax_build_passes_the_option_to_every_native_rank(monkeypatch):
    ws = fake_jax_workspace(monkeypatch, 99, handshake=True, handshake_timeout_s=7.0)
    kw = dict(handshake=True, handshake_timeout_s=7.0, timeout_s=30.0)
    assert [r.kw for r in FakeRank.made] == [dict(device=d, rank=d, **kw) for d in (0, 1)]
    for rank in FakeRank.made:
        rank.record = "rank failed"
    assert "handshake" in repr(ws)
    assert ws.failures() == ["rank failed", "rank failed"]


def test_jax_create_resolves_the_option_before_anything(monkeypatch):
    import jax
    from jax.sharding import Mesh

    from jax_fusedar import workspace as jws

    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    kw = dict(max_token_num=8, hidden_dim=1024, dtype="bfloat16", backend="xla")
    monkeypatch.setenv(handshake.HANDSHAKE_ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="JAX_FUSEDAR_HANDSHAKE"):
        jws.create_allreduce_fusion_workspace(mesh, "tp", **kw)
    monkeypatch.setenv(handshake.HANDSHAKE_ENV_VAR, "1")
    with pytest.raises(ValueError, match="handshake_timeout_s"):
        jws.create_allreduce_fusion_workspace(mesh, "tp", handshake_timeout_s=-1, **kw)


# --- torch: agreement among the members ---------------------------------------------------------
@pytest.mark.parametrize(
    "flags", [{0: True, 1: True}, {0: False, 1: True}], ids=["agree", "disagree"]
)
def test_torch_members_join_or_all_refuse_before_allocating(flags):
    pytest.importorskip("torch")
    import torch.distributed as dist

    from torch_compat import workspace as tws
    from torch_compat.channel import StoreChannel

    from tests.torch.fakes import FakeRank as TorchFakeRank

    store, made = dist.HashStore(), []

    def make_rank(me, dev, tp):
        made.append((me, dev, tp))
        return TorchFakeRank(me, dev, tp)

    def run(me):
        kw = dict(global_ranks=[0, 1], host="node0", serial=1, backend="trtllm")
        channel = StoreChannel(store, timeout_s=10.0, process=me)
        make = lambda dev, tp: make_rank(me, dev, tp)
        return tws._join_group(
            me=me, device=me, channel=channel, make_rank=make, handshake=flags[me], **kw
        )

    out, errors = run_in_threads(run, flags, 40.0)
    if flags[0]:
        assert not errors and set(out) == {0, 1} and len(made) == 2
        return
    assert not out and set(errors) == {0, 1} and not made
    for e in errors.values():
        assert isinstance(e, ValueError)
        assert (
            "disagree on handshake: on for TP rank 1 (global rank 1); off for TP rank 0 "
            "(global rank 0)"
        ) in str(e)


# --- the native core, host-only ------------------------------------------------------------------
HOST_PROGRAM = r"""
// Host-only exercise of handshake.cu: no CUDA call is made (no GPU here).
#include <cstdio>
#include <cstring>
#include "handshake.h"
using namespace fusedar::handshake;

static Signature sig(int pattern, long tokens, long hidden, int algorithm, int layout, int group) {
  fusedar_launch_args a{};
  a.pattern = pattern; a.dtype = FUSEDAR_BFLOAT16; a.num_tokens = tokens; a.hidden_dim = hidden;
  a.algorithm = algorithm; a.fp32_acc = 1; a.layout = layout; a.block_quant_group_size = group;
  return signature_of(a);
}

int main() {
  Signature s = sig(9, 16, 7168, 1, 2, 128);
  std::printf("word=%llx tokens=%llu hidden=%llu\n", s.word, s.num_tokens, s.hidden_dim);
  fusedar_workspace_info info{};
  info.world_size = 4; info.flag_bytes = 4 * 256 * 4;
  std::printf("offset=%lld bytes=%lld alloc=%lld\n", (long long)area_offset(info),
              (long long)area_bytes(4), (long long)flag_allocation_bytes(info));
  fusedar_rank r;
  r.rank = 1; r.device = 0; r.info = info;
  char buf[1024];
  auto show = [&](const char* name) {
    fusedar_rank_call_check_failure(&r, buf, sizeof buf);
    std::printf("%s=[%s]\n", name, buf);
  };
  show("unchecked");
  Record d{};
  r.record = &d;
  show("clean");
  Signature mine = sig(1, 16, 4096, 1, 0, 0), theirs = sig(1, 17, 4096, 0, 0, 0);
  d.rank = 1; d.world = 4; d.device = 0; d.peer = 3; d.failing_peers = 2; d.seq = 7; d.peer_seq = 7;
  std::memcpy(d.mine, &mine, sizeof mine);
  std::memcpy(d.theirs, &theirs, sizeof theirs);
  d.kind = kMismatch;
  show("mismatch");
  Signature large = sig(1, 16, 4096, FUSEDAR_ALGORITHM_LARGE_MESSAGE, 0, 0);
  std::printf("large_word=%llx\n", large.word);
  std::memcpy(d.theirs, &large, sizeof large);
  show("mismatch_large");
  std::memcpy(d.theirs, &theirs, sizeof theirs);
  d.kind = kTimeout; d.peer_seq = 6; d.timeout_ns = 2500000000ull; d.failing_peers = 1;
  show("timeout");
  char small[16];
  fusedar_rank_call_check_failure(&r, small, sizeof small);
  std::printf("truncated=[%s]\n", small);
  r.record = nullptr;  // not owned
  return 0;
}
"""


@pytest.mark.slow
def test_core_signature_and_failure_messages(tmp_path):
    lines = run_host_program(tmp_path, "host_check", HOST_PROGRAM)
    # pattern 9 | bf16 (2) << 8 | one-shot << 16 | fp32_acc << 17 | layout 2 << 24 | 128 << 32
    assert lines["word"].split()[0] == f"{9 | 2 << 8 | 1 << 16 | 1 << 17 | 2 << 24 | 128 << 32:x}"
    assert any("tokens=16 hidden=7168" in text for text in lines.values())
    # FlashInfer's flags (4 ranks x 256 x 4 bytes) then 2 banks x 4 ranks x 32-byte slots.
    assert lines["offset"] == "4096 bytes=256 alloc=4352"
    assert lines["unchecked"] == "[]" and lines["clean"] == "[]"
    mismatch = lines["mismatch"]
    assert mismatch.startswith(
        "[jax_fusedar handshake failed on rank 1 of 4 (device 0), call #7: rank 3 called "
        "{pattern=1 dtype=bfloat16 num_tokens=17 hidden_dim=4096 two-shot fp32_acc=1 layout=0 "
        "block_quant_group_size=0} but rank 1 called {pattern=1 dtype=bfloat16 num_tokens=16 "
        "hidden_dim=4096 one-shot"
    ), mismatch
    assert "(2 ranks failed the check" in mismatch and "restart the process" in mismatch
    # The large-message algorithm is its own bit (18): a rank running it against one running
    # FlashInfer's one-shot or two-shot kernel fails the check.
    assert lines["large_word"] == f"{1 | 2 << 8 | 1 << 17 | 1 << 18:x}"
    assert (
        "rank 3 called {pattern=1 dtype=bfloat16 num_tokens=16 hidden_dim=4096 "
        "large-message fp32_acc=1"
    ) in lines["mismatch_large"], lines["mismatch_large"]
    assert (
        "rank 3 did not make its call #7 {pattern=1 dtype=bfloat16 num_tokens=16 "
        "hidden_dim=4096 one-shot fp32_acc=1 layout=0 block_quant_group_size=0} within "
        "2.5 s (the last call seen from it is #6)"
    ) in lines["timeout"], lines["timeout"]
    assert lines["truncated"] == "[jax_fusedar han]"
