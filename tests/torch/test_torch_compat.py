"""torch_compat on CPU (no GPU): FlashInfer-compatible signatures, every argument check, the
c10d-store channel on real HashStore/TCPStore, the group exchange with the DP+TP layout that
broke vLLM, and no JAX import. Ranks are recording fakes; the kernel runs in
tests/gpu/test_torch.py."""

import ast
import datetime
import functools
import inspect
import random
import socket
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

import torch_compat
from jax_fusedar.cli.ranks import free_port
from jax_fusedar.common import backend_choice, exchange, launch_mode, native, tp_groups
from jax_fusedar.common import quant_layouts, results
from jax_fusedar.common.patterns import TRAITS
from jax_fusedar.common.limits import SUPPORTED_WORLD_SIZES
from torch_compat import cuda_state, ops
from torch_compat import workspace as wsmod
from torch_compat.channel import StoreChannel
from tools.flashinfer_anchor import resolve_anchor_path

from tests.common.fakes import run_in_threads
from tests.gpu.harness import run_ranks
from tests.torch.fakes import FakeRank, fake_workspace, fuse, last_launch, refused
from tests.repo import run_code

# FlashInfer's Python source, from the anchor folder the GPU tests use ($JAX_FUSEDAR_ANCHOR or
# <repo>/.anchor/anchor-flashinfer: tools/flashinfer_anchor.py); skipped where absent.
ANCHOR = resolve_anchor_path() / "flashinfer" / "comm" / "allreduce.py"

_ = inspect.Parameter.empty
POS, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY


def _signature(text):
    """(name, default, kind) of each parameter of ``text``, written as in a def."""
    out, kind = [], POS
    for word in text.split():
        if word == "*":
            kind = KW
        else:
            name, eq, default = word.partition("=")
            out.append((name, ast.literal_eval(default) if eq else _, kind))
    return out


# flashinfer/comm/allreduce.py (0.7.2.post1 era), in order; the keyword-only options are the
# MNNVL CuTe DSL backend's. allreduce_fusion: every parameter, the MoE ones (6, 7) included.
FI_CREATE = _signature("""
    backend='auto' world_size=None rank=None max_token_num=None hidden_dim=None dtype=None
    gpus_per_node=None comm_backend=None force_oneshot_support=False group=None
    * top_k=None rms_eps=None weight_bias=None routed_scaling_factor=None
    include_shared_expert=None add_residual=None write_residual_output=None
    apply_rms_norm=None output_dtype=None dynamic_fp8=None write_norm_output=None config=None
""")
FI_FUSION = _signature("""
    input workspace pattern launch_with_pdl=False trigger_completion_at_end=True output=None
    residual_out=None norm_out=None quant_out=None scale_out=None residual_in=None
    rms_gamma=None rms_eps=1e-6 scale_factor=None layout_code=None use_oneshot=None
    fp32_acc=False moe_reduction_device_num_experts=None moe_reduction_scale_input=None
    moe_reduction_active_experts_token_input=None moe_reduction_token_input=None
    expanded_idx_to_permuted_idx=None expert_scale_factor=None shared_expert_output=None
    block_quant_group_size=None weight_bias=0.0 * moe_finalize_backend='trtllm'
""")
FI_SUFFICIENT = _signature("self tp_size num_tokens hidden_dim dtype use_oneshot=None")


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_signatures_and_exports_are_flashinfers():
    ours = _params(torch_compat.create_allreduce_fusion_workspace)
    assert ours[:-6] == [p for p in FI_CREATE if p[2] != KW]  # without the CuTe DSL options
    # Our additions, keyword-only (check_*: the handshake's names until 0.1.0).
    assert ours[-6:] == _signature(
        "* timeout_s=120.0 handshake=None handshake_timeout_s=None kernel_timeout_s=None "
        "check_calls=None check_timeout_s=None"
    )
    # Our addition, keyword-only: pattern 7's routed scaling (FlashInfer's unified API passes
    # None, i.e. 1.0, to its kernel).
    ours = _params(torch_compat.allreduce_fusion)
    assert ours[:-1] == FI_FUSION and ours[-1] == ("routed_scaling_factor", None, KW)
    sufficient = torch_compat.TorchAllReduceFusionWorkspace.is_buffer_size_sufficient
    assert _params(sufficient) == FI_SUFFICIENT
    assert torch_compat.AllReduceFusionPattern.kARResidualRMSNorm == 1
    assert torch_compat.QuantizationSFLayout.LINEAR == 2
    names = {"allreduce_fusion", "AllReduceFusionPattern", "QuantizationSFLayout"}
    assert set(torch_compat.__all__) >= names | {"create_allreduce_fusion_workspace"}
    assert set(ops.TORCH_PATTERNS) == set(torch_compat.AllReduceFusionPattern)  # all served


