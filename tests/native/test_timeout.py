"""The kernel's bounded waits (timeout_s, always on; ffi/core/watchdog.h) on CPU: the plumbing
to the native Rank (fakes), the build's patching of FlashInfer's wait loops, and a timed-out
wait's message (nvcc host program); parsing in test_handshake.py, the kernel side in
tests/gpu/test_timeout.py, the benchmarks' on/off comparison in tests/benchmarks/."""

import difflib
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

from jax_fusedar.common import handshake, native, sizing

from tests.native.fake_native import FakeRank, fake_jax_workspace
from tests.native.host_program import run_host_program
from tests.repo import REPO
from tests.skips import NO_NATIVE


# --- JAX plumbing -------------------------------------------------------------------------------
def test_jax_build_passes_the_timeout_to_every_native_rank(monkeypatch):
    ws = fake_jax_workspace(monkeypatch, 98, timeout_s=4.5)
    assert [r.kw["timeout_s"] for r in FakeRank.made] == [4.5, 4.5]
    assert ws.failures() == []
    ws.raise_if_failed()  # nothing failed: no error
    FakeRank.made[1].record = "rank 1 timed out waiting for rank 0"
    assert ws.failures() == ["rank 1 timed out waiting for rank 0"]
    assert ws.call_check_failures() == ws.failures()  # the earlier name; one record for both
    with pytest.raises(RuntimeError, match="rank 1 timed out waiting for rank 0"):
        ws.raise_if_failed()
    # explain_errors: an error in the block comes back with the record's text...
    with pytest.raises(RuntimeError, match="rank 1 timed out waiting for rank 0") as info:
        with ws.explain_errors():
            raise ValueError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")
    assert isinstance(info.value.__cause__, ValueError)
    FakeRank.made[1].record = ""
    # ...and passes through unchanged when nothing was recorded.
    with pytest.raises(ValueError, match="unrelated"):
        with ws.explain_errors():
            raise ValueError("unrelated")
    with ws.explain_errors() as same:
        assert same is ws


def test_jax_set_timeout_reaches_every_rank_and_is_validated(monkeypatch):
    ws = fake_jax_workspace(monkeypatch, 98)
    assert ws.timeout_s == 30.0 and [r.kw["timeout_s"] for r in FakeRank.made] == [30.0, 30.0]
    ws.set_timeout(0)
    assert ws.timeout_s == 0.0 and [r.timeouts[-1] for r in FakeRank.made] == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"timeout_s must be in \[0, 3600\]"):
        ws.set_timeout(-1)
    for bad in (None, "5"):
        with pytest.raises(TypeError, match="timeout_s"):
            ws.set_timeout(bad)
    assert ws.timeout_s == 0.0  # unchanged by the refused values


def test_jax_create_resolves_the_timeout_before_anything(monkeypatch):
    import jax
    from jax.sharding import Mesh

    from jax_fusedar import workspace as jws

    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    kw = dict(max_token_num=8, hidden_dim=1024, dtype="bfloat16", backend="xla")
    with pytest.raises(ValueError, match=r"timeout_s must be in \[0, 3600\]"):
        jws.create_allreduce_fusion_workspace(mesh, "tp", timeout_s=-1, **kw)
    with pytest.raises(TypeError, match="timeout_s"):
        jws.create_allreduce_fusion_workspace(mesh, "tp", timeout_s="30", **kw)
    monkeypatch.setenv(handshake.TIMEOUT_ENV_VAR, "later")
    with pytest.raises(ValueError, match="JAX_FUSEDAR_TIMEOUT_S"):
        jws.create_allreduce_fusion_workspace(mesh, "tp", **kw)
    monkeypatch.setenv(handshake.TIMEOUT_ENV_VAR, "12")
    with jws.create_allreduce_fusion_workspace(mesh, "tp", **kw) as ws:
        assert ws.timeout_s == 12.0 and ws.failures() == []
    with jws.create_allreduce_fusion_workspace(mesh, "tp", timeout_s=0, **kw) as ws:
        assert ws.timeout_s == 0.0


