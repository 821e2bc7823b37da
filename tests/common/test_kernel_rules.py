"""Tests for the rules in jax_fusedar.common: kernel limits (limits), workspace sizes (sizing),
launch policy (launch_mode), TP groups (tp_groups), exchange keys (exchange) and backend choice
(backend_choice). Expected numbers are worked out by hand in the comments."""

import dataclasses
import importlib.util
import itertools
import random
import re

import numpy as np
import pytest

from jax_fusedar.common import launch_mode, lifecycle, limits, sizing
from jax_fusedar.common.backend_choice import BACKEND_ENV_VAR as BACKEND_VAR, STRICT_ENV_VAR
from jax_fusedar.common.backend_choice import BackendChoice, resolve_backend, strict_mode
from jax_fusedar.common.backend_choice import resolve_backend_for_groups
from jax_fusedar.common.exchange import exchange_key
from jax_fusedar.common.launch_mode import ALGORITHM_LARGE_MESSAGE as LARGE
from jax_fusedar.common.launch_mode import ALGORITHM_ONESHOT as ONESHOT
from jax_fusedar.common.launch_mode import ALGORITHM_TWOSHOT as TWOSHOT
from jax_fusedar.common.launch_mode import ONESHOT_MAX_MIB, choose_algorithm, choose_oneshot
from jax_fusedar.common.launch_mode import large_message_problem, prefers_large_message
from jax_fusedar.common.launch_mode import oneshot_feasible, twoshot_feasible
from jax_fusedar.common.limits import check_kernel_supports, element_size, vector_width
from jax_fusedar.common.limits import kernel_support_problem
from jax_fusedar.common.sizing import MAX_COMM_SIZE as CAP, buffer_fits, workspace_sizes
from jax_fusedar.common.tp_groups import TPGroup, group_hosts, tp_groups_from_grid
from tests.repo import REPO, run_code

MIB = 1 << 20


def test_the_documented_environment_variables_are_the_ones_read(monkeypatch):
    # The names users set (docs/jax_api.md, docs/multinode.md), not the modules' constants: a
    # renamed variable would leave users' settings silently ignored. One node by default.
    assert resolve_backend(None, platform="cuda", env={}) == "trtllm"
    monkeypatch.setenv("JAX_FUSEDAR_STRICT", "1")
    assert strict_mode(None) is True
    monkeypatch.setenv("JAX_FUSEDAR_STRICT", "off")
    assert strict_mode(None) is False
    monkeypatch.setenv("JAX_FUSEDAR_ALLREDUCE_BACKEND", "xla")
    assert resolve_backend(None, platform="cuda") == "xla"


# --- dtypes and kernel support -------------------------------------------------------------------
# (dtype, supported hidden sizes, unsupported-by-launch-limit hidden sizes). With VEC = 8
# (16-bit) or 4 (fp32), t = H / VEC, c = largest of 8/4/2/1 dividing t, need t / c <= 1024.
# bfloat16 good: t=896 c=8 -> 112; t=1024 c=8; t=8192 c=8 -> 1024 (max); t=1023 odd -> 1023;
# t=2046 c=2 -> 1023; t=4092 c=4 -> 1023. bad: t=8193 odd; t=8200 c=8 -> 1025; t=1025 odd;
# t=2050 c=2 -> 1025; t=4100 c=4 -> 1025.
# float32 good: t=1792 c=8; t=8192 c=8 -> 1024; t=1023 odd; t=2046 c=2 -> 1023. bad: t=8200
# c=8 -> 1025; t=1025 odd; t=8193 odd; t=2050 c=2 -> 1025.
LAUNCH_CASES = [
    ("bfloat16", [7168, 8192, 65536, 8184, 16368, 32736], [65544, 65600, 8200, 16400, 32800]),
    ("float16", [7168, 8192, 65536, 8184], [65544, 65600, 8200]),
    ("float32", [7168, 32768, 4092, 8184], [32800, 4100, 32772, 8200]),
]


@pytest.mark.parametrize("dtype, good, bad", LAUNCH_CASES)
def test_launch_limit_both_sides(dtype, good, bad):  # the bad side: in REFUSED
    for hidden in good:
        assert kernel_support_problem(2, hidden, dtype) is None, hidden
        check_kernel_supports(2, hidden, dtype)


def test_dtype_sizes_and_kernel_support_spot_values():
    sizes = {d: (element_size(d), vector_width(d)) for d in ("bfloat16", "float16", "float32")}
    assert sizes == {"bfloat16": (2, 8), "float16": (2, 8), "float32": (4, 4)}
    assert all(kernel_support_problem(w, 4096, BF) is None for w in limits.SUPPORTED_WORLD_SIZES)
    message = kernel_support_problem(8, 65544, "bfloat16")
    for part in ("8193 vectors", "cluster of 1", "8193 threads per CTA", "hidden_dim <= 65536"):
        assert part in message
    assert "unsupported dtype" in kernel_support_problem(2, 4096, "float64")  # no raise
    assert kernel_support_problem(np.int64(4), np.int32(4096), "float32") is None  # numpy ints