def _anchor_signature(tree, name):
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    a = fn.args
    pos = [x.arg for x in a.args]
    defaults = [_] * (len(pos) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    kw = [(x.arg, ast.literal_eval(d), KW) for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    return [(n, d, POS) for n, d in zip(pos, defaults)] + kw


@pytest.mark.skipif(not ANCHOR.exists(), reason="FlashInfer's source is not on this machine")
def test_hard_coded_lists_are_flashinfers():
    tree = ast.parse(ANCHOR.read_text())
    assert _anchor_signature(tree, "create_allreduce_fusion_workspace") == FI_CREATE
    assert _anchor_signature(tree, "allreduce_fusion") == FI_FUSION
    assert _anchor_signature(tree, "is_buffer_size_sufficient") == FI_SUFFICIENT


@pytest.mark.slow
def test_importing_torch_compat_does_not_import_jax():
    code = (
        "import sys, torch_compat; "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = run_code(code, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _tensors(m=16, h=1024, dtype=torch.bfloat16):
    x = torch.randn(m, h).to(dtype)
    t = dict(input=x, residual_in=torch.randn(m, h).to(dtype), rms_gamma=torch.randn(h).to(dtype))
    return t | dict(residual_out=torch.empty_like(x), norm_out=torch.empty_like(x))


# --- the workspace object
def test_workspace_metadata_and_buffer_rule():
    ws = fake_workspace(world=2, max_tokens=128, hidden=1024)
    md = ws.metadata
    want = dict(tp_rank=0, tp_size=2, max_token_num=128, hidden_dim=1024, use_fp32_lamport=False)
    assert {k: md[k] for k in want} == want
    assert md["lamport_comm_size"] == ws.sizes.lamport_comm_bytes and ws.backend == "trtllm"
    ok = ws.is_buffer_size_sufficient
    assert ok(2, 128, 1024, torch.bfloat16)
    assert ok(2, 256, 512, torch.float16)  # element count, and fp16 shares bf16's width
    assert not ok(2, 129, 1024, torch.bfloat16)
    assert not ok(4, 16, 1024, torch.bfloat16)  # TP size differs
    assert not ok(2, 16, 1024, torch.float32)  # width differs
    assert not ok(2, 16, 1024, torch.float64)
    assert not ok(2, 2, 1024, torch.bfloat16, use_oneshot=False)  # two-shot needs > 2 tokens
    assert ok(2, 3, 1024, torch.bfloat16, use_oneshot=False)
    assert fake_workspace(dtype=torch.float32).metadata["use_fp32_lamport"]


def test_destroy_is_idempotent_and_final(cpu_stream):
    ws = fake_workspace()
    rank = ws._rank_obj
    with ws as same:
        assert same is ws
    assert ws.destroyed and rank.destroyed == 1
    ws.destroy()
    assert rank.destroyed == 1
    for call in (
        lambda: ws.metadata,
        lambda: ws.is_buffer_size_sufficient(2, 1, 1024, torch.bfloat16),
        lambda: torch_compat.allreduce_fusion(workspace=ws, pattern=1, **_tensors()),
    ):
        with pytest.raises(RuntimeError, match="destroyed"):
            call()
    assert "destroyed" in repr(ws)


# --- allreduce_fusion: what reaches the kernel and what comes back
def test_pattern1_launch_arguments_and_return_value(cpu_stream):
    ws = fake_workspace()
    t = _tensors(m=16)
    out = fuse(ws, 1, launch_with_pdl=True, fp32_acc=True, rms_eps=1e-5, weight_bias=1.0, **t)
    assert out is t["norm_out"]  # FlashInfer returns norm_out for the norm patterns
    ((args, kw),) = ws._rank_obj.launches
    assert args == (1, native.DTYPE_CODES["bfloat16"], 16, 1024, t["input"].data_ptr())
    for name in ("residual_in", "residual_out", "norm_out", "rms_gamma"):
        assert kw[name] == t[name].data_ptr(), name
    assert kw["allreduce_out"] == 0  # pattern 1 writes no all-reduce output
    assert kw["stream"] == 0xC0FFEE and kw["algorithm"] == launch_mode.ALGORITHM_ONESHOT
    assert kw["launch_with_pdl"] and kw["fp32_acc"] and kw["trigger_completion_at_end"]
    assert kw["rms_eps"] == pytest.approx(1e-5) and kw["weight_bias"] == 1.0
    # In-place outputs (aliasing the inputs) are allowed.
    t["residual_out"], t["norm_out"] = t["residual_in"], t["input"]
    assert fuse(ws, 1, **t) is t["input"]


def test_pattern0_allocates_output_like_flashinfer(cpu_stream):
    ws = fake_workspace()
    x = torch.randn(8, 1024).to(torch.float16)  # fp16 on a bf16 workspace: same width
    out = torch_compat.allreduce_fusion(x, ws, torch_compat.AllReduceFusionPattern.kAllReduce)
    assert out.shape == x.shape and out.dtype == x.dtype and out is not x
    ((args, kw),) = ws._rank_obj.launches
    assert args[:2] == (0, native.DTYPE_CODES["float16"])
    assert kw["allreduce_out"] == out.data_ptr() and kw["residual_in"] == 0
    given = torch.empty_like(x)
    assert torch_compat.allreduce_fusion(x, ws, 0, output=given) is given
    # Inputs pattern 0 does not read are ignored, as in FlashInfer.
    unread = dict(scale_factor=2.0, layout_code=2, block_quant_group_size=128)
    unread.update(residual_in=torch.empty_like(x), rms_gamma=torch.empty(1024, dtype=x.dtype))
    torch_compat.allreduce_fusion(x, ws, 0, **unread)
    assert last_launch(ws)[1]["residual_in"] == 0


def test_oneshot_choice_is_the_topology_policy_and_forcible(cpu_stream):
    ws = fake_workspace(max_tokens=4096, hidden=4096)
    for m, use in ((1, None), (17, False), (17, True), (4096, None)):
        fuse(ws, 1, use_oneshot=use, **_tensors(m=m, h=4096))
        expected = launch_mode.choose_algorithm(m, 4096, ws.sizes, use)
        assert expected == int(launch_mode.choose_oneshot(m, 4096, ws.sizes, use))  # < 48 MiB
        assert last_launch(ws)[1]["algorithm"] == expected
    with pytest.raises(ValueError, match="two-shot needs more tokens"):
        _call(ws, use_oneshot=False, **_tensors(m=2, h=4096))


# --- allreduce_fusion: every refusal
def _call(ws, pattern=1, **over):
    return fuse(ws, pattern, **_tensors() | over)


E4M3, U8, I32 = torch.float8_e4m3fn, torch.uint8, torch.int32
_bf, _f8, _u8, _i32 = (
    functools.partial(torch.empty, dtype=d) for d in (torch.bfloat16, E4M3, U8, I32)
)


NO_NORM = dict(residual_out=None, norm_out=None)
OUTPUT_1 = r"pattern 1 \(kARResidualRMSNorm\) does not write output"


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(input=torch.randn(4, 8, 128).bfloat16()), "2-D"),
        (dict(input=torch.randn(1024).bfloat16()), "2-D"),
        (dict(input=torch.randn(16, 1024, dtype=torch.float64)), "not supported"),
        (dict(input=torch.ones(16, 1024, dtype=torch.int32)), "not supported"),
        (dict(input=torch.randn(1024, 16).bfloat16().t()), "contiguous"),
        (dict(input=torch.randn(0, 1024).bfloat16()), "empty"),
        (dict(input=torch.randn(16, 1024)), "element width"),  # fp32 on a bf16 workspace
        (dict(input=torch.randn(129, 1024).bfloat16()), "exceed the workspace"),
        (dict(input=torch.randn(16, 1020).bfloat16()), "multiple of 8"),
        (dict(residual_in=torch.randn(16, 512).bfloat16()), "residual_in must have"),
        (dict(residual_in=torch.randn(16, 1024).half()), "residual_in must have the input's dtype"),
        (dict(residual_out=_bf(8, 1024)), "residual_out must have"),
        (dict(norm_out=torch.empty(16, 1024)), "norm_out must have the input's dtype"),
        (dict(norm_out=_bf(1024, 16).t()), "norm_out must be contiguous"),
        (dict(pattern=0, **NO_NORM, output=_bf(16, 1023)), "output must have"),
        (dict(output=_bf(16, 1024)), OUTPUT_1),
        (dict(rms_gamma=_bf(16, 1024)), r"rms_gamma must have shape \[hidden_dim\]"),
        (dict(rms_gamma=torch.randn(1024)), "rms_gamma must have the input's dtype"),
        (dict(rms_gamma=[1.0] * 1024), "rms_gamma must be a torch.Tensor"),
        (dict(rms_gamma=torch.randn(1025).bfloat16()[1:]), "16-byte boundary"),
        (dict(residual_in=None), "needs residual_in"),
        (dict(rms_gamma=None), "needs rms_gamma"),
        (dict(residual_out=None), "needs residual_out"),
        (dict(norm_out=None), "needs norm_out"),
        (dict(quant_out=torch.empty(16, 1024, dtype=torch.uint8)), "does not write quant_out"),
        (dict(scale_out=torch.empty(16, 1)), "does not write scale_out"),
        (dict(pattern=0, norm_out=_bf(16, 1024)), "does not write"),
        # FlashInfer's MoE codes: their own inputs (tests/torch/test_moe.py)
        (dict(pattern=6), "kMoEReductionARResidualRMSNorm needs moe_reduction_device_num_experts"),
        (dict(pattern=7), "kMoEFinalizeARResidualRMSNorm needs expanded_idx_to_permuted_idx"),
        (dict(pattern=12), "unknown fusion pattern"),
        (dict(pattern=99), "unknown fusion pattern"),
        (dict(input="x"), "must be a torch.Tensor"),
        (dict(device="cuda:3"), r"input must be on cuda:3 \(the workspace's device\)"),
        # 1025 vectors of 8: odd, so a cluster of one CTA, which would need 1025 > 1024 threads.
        (dict(ws=dict(max_tokens=4, hidden=16384), **_tensors(m=1, h=8200)), "threads per CTA"),
    ],
)
def test_refused_with_a_clear_value_error(cpu_stream, over, match):
    over = dict(over)
    ws = fake_workspace(**over.pop("ws", {}))
    ws.torch_device = torch.device(over.pop("device", "cpu"))
    refused(ws, over.pop("pattern", 1), match, **_tensors() | over)


def test_not_a_workspace_is_a_type_error():
    with pytest.raises(TypeError, match="create_allreduce_fusion_workspace"):
        torch_compat.allreduce_fusion(torch.randn(2, 8), object(), 0)


# --- create_allreduce_fusion_workspace: checks before any exchange
CREATE = dict(max_token_num=16, hidden_dim=1024, dtype=torch.bfloat16)


def create_refused(match, *args, error=ValueError, **kw):
    """create_allreduce_fusion_workspace(*args, **CREATE | kw) raises ``error`` matching
    ``match``; returns the exception."""
    with pytest.raises(error, match=match) as info:
        torch_compat.create_allreduce_fusion_workspace(*args, **CREATE | kw)
    return info.value


def test_create_needs_torch_distributed():
    assert not dist.is_initialized()
    create_refused("init_process_group", world_size=2, rank=0, error=RuntimeError)


WORLD_1 = f"world size 1 is not supported.*{', '.join(map(str, SUPPORTED_WORLD_SIZES))}"
ONE_RANK, TWO_RANKS = dict(world_size=1, rank=0), dict(world_size=2, rank=0)
# FlashInfer's CommBackend protocol, built over another group.
OTHER_GROUP = ONE_RANK | dict(
    comm_backend=types.SimpleNamespace(Get_rank=lambda: 3, Get_size=lambda: 1)
)
CREATE_REFUSALS = {
    "rank_must_be_group_local": ((), dict(world_size=1, rank=1), "group-local"),
    "world_size_must_be_the_groups": ((), TWO_RANKS, r"world_size=2 but the TP group has 1 ranks"),
    "world_size_1": ((), ONE_RANK, WORLD_1),
    "world_size_1_implied": ((), dict(world_size=None, rank=None), WORLD_1),
    "world_size_1_new_group": ((), ONE_RANK | dict(group="new"), WORLD_1),
    "world_size_1_new_group_implied": ((), dict(world_size=None, rank=None, group="new"), WORLD_1),
    "xla": (("xla", 2, 0), {}, "does not exist under torch"),
    "mnnvl": (("mnnvl", 2, 0), {}, "multicast"),
    "mnnvl-cutedsl": (("mnnvl-cutedsl", 2, 0), {}, "unknown all-reduce backend"),
    "nccl": (("nccl", 2, 0), {}, "unknown all-reduce backend"),
    "xla_from_the_environment": (("auto", 2, 0), dict(env="xla"), "does not exist under torch"),
    **{
        f"dtype_{d}": ((), ONE_RANK | dict(dtype=d), "dtype must be torch.bfloat16")
        for d in (None, torch.float64, torch.int8, "bfloat16")
    },
    "comm_backend_of_another_group": ((), OTHER_GROUP, "comm_backend.Get_rank"),
}


@pytest.mark.parametrize("case", CREATE_REFUSALS)
def test_create_refused(gloo_world1, monkeypatch, case):
    args, kw, match = CREATE_REFUSALS[case]
    kw = dict(kw)
    if kw.get("group") == "new":
        kw["group"] = dist.new_group([0])
    if "env" in kw:
        monkeypatch.setenv(backend_choice.BACKEND_ENV_VAR, kw.pop("env"))
    create_refused(match, *args, **kw)


# --- the store channel
@pytest.fixture(params=["hash", "tcp"])
def stores(request):
    """A factory of store handles on one store: the same HashStore object, or a new TCPStore
    client per call (as each process would have), all on one server."""
    if request.param == "hash":
        store = dist.HashStore()
        yield lambda: store
    else:
        timeout = datetime.timedelta(seconds=30)
        server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
        yield lambda: dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timeout)
        del server