# --- torch plumbing -----------------------------------------------------------------------------
def test_torch_create_takes_the_options_keyword_only():
    pytest.importorskip("torch")
    import inspect

    import torch_compat

    params = inspect.signature(torch_compat.create_allreduce_fusion_workspace).parameters
    for name in ("handshake", "handshake_timeout_s", "kernel_timeout_s"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is None
    assert params["timeout_s"].default == 120.0  # the exchange's, unchanged


def test_torch_create_refuses_a_bad_option_first(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch_compat

    kw = dict(max_token_num=16, hidden_dim=1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"kernel_timeout_s must be in \[0, 3600\]"):
        torch_compat.create_allreduce_fusion_workspace("trtllm", kernel_timeout_s=-2, **kw)
    for var, raw, match in (
        (handshake.TIMEOUT_ENV_VAR, "soon", "JAX_FUSEDAR_TIMEOUT_S"),
        (handshake.HANDSHAKE_ENV_VAR, "2", "JAX_FUSEDAR_HANDSHAKE"),
    ):
        with monkeypatch.context() as env:
            env.setenv(var, raw)
            with pytest.raises(ValueError, match=match):
                torch_compat.create_allreduce_fusion_workspace("trtllm", **kw)


def test_torch_workspace_reports_the_record():
    torch = pytest.importorskip("torch")
    from torch_compat.workspace import TorchAllReduceFusionWorkspace

    rank = FakeRank(0, 2, 0, 16, 1024, 2, timeout_s=3.0)
    kw = dict(global_ranks=[0, 1], rank=0, device=0, max_token_num=16, hidden_dim=1024)
    sizes = sizing.workspace_sizes(2, 16, 1024, "bfloat16")
    ws = TorchAllReduceFusionWorkspace(
        native_rank=rank, dtype=torch.bfloat16, sizes=sizes, timeout_s=3.0, **kw
    )
    assert ws.timeout_s == 3.0 and ws.failure() == ""
    rank.record = "Rank 1 did not arrive"
    assert ws.failure() == ws.call_check_failure() == "Rank 1 did not arrive"


def test_torch_moe_finalize_after_a_trap_raises_the_record_before_touching_the_device(monkeypatch):
    """Pattern 7's index check copies to the host, which a trapped context would answer with
    CUDA's generic error: torch_compat raises the record first, and launches nothing."""
    pytest.importorskip("torch")
    import torch_compat
    from torch_compat import cuda_state, moe

    from tests.torch import test_moe as tm

    monkeypatch.setattr(cuda_state, "current_stream", lambda device: 0xC0FFEE)
    ws = tm.fake_workspace()
    record = "jax_fusedar kernel wait timed out on rank 0 of 2 ... Rank 1 did not arrive"
    ws.native_rank().failure = lambda: record

    def no_copy(*a, **kw):
        raise AssertionError("the index check ran on a failed workspace")

    monkeypatch.setattr(moe, "check_index_values", no_copy)
    with pytest.raises(RuntimeError, match="Rank 1 did not arrive"):
        torch_compat.allreduce_fusion(workspace=ws, pattern=7, **tm.finalize_args())
    assert ws.native_rank().moe_launches == []
    ws.native_rank().failure = lambda: ""  # nothing recorded: the call goes through
    monkeypatch.setattr(moe, "check_index_values", lambda idx, rows: None)
    torch_compat.allreduce_fusion(workspace=ws, pattern=7, **tm.finalize_args())
    assert len(ws.native_rank().moe_launches) == 1


def test_extension_exposes_the_options():
    if not native.available():
        pytest.skip(NO_NATIVE)
    doc = native.ext.Rank.__init__.__doc__
    assert "timeout_s: float = 30.0" in doc and "handshake: bool = False" in doc, doc
    assert "handshake_timeout_s: float = 30.0" in doc, doc
    for attr in ("timeout_s", "set_timeout", "failure", "handshake", "handshake_timeout_s"):
        assert hasattr(native.ext.Rank, attr)


# --- the build: FlashInfer's wait loops are hooked ----------------------------------------------
HEADER = "flashinfer/comm/trtllm_allreduce_fusion.cuh"
MOE_HEADER = "flashinfer/comm/trtllm_moe_allreduce_fusion.cuh"


def _include_dir():
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found")
    include = os.environ.get("FLASHINFER_INCLUDE_DIR", str(REPO / "third_party/flashinfer/include"))
    if not (pathlib.Path(include) / HEADER).exists():
        pytest.skip("FlashInfer's headers are not fetched (tools/fetch_flashinfer_headers.py)")
    return include


def _run_patching(build_dir, include):
    """FlashInferHeaders.cmake's patching (cmake -P) of the headers under `include` into
    build_dir/flashinfer_patched and build_dir/flashinfer_unhooked."""
    build_dir.mkdir(parents=True, exist_ok=True)
    script = build_dir / "patch.cmake"
    script.write_text(
        f'set(CMAKE_BINARY_DIR "{build_dir}")\nset(PROJECT_SOURCE_DIR "{REPO}")\n'
        f'set(FLASHINFER_INCLUDE_DIR "{include}")\n'
        f'include("{REPO}/ffi/cmake/FlashInferHeaders.cmake")\n'
        "fusedar_prepare_flashinfer_headers(out out_unhooked)\n"
    )
    return subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True, timeout=120)


def _patched_trees(tmp_path, name):
    """The header ``name`` as fetched, hooked (flashinfer_patched) and as the probe copy
    (flashinfer_unhooked): FlashInfer's header with only six more `inline`s, no hook at all."""
    include = pathlib.Path(_include_dir())
    if not (include / name).exists():
        pytest.skip(f"{name} is not among the fetched headers")
    run = _run_patching(tmp_path, str(include))
    assert run.returncode == 0, run.stdout + run.stderr
    folders = (include, tmp_path / "flashinfer_patched", tmp_path / "flashinfer_unhooked")
    original, hooked, unhooked = ((folder / name).read_text() for folder in folders)
    assert "fusedar" not in unhooked
    assert unhooked.count("inline ") == original.count("inline ") + 6
    return original, hooked, unhooked


def _counts(text, expected):
    assert {s: text.count(s) for s in expected} == expected


def test_the_build_hooks_every_wait_loop(tmp_path):
    """Every spin loop of FlashInfer's fused kernel is replaced by a bounded one."""
    original, text, unhooked = _patched_trees(tmp_path, HEADER)
    device = text[: text.index("inline int get_sm_count()")]  # the kernels' part
    assert not re.search(r"while \([^)]*\)\s*\{\s*\}", device), "an unbounded spin is left"
    # 2 grid counters + the barrier spin.
    _counts(device, {"::fusedar_wait::spin(": 3, "FUSEDAR_WAIT_LAMPORT_TICK": 1})
    _counts(device, {"::fusedar_wait::count_call(counter_ptr)": 2})
    _counts(device, {"barrier.sync(FUSEDAR_WAIT_CTX(false))": 2})
    # The data the loops read is untouched: the same loads, the same conditions.
    assert "done &= !has_neg_zero<T, VEC_SIZE>(vals[r]);" in device
    assert "return ld_flag(m_current_flag) == prev_flag(m_flag_value);" in device
    # FlashInfer's launch geometry (ffi/kernels/launch_registers.cuh): both kernels are held
    # to the unhooked allocation and the launcher reads the unhooked register counts.
    _counts(text, {"__global__ void __maxnreg__((::fusedar_geometry::register_cap<": 2})
    _counts(text, {"return ::fusedar_geometry::registers_for_geometry<": 2})
    assert "cudaFuncGetAttributes" not in text
    # The probe copy is FlashInfer's header with only the six `inline`s: no hook at all.
    assert unhooked.replace("inline ", "") == original.replace("inline ", "")


def _code(path):
    """A source file without its comments."""
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S))