# --- Workspace sizes ------------------------------------------------------------------------------
# workspace -> (two-shot buffer, flags, Lamport stride, Lamport buffer) bytes; the rank's total
# is the buffers and flags with the 20-byte control block. CAP: MAX_COMM_SIZE = 1023 * 2**21.
SIZES = {
    # 2 * 128 * 4096 * 2 = 2 MiB; flags 2 * 256 * 4; Lamport buffer 3 strides.
    "bf16_tp2": ((2, 128, 4096, "bfloat16"), (2_097_152, 2048, 2_097_152, 6_291_456)),
    # 8 * 32 * 1024 * 4 = 1 MiB; flags 8 * 256 * 4.
    "fp32_tp8": ((8, 32, 1024, "float32"), (1_048_576, 8192, 1_048_576, 3_145_728)),
    # 2 ranks * 1 token * 5 elements * 2 bytes = 20 -> 32; the stride is rounded too.
    "round_up_to_16": ((2, 1, 5, "float16"), (32, 2048, 32, 96)),
    # 2 * 1 * 4 * 2 = 16 is already aligned.
    "aligned_16": ((2, 1, 4, "bfloat16"), (16, 2048, 16, 48)),
    # 2 ranks * 512 tokens * (1023*1024) * 2 bytes hits MAX_COMM_SIZE exactly.
    "lamport_cap": ((2, 512, 1023 * 1024, "bfloat16"), (CAP, 2048, CAP, 3 * CAP)),
    # One more token: the two-shot buffer grows by a token's row, the Lamport stride does not.
    "lamport_cap_over": (
        (2, 513, 1023 * 1024, "bfloat16"),
        (CAP + 2 * 1023 * 1024 * 2, 2048, CAP, 3 * CAP),
    ),
    # 8 * 16384 * 8192 * 2 = 2**31 bytes: two-shot buffer uncapped, Lamport stride capped.
    "lamport_cap_large_tp8": (
        (8, 16384, 8192, "bfloat16"),
        (2**31, 8 * 256 * 4, CAP, 6_436_159_488),
    ),
}


@pytest.mark.parametrize("args, expected", SIZES.values(), ids=SIZES)
def test_sizes(args, expected):
    s = workspace_sizes(*args)
    got = (s.two_shot_buffer_bytes, s.flag_bytes, s.lamport_comm_bytes, s.lamport_buffer_bytes)
    assert got == expected
    two_shot, flags, _, lamport_buffer = expected
    assert s.per_rank_bytes == two_shot + flags + lamport_buffer + 20
    assert s.use_fp32_lamport == (args[3] == "float32")
    assert (s.world_size, s.max_token_num, s.hidden_dim, s.dtype_name) == args


def test_sizes_fp16_equal_bf16_and_are_plain_ints():
    bf16, fp16 = (workspace_sizes(4, 64, 2048, dtype) for dtype in ("bfloat16", "float16"))
    assert dataclasses.replace(bf16, dtype_name="float16") == fp16
    s = workspace_sizes(np.int64(2), np.int32(16), np.int64(1024), "bfloat16")
    fields = (s.world_size, s.max_token_num, s.hidden_dim, s.per_rank_bytes)
    assert [type(v) for v in fields] == [int] * 4