def test_channel_publish_fetch_roundtrip_and_a_late_publisher(stores):
    a, b = StoreChannel(stores(), timeout_s=5), StoreChannel(stores(), timeout_s=5)
    payload = bytes(range(256)) * 3  # IPC handles are binary
    a.publish("k/1", payload)
    assert b.fetch("k/1", "peer") == payload
    b.publish("k/2", b"x")
    assert b.fetch_many({"k/1": "a", "k/2": "b"}) == {"k/1": payload, "k/2": b"x"}
    chan, late = StoreChannel(stores(), timeout_s=10), StoreChannel(stores(), timeout_s=10)
    timer = threading.Timer(0.3, late.publish, args=("late", b"ok"))
    timer.start()
    assert chan.fetch("late", "late peer") == b"ok"
    timer.join()


def test_channel_fetch_names_who_is_missing_within_the_timeout(stores):
    chan = StoreChannel(stores(), timeout_s=0.5)
    chan.publish("present", b"1")
    absent = {"absent/1": "TP rank 1 (global rank 5)", "absent/2": "TP rank 2 (global rank 6)"}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        chan.fetch_many({"present": "TP rank 0", **absent})
    assert time.monotonic() - t0 < 3
    msg = str(e.value)
    assert all(who in msg for who in absent.values())
    assert "TP rank 0" not in msg and "0.5 s" in msg