def test_the_large_message_waits_are_bounded():
    """The large-message algorithm's flag waits (entry, scatter and gather flags) all go
    through fusedar_wait::spin with a site of their own: no other spin loop is left."""
    kernels = REPO / "ffi" / "kernels"
    names = ("large_sync.cuh", "large_message.cuh", "large_resources.cu")
    files = {name: _code(kernels / name) for name in names}
    for name, code in files.items():  # no spin of its own (the host code has loops with bodies)
        assert not re.search(r"\bwhile\s*\([^;{]*\)\s*(\{\s*\}|;)", code), f"{name} spins"
        assert not re.search(r"\bfor\s*\([^;]*;\s*;", code), f"{name} has an endless for loop"
    # A flag is read in one place only: the condition of the bounded wait.
    everywhere = "\n".join(files.values())
    assert everywhere.count("load_acquire_sys(") == 2, "a flag read outside wait_for"
    # The one wait helper is the bounded spin, and every call of it names its site.
    assert re.search(
        r"void wait_for\(const Watch& watch, int site, int peer, int detail,"
        r"\s*const unsigned int\* flag, unsigned int target\)\s*\{\s*fusedar_wait::spin\(",
        files["large_sync.cuh"],
    ), files["large_sync.cuh"]
    calls = re.findall(r"\bwait_for\(\s*[\w.]+,\s*watchdog::(k\w+),", everywhere)
    assert sorted(calls) == ["kLargeEnter", "kLargeGather", "kLargeScatter"], calls
    assert everywhere.count("wait_for(") == 4  # 3 calls + the definition
    assert set(calls) <= set(wait_sites())