def test_workspace_sizes_is_frozen_and_buffer_fits_is_an_element_count():
    s = workspace_sizes(2, 128, 4096, "bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_token_num = 1
    # 256 x 2048: another hidden, the same element count.
    assert [buffer_fits(m, h, s) for m, h in ((128, 4096), (256, 2048), (64, 8192))] == [True] * 3
    assert not buffer_fits(129, 4096, s) and not buffer_fits(65, 8192, s)


# --- One-shot / two-shot policy -------------------------------------------------------------------
CH, OF, TF = choose_oneshot, oneshot_feasible, twoshot_feasible
BF = "bfloat16"
BF16_TP2 = (2, 128, 4096, BF)
FEW = r"use_oneshot=False.*more tokens than ranks"


def _shrunk(**fields):
    # A real workspace cannot make the heuristic prefer an infeasible mode (its limit is far
    # below the cap), so shrink a buffer by hand to exercise the branch.
    return dataclasses.replace(workspace_sizes(*BF16_TP2), **fields)


# name -> [workspace, (function, tokens, hidden, [use_oneshot,] answer or the error raised)...]
POLICY = {
    "tiny_tokens_choose_oneshot": [BF16_TP2] + [(CH, t, 4096, None, True) for t in (1, 2, 4, 128)],
    # Two-shot: tokens must exceed ranks.
    "feasibility_bf16_tp2": [BF16_TP2, (OF, 1, 4096, True), (OF, 128, 4096, True)]
    + [(TF, 2, 4096, False), (TF, 3, 4096, True), (TF, 128, 4096, True)],
    # World 16, 16 tokens x 32768 (supported: t=4096, c=8 -> 512 threads). Heuristic:
    # 16*32768*2*16*2 = 32 MiB > 21 MiB, so it prefers two-shot, but two-shot needs tokens
    # > 16. One-shot needs 16*32768*16*2 = 16 MiB = the whole Lamport stride.
    "few_tokens_force_oneshot_tp16": [(16, 16, 32768, BF), (TF, 16, 32768, False)]
    + [(CH, 16, 32768, None, True)],
    # 2 tokens x 2**26 at TP2: heuristic 2*2**26*2*2*2 bytes = 1 GiB, twice the 512 MiB limit.
    "few_tokens_force_oneshot_despite_huge_heuristic_miss": [(2, 2, 2**26, BF)]
    + [(TF, 2, 2**26, False), (OF, 2, 2**26, True)]
    + [(CH, t, 2**26, None, True) for t in (2, 1)],
    "requested_twoshot_with_too_few_tokens_raises": [(8, 128, 4096, BF), (CH, 1, 4096, False, FEW)]
    + [(CH, 8, 4096, False, FEW), (CH, 9, 4096, False, False)],
    # The heuristic says one-shot for 16 tokens, two-shot for 400; requests override both ways.
    "requested_modes_are_honoured_when_feasible": [(8, 512, 4096, BF), (CH, 16, 4096, None, True)]
    + [(CH, 16, 4096, False, False), (CH, 400, 4096, None, False), (CH, 400, 4096, True, True)],
    # TP8, 16384 x 8192 bf16: Lamport stride capped at MAX_COMM_SIZE. One-shot needs
    # tokens*8192*8*2 = tokens*131072 bytes <= 2145386496, i.e. tokens <= 16368.
    "lamport_cap_forces_twoshot": [(8, 16384, 8192, BF), (OF, 16368, 8192, True)]
    + [(OF, 16369, 8192, False), (CH, 16369, 8192, None, False), (CH, 16384, 8192, None, False)]
    + [(CH, 16368, 8192, True, True)]
    + [(CH, 16369, 8192, True, r"use_oneshot=True.*Lamport.*MAX_COMM_SIZE")],
    "preferred_oneshot_infeasible_falls_back_to_twoshot": [_shrunk(lamport_comm_bytes=16)]
    + [(OF, 64, 4096, False), (CH, 64, 4096, None, False)],
    # TP2, 131072 x 8192: one-shot needs 4 GiB of Lamport (> cap); two-shot would index
    # 2*2**30 = 2**31 elements with 32-bit ints.
    "neither_mode_feasible": [(2, 131072, 8192, BF), (OF, 131072, 8192, False)]
    + [(TF, 131072, 8192, False), (TF, 131071, 8192, True)]
    + [(CH, 131072, 8192, None, r"neither.*Lamport.*32-bit")]
    + [(CH, 131072, 8192, False, r"use_oneshot=False.*32-bit")],
    # TP16, hidden 64 bf16: 8 vectors per token, so a two-shot CTA would have 8 < 16 threads.
    "twoshot_needs_a_thread_per_rank": [(16, 64, 64, BF), (TF, 32, 64, False)]
    + [(CH, 32, 64, False, r"hidden_dim / 8 >= 16"), (CH, 32, 64, None, True)],
    "twoshot_needs_a_thread_per_rank_128": [(16, 64, 128, BF), (TF, 32, 128, True)],
    "twoshot_buffer_check": [_shrunk(two_shot_buffer_bytes=16), (TF, 64, 4096, False)]
    + [(CH, 64, 4096, False, "comm buffer")],
    # 256 x 2048: the same element count fits.
    "choose_refuses_calls_that_do_not_fit": [BF16_TP2, (CH, 256, 2048, None, True)]
    + [(CH, 129, 4096, requested, "max_token_num=128") for requested in (None, True, False)],
    # bytes = tokens * 4096 * 2 * 8 * 2 = tokens * 131072; 42 MiB = 44040192 = 336 * 131072.
    "heuristic_tp8_switches_at_42_mib": [(8, 512, 4096, BF), (OF, 337, 4096, True)]
    + [(TF, 336, 4096, True), (CH, 336, 4096, None, True), (CH, 337, 4096, None, False)],
    "bad_token_counts": [BF16_TP2]
    + [(CH, t, 4096, None, "num_tokens must be a positive int") for t in (0, -1, True, 1.0)],
}


@pytest.mark.parametrize("sizes, calls", [(c[0], c[1:]) for c in POLICY.values()], ids=POLICY)
def test_oneshot_policy(sizes, calls):
    s = workspace_sizes(*sizes) if isinstance(sizes, tuple) else sizes
    for fn, tokens, hidden, *requested, want in calls:
        if isinstance(want, str):
            with pytest.raises(ValueError, match=want):
                fn(tokens, hidden, s, *requested)
        else:
            assert fn(tokens, hidden, s, *requested) is want, (fn.__name__, tokens, hidden)


def test_the_policys_worked_numbers():
    # The arithmetic the comments of POLICY rely on.
    check_kernel_supports(16, 32768, "bfloat16")
    assert workspace_sizes(16, 16, 32768, "bfloat16").lamport_comm_bytes == 16 * MIB
    assert 2 * 2**26 * 2 * 2 * 2 == 2 * ONESHOT_MAX_MIB[2] * MIB
    assert 336 * 4096 * 2 * 8 * 2 == 42 * MIB


@pytest.mark.parametrize("world", limits.SUPPORTED_WORLD_SIZES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_heuristic_boundary_every_world(world, dtype):
    # Largest token count whose comm bytes (tokens*H*2*world*e) are <= the MiB limit.
    hidden, e = 4096, element_size(dtype)
    boundary = ONESHOT_MAX_MIB[world] * MIB // (hidden * 2 * world * e)
    s = workspace_sizes(world, boundary + 1, hidden, dtype)
    assert choose_oneshot(boundary, hidden, s, None) is True
    assert choose_oneshot(boundary + 1, hidden, s, None) is False


def test_choice_is_deterministic():
    # Same inputs -> same answer, whatever the global RNG state or how the sizes were built.
    def table(seed, np_seed):
        random.seed(seed)
        np.random.seed(np_seed)
        s = workspace_sizes(8, 4096, 4096, "bfloat16")
        return [choose_oneshot(t, 4096, s, None) for t in range(1, 4097, 7)]

    first = table(0, 0)
    assert table(12345, 999) == first
    assert True in first and False in first


# --- TP groups ------------------------------------------------------------------------------------
def test_tpgroup_basics_and_normalised_members():
    g = TPGroup(members=(4, 5, 6, 7), index=1)
    assert g.size == 4 and [g.rank_of(m) for m in (4, 5, 6, 7)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not a member"):
        g.rank_of(0)
    with pytest.raises(ValueError, match="distinct"):
        TPGroup(members=(1, 1), index=0)
    with pytest.raises(ValueError, match="at least one"):
        TPGroup(members=(), index=0)
    g = TPGroup(members=[np.int64(3), 1], index=0)
    assert g.members == (3, 1) and all(type(m) is int for m in g.members)
    assert g == TPGroup(members=(3, 1), index=0)
    assert hash(g) == hash(TPGroup(members=(3, 1), index=0))


IDS, DP_TP = np.arange(8), ("dp", "tp")
# name -> (ids, axis names, TP axis, the groups' members in order). TP rank = position in group.
GRIDS = {
    "1d": (IDS, ("tp",), "tp", [tuple(range(8))]),
    "2x4": (IDS.reshape(2, 4), DP_TP, "tp", [(0, 1, 2, 3), (4, 5, 6, 7)]),
    "2x4_by_dp": (IDS.reshape(2, 4), DP_TP, "dp", [(0, 4), (1, 5), (2, 6), (3, 7)]),
    "4x2": (IDS.reshape(4, 2), DP_TP, "tp", [(0, 1), (2, 3), (4, 5), (6, 7)]),
    "4x2_tp_first": (IDS.reshape(4, 2), ("tp", "dp"), "tp", [(0, 2, 4, 6), (1, 3, 5, 7)]),
    "2x4_tp_first": (IDS.reshape(2, 4), ("tp", "dp"), "tp", [(0, 4), (1, 5), (2, 6), (3, 7)]),
    # (dp, tp, pp): the other axes (dp, pp) in row-major order: (0,0), (0,1), (1,0), (1,1).
    "3d": (IDS.reshape(2, 2, 2), ("dp", "tp", "pp"), "tp", [(0, 2), (1, 3), (4, 6), (5, 7)]),
    # Reversed ids, as a nested list: the rank follows the position, not the id.
    "reversed_ids": ([[7, 6, 5, 4], [3, 2, 1, 0]], DP_TP, "tp", [(7, 6, 5, 4), (3, 2, 1, 0)]),
}


@pytest.mark.parametrize("ids, names, axis, members", GRIDS.values(), ids=GRIDS)
def test_groups_of_a_grid(ids, names, axis, members):
    groups = tp_groups_from_grid(ids, names, axis)
    assert groups == [TPGroup(m, index) for index, m in enumerate(members)]
    for g in groups:
        assert [g.rank_of(m) for m in g.members] == list(range(g.size))


@pytest.mark.parametrize(
    "shape, names",
    [((8,), ("tp",))] + [(s, n) for n in (DP_TP, ("tp", "dp")) for s in ((2, 4), (4, 2))],
)
def test_groups_permuted_ids(shape, names):
    ids = np.random.default_rng(7).permutation(8).reshape(shape)
    groups, tp_axis = tp_groups_from_grid(ids, names, "tp"), names.index("tp")
    assert len(groups) == 8 // shape[tp_axis]
    assert all(g.size == shape[tp_axis] for g in groups)
    # Every device in exactly one group.
    assert sorted(m for g in groups for m in g.members) == list(range(8))
    # TP rank = coordinate along the tp axis, not the device id.
    for position in np.ndindex(*shape):
        device = int(ids[position])
        (group,) = [g for g in groups if device in g.members]
        assert group.rank_of(device) == position[tp_axis]


# --- Exchange keys --------------------------------------------------------------------------------
TWO_GROUPS = tp_groups_from_grid(IDS.reshape(2, 4), DP_TP, "tp")


def test_exchange_keys_unique_stable_and_not_random():
    inputs = list(itertools.product(TWO_GROUPS, range(3), ("ipc_handles", "barrier")))
    all_keys = lambda: [exchange_key("jax_fusedar", *args) for args in inputs]
    first = all_keys()
    assert len(first) == 12 and len(set(first)) == 12
    for _ in range(2):
        random.seed(0)
        np.random.seed(0)
        assert all_keys() == first


def test_exchange_keys_same_in_another_process():
    # Another interpreter with a different str-hash seed computes the same key.
    code = (
        "from jax_fusedar.common.tp_groups import TPGroup;"
        "from jax_fusedar.common.exchange import exchange_key;"
        "print(exchange_key('jax_fusedar', TPGroup((4, 5, 6, 7), 1), 2, 'ipc_handles'))"
    )
    out = run_code(code, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == exchange_key("jax_fusedar", TWO_GROUPS[1], 2, "ipc_handles")


def test_exchange_key_depends_on_every_input_and_is_readable():
    g = TWO_GROUPS[0]
    base = exchange_key("ns", g, 0, "p")
    # Member order is the rank order: a permuted group is a different group.
    changed = [("ns2", g, 0, "p"), ("ns", g, 1, "p"), ("ns", g, 0, "q")]
    assert base not in [exchange_key(*args) for args in changed]
    assert exchange_key("ns", TPGroup((1, 0, 2, 3), 0), 0, "p") != base
    # The index is only a label; the members identify the group.
    assert exchange_key("ns", TPGroup(g.members, 5), 0, "p") == base
    key = exchange_key("jax_fusedar", TWO_GROUPS[1], 2, "ipc_handles")
    assert key.startswith("jax_fusedar/ipc_handles/ws2/tp4/")


# --- Backend choice and strict mode ---------------------------------------------------------------
def _env(value):
    return {BACKEND_VAR: value}


@pytest.mark.parametrize(
    "requested, platform, nodes, env, expected",
    [(None, "cuda", 1, {}, "trtllm"), (None, "gpu", 1, {}, "trtllm")]
    + [("auto", "cuda", 1, {}, "trtllm"), (None, "cpu", 1, {}, "xla")]
    + [("auto", "tpu", 1, {}, "xla"), (None, "rocm", 1, {}, "xla")]
    # auto off-GPU never reaches the node check; across nodes: XLA's collectives, never an
    # error for a valid layout.
    + [(None, "cpu", 4, {}, "xla"), (None, "cuda", 2, {}, "xla"), ("auto", "gpu", 4, {}, "xla")]
    + [("xla", "cuda", 1, {}, "xla"), ("xla", "cpu", 4, {}, "xla")]
    + [("trtllm", "cuda", 1, {}, "trtllm"), (" TRTLLM ", "CUDA", 1, {}, "trtllm")]
    # The env var applies when the argument is None or "auto"...
    + [(None, "cuda", 1, _env("xla"), "xla"), ("auto", "cuda", 1, _env("xla"), "xla")]
    + [(None, "cuda", 2, _env("XLA"), "xla"), (None, "gpu", 1, _env("trtllm"), "trtllm")]
    + [(None, "cuda", 1, _env("auto"), "trtllm"), (None, "cpu", 1, _env("auto"), "xla")]
    + [(None, "cuda", 1, _env(""), "trtllm"), (None, "cuda", 1, {"OTHER": "xla"}, "trtllm")]
    # ...and the explicit argument wins over it.
    + [("trtllm", "cuda", 1, _env("xla"), "trtllm"), ("xla", "cuda", 1, _env("trtllm"), "xla")]
    + [("xla", "cuda", 1, _env("mnnvl"), "xla"), ("xla", "cuda", 1, _env("bogus"), "xla")]
    # The refusals: what the error says.
    + [
        ("nccl", "cuda", 1, {}, r"unknown.*'nccl'.*backend argument.*'auto', 'trtllm', 'mnnvl'"),
        (None, "cuda", 1, _env("bogus"), rf"unknown.*'bogus'.*\${BACKEND_VAR}"),
        ("mnnvl", "cuda", 1, {}, r"mnnvl.*multicast.*cuMulticastCreate.*'trtllm'.*'xla'"),
        (None, "cuda", 1, _env("mnnvl"), r"mnnvl.*multicast"),
        ("trtllm", "cuda", 2, {}, r"only within one node.*2 nodes.*'mnnvl'.*'xla'"),
        (None, "cuda", 2, _env("trtllm"), r"only within one node.*2 nodes"),
        ("trtllm", "cpu", 1, {}, r"'trtllm'.*needs a CUDA GPU.*'cpu'"),
        (None, "cpu", 1, _env("trtllm"), r"needs a CUDA GPU"),
        ("xla", "cuda", 0, {}, r"num_nodes must be a positive int"),
        (3, "cuda", 1, {}, r"backend must be a string"),
    ],
)
def test_resolve_backend(requested, platform, nodes, env, expected):
    kw = dict(platform=platform, num_nodes=nodes, env=env)
    if expected in ("trtllm", "xla"):
        assert resolve_backend(requested, **kw) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            resolve_backend(requested, **kw)


# ("dp", "tp") = (2, 4) over two hosts of 4 devices each: every TP group on one host.
HOST_OF = {d: f"node{d // 4}" for d in range(8)}
DP_ACROSS = tp_groups_from_grid(IDS.reshape(2, 4), DP_TP, "tp")
TP_ACROSS = tp_groups_from_grid(IDS.reshape(2, 4).T, DP_TP, "tp")
# Groups [0, 1], [2, 4], [3, 5], [6, 7]: two within a host, two across.
MIXED = np.array([0, 1, 2, 4, 3, 5, 6, 7]).reshape(2, 2, 2)
MIXED = tp_groups_from_grid(MIXED, ("pp", "dp", "tp"), "tp")


def test_group_hosts_counts_each_groups_own_members():
    hosts = [group_hosts(g, HOST_OF) for g in DP_ACROSS]
    assert hosts == [{"node0": (0, 1, 2, 3)}, {"node1": (4, 5, 6, 7)}]
    assert group_hosts(TP_ACROSS[1], HOST_OF) == {"node0": (1,), "node1": (5,)}
    # TP-rank order within a host, hosts in the order of their first member.
    assert group_hosts(TPGroup((5, 0, 4, 1), 0), HOST_OF) == {"node1": (5, 4), "node0": (0, 1)}
    with pytest.raises(
        ValueError, match=r"no host known for member\(s\) \[9\] of TP group \[0, 9\]"
    ):
        group_hosts(TPGroup((0, 9), 0), HOST_OF)


@pytest.mark.parametrize("requested", [None, "auto", "trtllm"])
def test_groups_each_within_one_host_keep_the_kernel(requested):
    # The mesh spans two hosts, its TP groups do not (the issue-16 layout).
    kw = dict(platform="cuda", groups=DP_ACROSS, host_of=HOST_OF, env={})
    assert resolve_backend_for_groups(requested, **kw) == BackendChoice("trtllm", (), None)


# The reason's start: the first TP group across hosts, then how many more, and which.
SPANS = (
    r"TP group \[{}\] \(devices\) spans 2 nodes \(node0: \[{}\]; node1: \[4\]\), as do {} more "
    r"of the workspace's 4 TP groups \({}\)"
)


@pytest.mark.parametrize(
    "groups, named",
    [
        (TP_ACROSS, SPANS.format("0, 4", 0, 3, r"\[1, 5\], \[2, 6\], \[3, 7\]")),
        (MIXED, SPANS.format("2, 4", 2, 1, r"\[3, 5\]")),
    ],
    ids=["tp_across", "mixed"],
)
def test_groups_across_hosts(groups, named):
    kw = dict(platform="cuda", groups=groups, host_of=HOST_OF, member_name="device")
    # auto: XLA for every group of the workspace (one program), the reason names the groups.
    for env in ({}, _env("auto")):
        choice = resolve_backend_for_groups("auto", env=env, **kw)
        assert choice.backend == "xla"
        assert [list(g.members) for g in choice.spanning] == [
            list(g.members) for g in groups if len(group_hosts(g, HOST_OF)) > 1
        ]
        assert re.fullmatch(
            named + r": the 'trtllm' kernel's peer-memory protocol "
            r"works only within one node.*NVLink multicast.*refuses",
            choice.reason,
        )
    # An explicit trtllm, from the argument or the environment, raises naming them.
    for requested, env in (("trtllm", {}), (None, _env("trtllm")), ("auto", _env("trtllm"))):
        match = named + r": the 'trtllm' all-reduce backend works only within one node"
        with pytest.raises(ValueError, match=match):
            resolve_backend_for_groups(requested, env=env, **kw)
    # xla asked for: no reason to give; off CUDA: xla whatever the layout.
    assert resolve_backend_for_groups("xla", env={}, **kw).reason is None
    choice = resolve_backend_for_groups(None, env={}, **dict(kw, platform="cpu"))
    assert choice.backend == "xla" and choice.reason is None


def test_many_spanning_groups_are_summarised():
    groups = tp_groups_from_grid(np.arange(16).reshape(2, 8).T, DP_TP, "tp")
    host_of = {d: f"node{d // 8}" for d in range(16)}
    choice = resolve_backend_for_groups(
        None, platform="cuda", groups=groups, host_of=host_of, env={}
    )
    assert choice.reason.startswith(
        "TP group [0, 8] (members) spans 2 nodes (node0: [0]; node1: [8]), as do 7 more of the "
        "workspace's 8 TP groups ([1, 9], [2, 10], [3, 11], ...): "
    )


@pytest.mark.parametrize(
    "requested, groups, host_of, pattern",
    [
        ("bogus", DP_ACROSS, HOST_OF, r"unknown all-reduce backend 'bogus'"),
        ("trtllm", TP_ACROSS, {}, r"no host known for member\(s\) \[0, 4\]"),
        ("mnnvl", TP_ACROSS, HOST_OF, r"^the 'mnnvl' all-reduce backend needs NVLink"),
        ("auto", [], HOST_OF, r"needs at least one TP group"),
    ],
)
def test_resolve_backend_for_groups_errors(requested, groups, host_of, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_backend_for_groups(
            requested, platform="cuda", groups=groups, host_of=host_of, env={}
        )


@pytest.mark.parametrize(
    "explicit, env, expected",
    [(True, {}, True), (False, {STRICT_ENV_VAR: "1"}, False), (True, {STRICT_ENV_VAR: "0"}, True)]
    + [(None, {}, False)]
    + [(None, {STRICT_ENV_VAR: v}, True) for v in ("1", "true", "TRUE", " Yes ")]
    + [(None, {STRICT_ENV_VAR: v}, False) for v in ("0", "false", "no", "")]
    + [(None, {STRICT_ENV_VAR: "on"}, True), (None, {STRICT_ENV_VAR: "Off"}, False)],
)
def test_strict_mode(explicit, env, expected):
    assert strict_mode(explicit, env=env) is expected


# --- the large-message algorithm ---------------------------------------------------------------
@pytest.mark.parametrize("hidden", [4096, 7168, 8192])
def test_large_message_auto_crossover_world2(hidden):
    sizes = workspace_sizes(2, 8192, 8192, "bfloat16")
    # first row count at 48 MiB
    edge = -(-launch_mode.LARGE_MESSAGE_MIN_MIB[2] * (1 << 20) // (hidden * 2))
    assert choose_algorithm(edge, hidden, sizes, None) == LARGE
    assert choose_algorithm(edge - 1, hidden, sizes, None) == ONESHOT
    # Below the crossover auto keeps FlashInfer's choice exactly; forced modes stay FlashInfer.
    for m in (1, 16, 128, 1024, edge - 1):
        want = ONESHOT if choose_oneshot(m, hidden, sizes, None) else TWOSHOT
        assert choose_algorithm(m, hidden, sizes, None) == want
    got = [choose_algorithm(8192, 8192, sizes, requested) for requested in (True, False, None)]
    assert got == [ONESHOT, TWOSHOT, LARGE]


@pytest.mark.parametrize("world", [4, 8, 16])
def test_large_message_unmeasured_worlds_keep_flashinfer(world):
    # Not measured at these world sizes: auto never picks it (at 4 and 8 it could run).
    sizes = workspace_sizes(world, 8192, 8192, "bfloat16")
    assert launch_mode.LARGE_MESSAGE_MIN_MIB[world] is None
    assert (large_message_problem(8192, 8192, sizes) is None) == (world in (4, 8))
    assert not prefers_large_message(8192, 8192, sizes)
    assert choose_algorithm(8192, 8192, sizes, None) in (ONESHOT, TWOSHOT)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_large_message_fits_the_two_shot_buffer(world):
    # N receive + N gather slots of ceil(M/N) rows: within today's two-shot buffer at the
    # workspace's full size, so the workspace does not grow.
    for dtype in ("bfloat16", "float16"):
        sizes = workspace_sizes(world, 8192, 8192, dtype)
        needed = launch_mode.large_message_bytes_needed(8192, 8192, world, dtype)
        assert needed <= sizes.two_shot_buffer_bytes
        assert large_message_problem(8192, 8192, sizes) is None


def test_large_message_only_16_bit():
    sizes = workspace_sizes(2, 8192, 8192, "float32")
    assert "float16/bfloat16" in large_message_problem(8192, 8192, sizes)
    assert choose_algorithm(8192, 8192, sizes, None) != LARGE


def test_large_message_problem_names_the_buffer():
    # An odd row count at the full workspace needs one more row per slot than two-shot.
    sizes = workspace_sizes(2, 8191, 8192, "bfloat16")
    needed = launch_mode.large_message_bytes_needed(8191, 8192, 2, "bfloat16")
    assert needed == 2 * 2 * 4096 * 8192 * 2
    assert "two-shot buffer" in large_message_problem(8191, 8192, sizes)
    assert not prefers_large_message(8191, 8192, sizes)
    # ... and auto then falls back to FlashInfer's choice instead of failing.
    assert choose_algorithm(8191, 8192, sizes, None) == ONESHOT
    # Two-shot's own limits apply too (more tokens than ranks).
    assert "more tokens than ranks" in large_message_problem(2, 8192, sizes)


def test_algorithm_codes_match_the_core_header():
    header = (REPO / "ffi" / "core" / "include" / "fusedar" / "core.h").read_text()
    for name, code in (("TWOSHOT", TWOSHOT), ("ONESHOT", ONESHOT), ("LARGE_MESSAGE", LARGE)):
        assert re.search(rf"FUSEDAR_ALGORITHM_{name} = {code},", header), name


# --- Workspace bytes: sizing.workspace_bytes and the repr every workspace shows (lifecycle) -----
def test_workspace_bytes_is_the_per_rank_size():
    # 8192 x 8192 bf16 at TP 8: two-shot 1 GiB + 3 Lamport sub-buffers of 1 GiB, the flags
    # (8 ranks x 256 x int32) and the 5-int control block.
    n = sizing.workspace_bytes(8, 8192, 8192, "bfloat16")
    assert n == 4 * 2**30 + 8 * 256 * 4 + 5 * 4
    assert n == sizing.workspace_sizes(8, 8192, 8192, "bfloat16").per_rank_bytes
    assert sizing.format_bytes(n) == "4.00 GiB"
    # float32 doubles the buffers; the Lamport stride stops at MAX_COMM_SIZE.
    assert sizing.workspace_bytes(2, 16, 4096, "float32") == (
        2 * 16 * 4096 * 4 * 4 + 2 * 256 * 4 + 20
    )
    big = sizing.workspace_sizes(16, 8192, 8192, "float32")
    assert big.lamport_comm_bytes == sizing.MAX_COMM_SIZE
    # Names and numpy dtypes alike.
    for dtype in ("bfloat16", np.float16, np.dtype("float32")):
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        assert sizing.workspace_bytes(4, 64, 1024, dtype) == sizing.workspace_bytes(
            4, 64, 1024, name
        )
    texts = [(0, "0 B"), (512, "512 B"), (3 << 20, "3.00 MiB"), (12 << 20, "12.0 MiB")]
    assert [(size, sizing.format_bytes(size)) for size, _ in texts] == texts


def test_workspace_bytes_takes_jax_and_torch_dtypes_alike():
    want = sizing.workspace_bytes(2, 128, 4096, "bfloat16")
    if importlib.util.find_spec("jax"):
        import jax.numpy as jnp

        import jax_fusedar

        assert jax_fusedar.workspace_bytes(2, 128, 4096, jnp.bfloat16) == want
    if importlib.util.find_spec("torch"):
        import torch

        import torch_compat

        assert torch_compat.workspace_bytes(2, 128, 4096, torch.bfloat16) == want
        assert torch_compat.workspace_bytes is sizing.workspace_bytes


class _Workspace(lifecycle.WorkspaceLifecycle):
    def __init__(self, backend):
        self.backend, self.sizes = backend, sizing.workspace_sizes(8, 8192, 8192, "bfloat16")

    def _repr_fields(self):
        return [f"backend={self.backend!r}"]

    def _release(self):
        pass


def test_the_shared_repr_shows_bytes_per_rank():
    ws = _Workspace("trtllm")
    assert ws.bytes_per_rank == sizing.workspace_bytes(8, 8192, 8192, "bfloat16")
    assert (
        repr(ws) == f"_Workspace(backend='trtllm', bytes_per_rank={ws.bytes_per_rank} (4.00 GiB))"
    )
    ws.destroy()
    assert repr(ws).endswith(" (4.00 GiB), destroyed)")
    # XLA's collectives allocate nothing.
    assert repr(_Workspace("xla")) == "_Workspace(backend='xla', bytes_per_rank=0)"


# --- Refusals: (function, its arguments, what its ValueError says) -------------------------------
BAD_DTYPES = ["float64", "int8", "bf16", "", None, np.dtype("float16")]
SUPPORTED = ", ".join(map(str, limits.SUPPORTED_WORLD_SIZES))  # "2, 4, 8, 16"
POSITIVE = "must be a positive int"
GRID_ERRORS = [  # tp_groups_from_grid's (ids, names, axis) and error
    (IDS.reshape(2, 4), DP_TP, "mp", r"unknown axis 'mp'.*\('dp', 'tp'\)"),
    (IDS.reshape(2, 4), ("tp",), "tp", r"2 dimension.*1 axis name"),
    (IDS, DP_TP, "tp", r"1 dimension.*2 axis name"),
    ([[0, 1], [1, 2]], DP_TP, "tp", "distinct"),
    (np.arange(4).reshape(2, 2), ("tp", "tp"), "tp", "axis names must be distinct"),
    (np.arange(4.0), ("tp",), "tp", "grid of ints"),
    (np.zeros((0,), dtype=int), ("tp",), "tp", "non-empty"),
]
REFUSED = (
    [(element_size, (d,), "unsupported dtype.*bfloat16, float16, float32") for d in BAD_DTYPES]
    + [(vector_width, (d,), "unsupported dtype") for d in BAD_DTYPES]
    + [
        (check_kernel_supports, (w, 4096, BF), rf"world size .* not supported.*{SUPPORTED}")
        for w in (1, 3, 6, 32, 0, -2, True, 2.0, "2", None)
    ]
    # 4100 is no multiple of 8, 4098 none of 4.
    + [
        (check_kernel_supports, (2, hidden, d), rf"positive multiple of {vector_width(d)}")
        for d, hidden in [(BF, 4100), ("float16", 12), ("float32", 4098), (BF, 0), ("float32", -4)]
        + [(BF, True), (BF, 4096.0)]
    ]
    # The launch limit's bad side (LAUNCH_CASES).
    + [
        (check_kernel_supports, (2, hidden, d), rf"hidden_dim={hidden} cannot be launched.*1024")
        for d, _, bad in LAUNCH_CASES
        for hidden in bad
    ]
    + [(workspace_sizes, (world, 128, 4096, BF), f"world size {world}") for world in (3, 1)]
    + [(workspace_sizes, (2, t, 4096, BF), f"max_token_num {POSITIVE}") for t in (0, -1, 1.5, True)]
    + [(workspace_sizes, (2, 128, h, BF), f"hidden_dim {POSITIVE}") for h in (0, "4096")]
    + [(workspace_sizes, (2, 128, 4096, "float64"), "unsupported dtype")]
    + [(sizing.workspace_bytes, (2, 16, 4096, "int8"), "unsupported dtype 'int8'")]
    + [(sizing.workspace_bytes, (3, 16, 4096, BF), "world size 3 is not supported")]
    + [
        (tp_groups_from_grid, (ids, names, axis), pattern)
        for ids, names, axis, pattern in GRID_ERRORS
    ]
    + [
        (exchange_key, (namespace, TWO_GROUPS[0], serial, purpose), pattern)
        for namespace, serial, purpose, pattern in [
            ("", 0, "p", "namespace"),
            (None, 0, "p", "namespace"),
        ]
        + [("ns", 0, "", "purpose")]
        + [("ns", serial, "p", "workspace_serial") for serial in (-1, True, 1.0)]
    ]
)


@pytest.mark.parametrize(
    "fn, args, pattern", REFUSED, ids=[f"{fn.__name__}-{i}" for i, (fn, *_) in enumerate(REFUSED)]
)
def test_refused(fn, args, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn(*args)