@pytest.mark.parametrize("present", [[4, 5, 6], [4, 6]], ids=["all_arrive", "one_missing"])
def test_channel_barrier(stores, present):
    """Releases when all arrive (staggered: nobody may leave before the last one), else
    times out counting the arrivals."""
    timeout_s = 10 if len(present) == 3 else 0.5

    def arrive(p):
        time.sleep(0.05 * present.index(p))
        StoreChannel(stores(), timeout_s=timeout_s, process=p).barrier("b/1", [4, 5, 6])

    t0 = time.monotonic()
    done, errors = run_in_threads(arrive, present, timeout_s + 10)
    if len(present) == 3:
        assert not errors and sorted(done) == [4, 5, 6]
        return
    assert time.monotonic() - t0 < 5 and not done
    for e in errors.values():
        assert isinstance(e, TimeoutError)
        assert "only 2 of 3" in str(e) and "not arrived: global ranks [5]" in str(e)


def test_channel_barrier_reuse_is_detected():
    store = dist.HashStore()
    StoreChannel(store, timeout_s=1).barrier("b", [0])
    with pytest.raises(RuntimeError, match="reused"):
        StoreChannel(store, timeout_s=1).barrier("b", [0])


# --- exchange keys and the group exchange
def _key(ranks, serial, purpose="member/rank0"):
    group = tp_groups.TPGroup(tuple(ranks), 0)
    return exchange.exchange_key(wsmod.NAMESPACE, group, serial, purpose)