def test_the_gpu_large_message_case_runs_the_large_message_algorithm():
    """tests/gpu/workers/native_timeout.py's never_large case must stay above the auto
    crossover, or it would time out in FlashInfer's kernels instead of the large-message waits."""
    from jax_fusedar.common import launch_mode
    from tests.gpu.workers import native_timeout

    assert "never_large" in native_timeout.CASES
    assert native_timeout.large_algorithm(2) == launch_mode.ALGORITHM_LARGE_MESSAGE


def test_the_build_hooks_every_wait_loop_of_the_moe_kernels(tmp_path):
    """The same for FlashInfer's MoE header (patterns 6, 7): both kernels' Lamport polls and
    LamportComm's grid counter are bounded, and no spin is left."""
    original, text, unhooked = _patched_trees(tmp_path, MOE_HEADER)
    device = text[: text.index("inline int get_sm_count()")]  # up to the launchers
    assert "__global__" not in device[: device.index("struct LamportComm")]
    assert not re.search(r"while \([^)]*\)\s*\{\s*\}", text), "an unbounded spin is left"
    # The two polls (bounded inside) and two launcher loops.
    _counts(text, {"while (": 4, "cudaFuncGetAttributes": 0})
    grid = "::fusedar_wait::spin(fusedar_ctx, ::fusedar::watchdog::kGrid"
    _counts(device, {grid: 1, "::fusedar_wait::count_call(counter_ptr)": 1})
    kernels = text[text.index("inline bool use_oneshot") :]
    update = "comm.update(params.size * NRanks, FUSEDAR_MOE_WAIT_CTX);"
    _counts(kernels, {update: 2, "FUSEDAR_WAIT_STATE": 2, "FUSEDAR_MOE_WAIT_LAMPORT_TICK": 2})
    # Each poll is hooked inside its own kernel: one tick per kernel, after its poll loop.
    reduce_at = kernels.index("moereduce_allreduce_fusion_kernel_oneshot_lamport(")
    finalize_at = kernels.index("moefinalize_allreduce_fusion_kernel_oneshot_lamport(")
    for body in (kernels[reduce_at:finalize_at], kernels[finalize_at:]):
        assert body.count("FUSEDAR_MOE_WAIT_LAMPORT_TICK") == 1
        tick = body.index("FUSEDAR_MOE_WAIT_LAMPORT_TICK")
        assert body.index("while (!done)") < tick < body.index("vec_t<T, VEC_SIZE> sum_val")
    # The data the loops read is untouched: the same loads, the same conditions.
    assert text.count("done &= !has_neg_zero<T, VEC_SIZE>(vals[r]);") == 2
    assert "return *reinterpret_cast<int volatile*>(counter_ptr) != gridDim.x;" in device
    # The MoE launchers read no register count, but each hooked kernel is held to the
    # unhooked one's registers (ffi/kernels/moe_launch_registers.cuh), so that every block
    # FlashInfer's build launches fits.
    _counts(text, {"__global__ void __maxnreg__((::fusedar_geometry::moe_register_cap<": 2})
    assert (
        "moe_register_cap<::fusedar_geometry::kMoeReduction, T, NRanks, (AllReduceOut ? 8 "
        ": 0) | (ResidualOut ? 4 : 0) | (NormOut ? 2 : 0) | (QuantOut ? 1 : 0)>())) "
        "moereduce_allreduce_fusion_kernel_oneshot_lamport("
    ) in text
    assert (
        "moe_register_cap<::fusedar_geometry::kMoeFinalize, T, NRanks, (ResidualOut ? 4 : 0) "
        "| (NormOut ? 2 : 0) | (QuantOut ? 1 : 0)>())) "
        "moefinalize_allreduce_fusion_kernel_oneshot_lamport("
    ) in text
    # Both copies carry the fix of FlashInfer's pattern-7 race: its poll reads this rank's
    # buffer (slot r), like pattern 6 and the dense one-shot, not rank r's own buffer.
    racy = "vals[r].load_global_volatile(reinterpret_cast<T*>(comm.data_bufs[r]) +"
    fixed = "vals[r].load_global_volatile(reinterpret_cast<T*>(comm.data_bufs[params.rank]) +"
    assert original.count(racy) == 1 and racy not in unhooked and racy not in text
    assert unhooked.count(fixed) == original.count(fixed) + 1 == 2
    assert unhooked.replace("inline ", "") == original.replace("inline ", "").replace(racy, fixed)
    # The hooked copy differs from the probe copy only where a wait is hooked: what the
    # patches removed, and what they added (hook lines, and the grid wait's condition,
    # unchanged, inside the bounded spin).
    removed, added = [], []
    a, b = unhooked.splitlines(), text.splitlines()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            removed += a[i1:i2]
            added += b[j1:j2]
    assert removed == [
        "  __device__ __forceinline__ void update(int new_clear_size) {",
        "      while (*reinterpret_cast<int volatile*>(counter_ptr) != gridDim.x) {",
        "      }",
        "__global__ void moereduce_allreduce_fusion_kernel_oneshot_lamport(",
        "  comm.update(params.size * NRanks);",
        "__global__ void moefinalize_allreduce_fusion_kernel_oneshot_lamport(",
        "  comm.update(params.size * NRanks);",
    ], removed
    assert [line for line in added if "fusedar" not in line.lower()] == [
        "        return *reinterpret_cast<int volatile*>(counter_ptr) != gridDim.x;",
        "      });",
    ], added


def test_a_changed_moe_header_fails_the_build_loudly(tmp_path):
    """A FlashInfer MoE header whose wait loop no longer reads as expected stops the configure
    with the patch's name, instead of building an unbounded kernel."""
    src = tmp_path / "src"
    shutil.copytree(_include_dir(), src)
    header = src / MOE_HEADER
    text = header.read_text()
    assert text.count("    bool done = false;\n") == 2
    header.write_text(text.replace("    bool done = false;\n", "    bool done{false};\n", 1))
    run = _run_patching(tmp_path / "out", str(src))
    assert run.returncode != 0
    said = " ".join((run.stdout + run.stderr).split())  # CMake wraps its messages
    assert (
        "expected 2 definition(s) of the Lamport polls' state in "
        "trtllm_moe_allreduce_fusion.cuh, found 1"
    ) in said, said


# --- the failure message (host-only) ------------------------------------------------------------
HOST_PROGRAM = r"""
// Host-only exercise of the failure record's text: no CUDA call is made (no GPU here).
#include <cstdio>
#include <cstring>
#include "handshake.h"
using namespace fusedar;

int main() {
  fusedar_rank r;
  r.rank = 0; r.device = 1;
  char buf[2048];
  watchdog::Record d{};
  r.record = &d;
  auto show = [&](const char* name, int site, int detail) {  // the record's text at a site
    d.site = site; d.detail = detail;
    fusedar_rank_failure(&r, buf, sizeof buf);
    std::printf("%s=[%s]\n", name, buf);
  };
  auto call = [&](const fusedar_launch_args& a) {
    handshake::Signature s = handshake::signature_of(a);
    std::memcpy(d.mine, &s, sizeof s);
  };
  fusedar_rank_failure(&r, buf, sizeof buf);
  std::printf("clean=[%s]\n", buf);
  fusedar_launch_args a{};
  a.pattern = 1; a.dtype = FUSEDAR_BFLOAT16; a.num_tokens = 16; a.hidden_dim = 4096;
  a.algorithm = FUSEDAR_ALGORITHM_ONESHOT; a.fp32_acc = 1;
  call(a);
  d.rank = 0; d.world = 2; d.device = 1; d.peer = 1; d.seq = 4;
  d.waited_ns = 3000400000ull; d.timeout_ns = 3000000000ull; d.kind = watchdog::kWaitTimeout;
  show("lamport", watchdog::kLamport, 5);
  fusedar_rank_call_check_failure(&r, buf, sizeof buf);
  std::printf("alias=[%s]\n", buf);
  show("barrier", watchdog::kBarrier, 7);
  d.peer = -1;
  show("grid", watchdog::kGrid, 132);
  // An MoE finalize call (pattern 7), described as fusedar_moe_launch describes it to the
  // handshake; its kernel polls this rank's Lamport buffer like the dense one-shot.
  fusedar_launch_args m{};
  m.pattern = 7; m.dtype = FUSEDAR_BFLOAT16; m.num_tokens = 16; m.hidden_dim = 7168;
  m.algorithm = FUSEDAR_ALGORITHM_ONESHOT;
  call(m);
  d.peer = 1;
  show("moe", watchdog::kLamport, 9);
  // The large-message algorithm's flags: a call of that algorithm, 8192 tokens.
  a.algorithm = FUSEDAR_ALGORITHM_LARGE_MESSAGE; a.num_tokens = 8192;
  call(a);
  d.seq = 9;
  show("large_enter", watchdog::kLargeEnter, 3);
  show("large_scatter", watchdog::kLargeScatter, 2);
  show("large_gather", watchdog::kLargeGather, 1);
  for (int site : {SITES}) {  // every site has its own text (SITES: watchdog.h's enumerators)
    char name[16];
    std::snprintf(name, sizeof name, "site%d", site);
    show(name, site, 0);
  }
  r.record = nullptr;  // not owned
  return 0;
}
"""