def test_keys_and_serials_per_group(monkeypatch):
    monkeypatch.setattr(wsmod, "_serials", {})
    # A process that also builds a WORLD workspace keeps its TP group's serials in step with
    # a peer that does not.
    assert wsmod._next_serial([0, 1, 2, 3]) == 1
    assert wsmod._next_serial([0, 1]) == 1 and wsmod._next_serial([0, 1]) == 2
    assert wsmod._next_serial([2, 3]) == 1
    monkeypatch.setattr(wsmod, "_serials", {})
    # vLLM seeds `random` the same on every rank; keys must not depend on it.
    keys = {}
    for ranks in ([0, 1], [2, 3]):
        random.seed(1234)
        keys[tuple(ranks)] = _key(ranks, wsmod._next_serial(ranks))
    assert keys[(0, 1)] != keys[(2, 3)]
    # Same group, same serial -> the same key in every member (no coordination needed) ...
    random.seed(99)
    assert _key([0, 1], 1) == keys[(0, 1)]
    # ... and the group's next workspace gets a new one.
    assert _key([0, 1], wsmod._next_serial([0, 1])) != keys[(0, 1)]


def _join_threads(layout, timeout_s=10.0, hosts=None, skip=(), backend="trtllm"):
    """layout: {global rank: (group's global ranks, device)}; one thread per process on one
    HashStore (the default store each process would share)."""
    store = dist.HashStore()

    def join(me):
        ranks, device = layout[me]
        kw = dict(global_ranks=ranks, me=me, device=device, host=(hosts or {}).get(me, "node0"))
        kw.update(channel=StoreChannel(store, timeout_s=timeout_s, process=me), serial=1)
        return wsmod._join_group(**kw, backend=backend, make_rank=lambda d, t: FakeRank(me, d, t))

    return run_in_threads(join, [p for p in layout if p not in skip], timeout_s * 4)


DP_TP = {0: ([0, 1], 0), 1: ([0, 1], 1), 2: ([2, 3], 1), 3: ([2, 3], 0)}


def test_dp_tp_groups_exchange_only_within_themselves():
    random.seed(0)
    out, errors = _join_threads(DP_TP)
    assert not errors, errors
    ranks = {p: o[0] for p, o in out.items()}
    # Group B: global 2 is TP rank 0 on GPU 1, global 3 TP rank 1 on GPU 0, and each opened
    # its own group's peer, never group A's.
    assert (ranks[2].tp_rank, ranks[2].device) == (0, 1)
    assert (ranks[3].tp_rank, ranks[3].device) == (1, 0)
    assert ranks[0].peers == {1: ("ipc", "ipc:1:1:1")}
    assert ranks[1].peers == {0: ("ipc", "ipc:0:0:0")}
    assert ranks[2].peers == {1: ("ipc", "ipc:3:0:1")}
    assert ranks[3].peers == {0: ("ipc", "ipc:2:1:0")}
    assert all(r.finalized for r in ranks.values())
    assert out[3][1] == [exchange.Member(2, 1), exchange.Member(3, 0)]


def test_member_that_never_joins_is_named():
    t0 = time.monotonic()
    out, errors = _join_threads(DP_TP, timeout_s=0.5, skip=(3,))
    assert time.monotonic() - t0 < 5
    assert set(out) == {0, 1} and set(errors) == {2}
    assert isinstance(errors[2], TimeoutError)
    assert "TP rank 1 of group [2, 3] (global rank 3)" in str(errors[2])


def test_group_across_hosts_is_refused_by_every_member():
    layout = {0: ([0, 1], 0), 1: ([0, 1], 0)}
    out, errors = _join_threads(layout, hosts={1: "node1"}, backend="auto")
    assert not out and set(errors) == {0, 1}
    for e in errors.values():
        assert isinstance(e, ValueError) and "spans 2 nodes" in str(e)
        # The group's members and hosts are named (tp_groups.group_hosts); the advice names
        # no JAX-only backend (torch's backend errors contradicted themselves), but the
        # torch way.
        assert "TP group [0, 1] (global ranks) spans 2 nodes (node0: [0]; node1: [1])" in str(e)
        assert "'xla'" not in str(e) and "torch.distributed.all_reduce" in str(e)


def test_shared_gpu_is_allowed_with_a_warning(caplog):
    out, errors = _join_threads({0: ([0, 1], 0), 1: ([0, 1], 0)})
    assert not errors and set(out) == {0, 1}
    assert "share a GPU" in caplog.text