def wait_sites():
    """Site enumerators of ffi/core/watchdog.h: {name: value}."""
    text = (REPO / "ffi" / "core" / "watchdog.h").read_text()
    body = text[text.index("enum Site : int {") :]
    body = body[: body.index("};")]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(k\w+) = (\d+),", body)}


@pytest.mark.slow
def test_failure_messages_name_the_peer(tmp_path):
    sites = wait_sites()
    kernel_sites = [v for k, v in sites.items() if k != "kHandshake"]  # the handshake's own text
    program = HOST_PROGRAM.replace("{SITES}", "{" + ", ".join(map(str, kernel_sites)) + "}")
    lines = run_host_program(tmp_path, "host_timeout", program)
    assert lines["clean"] == "[]"
    lamport = lines["lamport"]
    assert lamport.startswith(
        "[jax_fusedar kernel wait timed out on rank 0 of 2 (device 1), call #4 "
        "{pattern=1 dtype=bfloat16 num_tokens=16 hidden_dim=4096 one-shot fp32_acc=1 layout=0 "
        "block_quant_group_size=0}: waited 3.0 s (timeout 3.0 s) for rank 1 to deliver its "
        "one-shot data in this rank's Lamport buffer (token 5). Rank 1 did not arrive"
    ), lamport
    assert "restart the process" in lamport and "JAX_FUSEDAR_TIMEOUT_S" in lamport
    assert lines["alias"] == lamport
    assert "for rank 1 to deliver its two-shot barrier flag (thread block 7)" in lines["barrier"]
    assert (
        "for no peer to deliver this rank's own thread blocks (grid counter). A rank skipped"
    ) in lines["grid"]
    large = (
        "[jax_fusedar kernel wait timed out on rank 0 of 2 (device 1), call #9 {pattern=1 "
        "dtype=bfloat16 num_tokens=8192 hidden_dim=4096 large-message fp32_acc=1 layout=0 "
        "block_quant_group_size=0}: waited 3.0 s (timeout 3.0 s) for rank 1 to deliver "
    )
    for key, flag in (
        ("large_enter", "entry flag (large-message call 3 of this rank)"),
        ("large_scatter", "chunk 2 scatter flag (its input rows of this rank's slice)"),
        ("large_gather", "chunk 1 gather flag (its reduced rows)"),
    ):
        text = lines[key]
        assert text.startswith(f"{large}its large-message {flag}. Rank 1 did not arrive"), text
        assert "restart the process" in text and "JAX_FUSEDAR_TIMEOUT_S" in text
    # Site coverage: every wait site of the kernels has a text of its own.
    named = {"kLamport", "kBarrier", "kGrid", "kLargeEnter", "kLargeScatter", "kLargeGather"}
    assert named <= set(sites), sites
    texts = [lines[f"site{v}"] for v in kernel_sites]
    assert not [t for t in texts if "an unknown wait" in t], texts
    wheres = [t[t.index(" to deliver ") : t.index(". ", t.index(" to deliver "))] for t in texts]
    assert len(set(wheres)) == len(kernel_sites), wheres
    assert (
        "call #4 {pattern=7 dtype=bfloat16 num_tokens=16 hidden_dim=7168 one-shot "
        "fp32_acc=0 layout=0 block_quant_group_size=0}: waited 3.0 s (timeout 3.0 s) for "
        "rank 1 to deliver its one-shot data in this rank's Lamport buffer (token 9). Rank 1 "
        "did not arrive"
    ) in lines["moe"], lines["moe"]