# --- multi-process CPU run over gloo: groups from dist.new_group, the real default store
def gloo_worker(rank, world, chan, *, port):
    """DP=2 x TP=2 with gloo: the checks that need real subgroups, and the exchange over
    the default store with the crossed device layout (fake ranks: no GPU here)."""
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    try:
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every process, same order
        group = groups[rank // 2]
        random.seed(1234)  # as vLLM does, identically everywhere

        def _error_of(**kw):
            try:
                torch_compat.create_allreduce_fusion_workspace(
                    "trtllm", group=group, **CREATE, timeout_s=5, **kw
                )
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            return "created"

        seen = {"world_size": _error_of(world_size=world, rank=rank % 2)}
        if rank >= 2:  # the global rank where the group-local one belongs
            seen["global_rank"] = _error_of(world_size=2, rank=rank)
        elif not torch.cuda.is_available():  # correct arguments: stops at the missing GPU
            seen["correct"] = _error_of(world_size=2, rank=rank)
        ranks = dist.get_process_group_ranks(group)
        kw = dict(global_ranks=ranks, me=rank, device=[0, 1, 1, 0][rank], backend="auto")
        kw.update(host=socket.gethostname(), channel=StoreChannel(timeout_s=30, process=rank))
        kw.update(serial=wsmod._next_serial(ranks), make_rank=lambda d, t: FakeRank(rank, d, t))
        native, members = wsmod._join_group(**kw)
        out = dict(seen=seen, tp_rank=native.tp_rank, device=native.device)
        out["peers"] = {str(k): v for k, v in native.peers.items()}
        return out | {"members": [(m.process, m.device) for m in members]}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dp_tp_over_gloo_four_processes():
    res = run_ranks(gloo_worker, 4, timeout_s=180, port=free_port())
    for g, r in enumerate(res):
        assert "the size of `group`" in r["seen"]["world_size"], r["seen"]
        if g >= 2:
            assert "group-local" in r["seen"]["global_rank"], r["seen"]
        elif not torch.cuda.is_available():
            assert "needs a CUDA GPU" in r["seen"]["correct"], r["seen"]
        assert r["tp_rank"] == g % 2 and r["device"] == [0, 1, 1, 0][g]
    assert res[2]["members"] == [(2, 1), (3, 0)]
    assert res[2]["peers"] == {"1": ("ipc", "ipc:3:0:1")}
    assert res[3]["peers"] == {"0": ("ipc", "ipc:2:1:0")}
    assert res[0]["peers"] == {"1": ("ipc", "ipc:1:1:1")}


# --- allreduce_fusion: the quantized patterns
QP = torch_compat.AllReduceFusionPattern
NVFP4 = (QP.kARResidualRMSNormFP4Quant, QP.kARResidualRMSNormOutFP4Quant)
QUANT = [QP(p) for p in (2, 4, 10, 11, 8, 9, 3, 5)]


def group_scale_out(m, h, g):
    """FlashInfer's per-token-group scale tensor: (M, K) int32 with strides (1, T)."""
    k, t = quant_layouts.group_scale_buffer_shape(m, h, g)
    return torch.empty(k, t, dtype=torch.int32)[:, :m].t()


def _qtensors(pattern, m=16, h=1024, dtype=torch.bfloat16, group=128, layout=None):
    """A valid full argument set for quantized ``pattern`` (CPU tensors)."""
    traits = TRAITS[QP(pattern)]
    t = _tensors(m, h, dtype)
    if not traits.has_norm_out:
        del t["norm_out"]
    if traits.quant == "fp4":
        shape = quant_layouts.nvfp4_scale_shape(m, h, layout or 0)
        t["quant_out"] = torch.empty(m, h // 2, dtype=torch.uint8)
        t["scale_out"] = torch.empty(shape, dtype=torch.float8_e4m3fn)
        t["scale_factor"] = torch.tensor([448.0 * 6.0], dtype=torch.float32)
        if layout is not None:
            t["layout_code"] = layout
    else:
        t["quant_out"] = torch.empty(m, h, dtype=torch.float8_e4m3fn)
        if traits.quant == "fp8":
            t["scale_factor"] = torch.tensor([0.05], dtype=torch.float32)
        elif traits.quant == "dynamic_fp8":
            t["scale_out"] = torch.empty(m, 1, dtype=torch.float32)
        else:
            t["scale_out"] = group_scale_out(m, h, group)
            t["block_quant_group_size"] = group
    return t


@pytest.mark.parametrize("pattern", QUANT, ids=lambda p: p.name)
def test_quantized_pattern_launch_arguments_and_return_value(cpu_stream, sm100, pattern):
    traits = TRAITS[pattern]
    ws = fake_workspace()
    t = _qtensors(pattern)
    out = fuse(ws, pattern, fp32_acc=True, **t)
    # FlashInfer: norm_out when the pattern writes it, else quant_out.
    assert out is (t["norm_out"] if traits.has_norm_out else t["quant_out"])
    ((args, kw),) = ws._rank_obj.launches
    assert args == (int(pattern), native.DTYPE_CODES["bfloat16"], 16, 1024, t["input"].data_ptr())
    ptr = {k: v.data_ptr() for k, v in t.items() if torch.is_tensor(v)}
    assert kw["quant_out"] == ptr["quant_out"] and kw["scale_out"] == ptr.get("scale_out", 0)
    assert kw["norm_out"] == (ptr["norm_out"] if traits.has_norm_out else 0)
    assert kw["residual_out"] == ptr["residual_out"] and kw["allreduce_out"] == 0
    assert kw["scale_factor"] == ptr.get("scale_factor", 0)
    assert kw["block_quant_group_size"] == (128 if pattern in (8, 9) else 0)  # per token group
    assert kw["layout"] == 0


def test_group_scale_view_is_flashinfers_and_covers_what_the_kernel_writes():
    for m, h, g in ((1, 1024, 128), (5, 4096, 128), (16, 7168, 64), (17, 1024, 512)):
        spec = results.result_spec(9, "scale_out", m, h, "bfloat16", group_size=g)
        shape, strides = spec.shape, spec.strides
        k, t = quant_layouts.group_scale_buffer_shape(m, h, g)
        assert spec.storage_shape == (k, t) and spec.dtype == "int32"
        assert shape == (m, -(-(h // g) // 4)) == (m, k) and strides == (1, (m + 3) // 4 * 4)
        v = group_scale_out(m, h, g)
        assert tuple(v.shape) == shape and v.stride() == strides
        s = torch.empty_strided(shape, strides, dtype=torch.int32)
        # The minimal storage FlashInfer describes, which is everything the kernel writes
        # (its last pack skips the padding tokens).
        words = quant_layouts.group_scale_min_storage_words(m, h, g)
        assert s.untyped_storage().nbytes() // 4 == words


def test_nvfp4_layouts_and_sizes(cpu_stream, sm100):
    ws = fake_workspace(max_tokens=200, hidden=1024)
    for layout in (0, 2):
        t = _qtensors(QP.kARResidualRMSNormOutFP4Quant, m=130, layout=layout)
        fuse(ws, 5, **t)
        assert last_launch(ws)[1]["layout"] == layout
        # int32 and uint8 views of the same bytes are accepted too (vLLM keeps int32).
        size = quant_layouts.nvfp4_scale_buffer_size(130, 1024, layout)
        for sd, n in ((torch.int32, size // 4), (torch.uint8, size)):
            fuse(ws, 5, **t | {"scale_out": torch.empty(n, dtype=sd)})
    # The default layout is SWIZZLED_128x4 (FlashInfer's layout_code=None).
    fuse(ws, 3, **_qtensors(QP.kARResidualRMSNormFP4Quant, m=130))
    assert last_launch(ws)[1]["layout"] == 0


def test_nvfp4_is_refused_below_sm100(cpu_stream, sm90):
    ws = fake_workspace()
    for p in NVFP4:
        refused(ws, p, r"NVFP4 patterns \(3, 5\) need an sm100\+ GPU.*sm90", **_qtensors(p))
    assert not ws._rank_obj.launches
    fuse(ws, 4, **_qtensors(4))  # the FP8 patterns do not depend on the architecture


def test_scale_factor_as_python_float_like_flashinfer(cpu_stream, monkeypatch):
    ws = fake_workspace()
    t = _qtensors(QP.kARResidualRMSNormFP8Quant)
    t["scale_factor"] = 0.25
    fuse(ws, 2, **t)
    assert last_launch(ws)[1]["scale_factor"] != 0
    for bad, match in (
        (0.0, "positive and finite"),
        (-1.0, "positive"),
        (float("inf"), "finite"),
        (float("nan"), "positive"),
        (True, "float32 tensor or a float"),
        ("2", "float32 tensor or a float"),
    ):
        refused(ws, 2, match, **t | {"scale_factor": bad})
    # Under CUDA-graph capture a float would need an uncapturable host->device copy.
    monkeypatch.setattr(cuda_state, "capturing", lambda: True)
    refused(ws, 2, "CUDA graph cannot capture", **t)
    fuse(ws, 2, **t | {"scale_factor": torch.tensor([0.25])})  # a tensor is fine


def test_quantized_inputs_a_pattern_does_not_read_are_ignored(cpu_stream):
    ws = fake_workspace()
    t = _qtensors(QP.kARResidualRMSNormOutDynamicFP8Quant)
    fuse(ws, 11, scale_factor=2.0, layout_code=1, block_quant_group_size=3, **t)
    kw = last_launch(ws)[1]
    assert kw["scale_factor"] == 0 and kw["layout"] == 0 and kw["block_quant_group_size"] == 0


def _bad(pattern, **over):
    return pattern, _qtensors(pattern) | over


STRIDE_1_16, ROUND_UP = r"stride must be \(1, 16\)", r".*round_up\(token_num, 4\) = 16"


@pytest.mark.parametrize(
    "pattern, t, match",
    [
        # every quantized pattern needs quant_out (and the pattern's scale_out)
        (*_bad(2, quant_out=None), r"needs quant_out"),
        (*_bad(11, scale_out=None), r"needs scale_out"),
        (*_bad(10, quant_out=None, scale_out=None), r"needs quant_out, scale_out"),
        (*_bad(8, scale_out=None), r"needs scale_out"),
        (*_bad(4, norm_out=None), r"needs norm_out"),
        (*_bad(9, residual_in=None), r"needs residual_in"),
        # outputs the pattern does not write
        (*_bad(2, norm_out=_bf(16, 1024)), "does not write norm_out"),
        (*_bad(4, scale_out=torch.empty(16, 1)), "does not write scale_out"),
        (*_bad(10, output=_bf(16, 1024)), "does not write output"),
        # quant_out
        (*_bad(2, quant_out=_u8(16, 1024)), "quant_out must have dtype"),
        (*_bad(4, quant_out=_f8(16, 512)), r"quant_out must have shape \[16, 1024\]"),
        (*_bad(11, quant_out=_f8(1024, 16).t()), "quant_out must be contiguous"),
        (*_bad(10, quant_out=_f8(16 * 1024 + 1)[1:].view(16, 1024)), "16-byte boundary"),
        (*_bad(9, quant_out=[0] * 4), "quant_out must be a torch.Tensor"),
        # static scale_factor
        (*_bad(2, scale_factor=None), r"needs scale_factor \(the dequantization scale"),
        (*_bad(4, scale_factor=torch.tensor([1.0], dtype=torch.float64)), "float32 tensor, got"),
        (*_bad(4, scale_factor=torch.ones(2)), r"shape \[1\]"),
        # dynamic scale_out
        (*_bad(10, scale_out=torch.empty(16)), r"scale_out must have shape \[token_num, 1\]"),
        (*_bad(11, scale_out=torch.empty(16, 1, dtype=torch.float16)), "torch.float32"),
        # [M, 1] with any stride on the size-1 dim is contiguous: accepted
        (*_bad(11, scale_out=torch.empty(1, 16).t()), None),
        (*_bad(11, scale_out=torch.empty(16, 2)[:, :1]), "scale_out must be contiguous"),
        # per-token-group
        (*_bad(8, block_quant_group_size=None), "block_quant_group_size is required"),
        (*_bad(8, block_quant_group_size=0), "group_size must be > 0"),
        (*_bad(8, block_quant_group_size=-128), "group_size must be > 0"),
        (*_bad(8, block_quant_group_size=48), "must be divisible by group_size"),
        (*_bad(8, block_quant_group_size=4), "power of two from 8 to 256"),
        (*_bad(9, block_quant_group_size=512), "power of two from 8 to 256"),
        (*_bad(9, block_quant_group_size=128.0), "must be an int"),
        (*_bad(9, block_quant_group_size=True), "must be an int"),
        (*_bad(8, scale_out=_i32(2, 17)[:, :16].t()), STRIDE_1_16 + ROUND_UP),
        (*_bad(8, scale_out=_i32(16, 2)), r"scale_out " + STRIDE_1_16),
        (*_bad(8, scale_out=group_scale_out(16, 1024, 64)), r"scale_out shape must be \(16, 2\)"),
        (*_bad(9, scale_out=torch.empty(2, 16).t()), "torch.int32"),
        (*_bad(9, scale_out=torch.empty(2, 16, dtype=torch.int64).t()), "torch.int32"),
        # NVFP4
        (*_bad(3, quant_out=_u8(16, 1024)), r"quant_out must have shape \[16, 512\]"),
        (*_bad(5, quant_out=_f8(16, 512)), "quant_out must have dtype torch.uint8"),
        (*_bad(3, scale_out=_f8(128, 60)), "exactly 8192 bytes"),
        (*_bad(5, scale_out=_f8(16, 64)), r"SWIZZLED_128x4.*\(128, 64\)"),
        (*_bad(5, scale_out=torch.empty(128, 64).half()), "scale_out must have dtype"),
        (*_bad(5, scale_out=_f8(64, 128).t()), "scale_out must be contiguous"),
        (*_bad(5, layout_code=1), "SWIZZLED_8x4"),
        (*_bad(5, layout_code=7), "unknown NVFP4 scale layout"),
        (*_bad(5, layout_code=2), r"exactly 1024 bytes.*LINEAR"),  # swizzled-size, linear layout
        (*_bad(3, scale_factor=None), r"needs scale_factor \(the NVFP4 global scale"),
        (*_bad(5, scale_out=None), "needs scale_out"),
    ],
)
def test_quantized_refusals_are_clear_value_errors(cpu_stream, sm100, pattern, t, match):
    if match is None:  # accepted variants next to the refusals
        fuse(fake_workspace(), pattern, **t)
    else:
        refused(fake_workspace(), pattern, match, **t)


def test_group_size_rule_follows_dtype_width(cpu_stream):
    ws = fake_workspace(dtype=torch.float32)
    fuse(ws, 8, **_qtensors(8, dtype=torch.float32, group=4))  # fp32: 4 per 16-byte vector
    assert last_launch(ws)[1]["block_quant_group_size"] == 4
    t = _qtensors(8, dtype=torch.float32, group=256)
    refused(ws, 8, "power of two from 4 to 128 for float32", **t)
    # Hidden 1088 is no multiple of 128: tensors built for group 64 (a divisor), 128 asked.
    t = _qtensors(8, h=1024 + 64, group=64) | dict(block_quant_group_size=128)
    refused(fake_workspace(hidden=2048), 8, "must be divisible by group_size", **t)
    # 96 divides 1536 but is no power of two: the kernel's shared-memory path, not offered.
    with pytest.raises(ValueError, match="power of two from 8 to 256 for bfloat16, got 96"):
        fuse(fake_workspace(), 9, **_qtensors(9, h=1536, group=96))


def test_nvfp4_needs_16bit_input_and_hidden_multiple_of_16(cpu_stream, sm100):
    ws, t = fake_workspace(dtype=torch.float32), _qtensors(5, dtype=torch.float32)
    refused(ws, 5, "bfloat16 or float16 input, got float32", **t)
    # 1032 = 129 vectors of 8: launchable, but not whole 16-element NVFP4 blocks. (The scale
    # tensor is of hidden 1040, as none of 1032 exists.)
    t = _qtensors(5, h=1040)
    t.update((k, v) for k, v in _tensors(16, 1032, torch.bfloat16).items() if k in t)
    t["quant_out"] = torch.empty(16, 1032 // 2, dtype=torch.uint8)
    refused(fake_workspace(max_tokens=16, hidden=2048), 5, "divisible by 16", **t)
