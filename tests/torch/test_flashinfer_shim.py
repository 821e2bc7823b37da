"""torch_compat under FlashInfer's name (install_as_flashinfer): the installer, the names vLLM
and SGLang import, and the legacy TRT-LLM API, whose calls reach torch_compat's op with the
right arguments (on a recording FakeRank) or are refused as it refuses them. The kernel runs
in tests/gpu/test_flashinfer_shim.py; vLLM's and SGLang's modules in tests/torch/frameworks/."""

import importlib.util
import sys
import types

import pytest
import torch

import torch_compat
from torch_compat import as_flashinfer
from torch_compat.as_flashinfer.comm import trtllm_ar

from tests.repo import run_code
from tests.torch import rounding_check as rc
from tests.torch.fakes import fake_workspace


@pytest.fixture
def shim():
    comm = torch_compat.install_as_flashinfer()
    yield comm
    as_flashinfer.uninstall()


@pytest.fixture
def fake_create(monkeypatch):
    """The legacy create over a recording workspace of the group size asked for."""
    made = []

    def create(backend, *, world_size, rank, max_token_num, hidden_dim, dtype, **kw):
        ws = fake_workspace(
            world=world_size, max_tokens=max_token_num, hidden=hidden_dim, dtype=dtype
        )
        made.append((ws, kw))
        return ws

    monkeypatch.setattr(trtllm_ar, "create_allreduce_fusion_workspace", create)
    yield made
    trtllm_ar._by_args.clear()
    trtllm_ar._by_tensor.clear()


def test_install_makes_flashinfer_comm_importable(shim):
    import flashinfer
    import flashinfer.comm as comm
    from flashinfer.comm.mnnvl import CommBackend, TorchDistBackend

    assert comm is shim and flashinfer.comm is comm
    assert importlib.util.find_spec("flashinfer") is not None
    assert importlib.util.find_spec("flashinfer.comm") is not None
    assert comm.allreduce_fusion is torch_compat.allreduce_fusion
    assert comm.create_allreduce_fusion_workspace is torch_compat.create_allreduce_fusion_workspace
    assert comm.AllReduceFusionPattern.kARResidualRMSNorm == 1
    assert comm.QuantizationSFLayout.SWIZZLED_128x4 == 0
    names = "trtllm_allreduce_fusion trtllm_create_ipc_workspace_for_all_reduce_fusion"
    names += " trtllm_destroy_ipc_workspace_for_all_reduce_fusion"
    names += " trtllm_destroy_ipc_workspace_for_all_reduce"
    for name in names.split() + ["TRTLLMAllReduceFusionWorkspace", "AllReduceFusionWorkspace"]:
        assert hasattr(comm, name), name
    assert isinstance(CommBackend, type) and TorchDistBackend.__module__.startswith("torch_compat")
    assert torch_compat.install_as_flashinfer() is comm  # idempotent
    with pytest.raises(ImportError):  # the rest of FlashInfer is absent, as uninstalled
        import flashinfer.comm.trtllm_alltoall  # noqa: F401


def test_install_refuses_when_another_flashinfer_was_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    with pytest.raises(RuntimeError, match="call it before anything imports flashinfer"):
        torch_compat.install_as_flashinfer()


def test_install_in_a_fresh_process_before_vllm_style_probing():
    # What vLLM and SGLang do at import: find_spec, then import and probe with hasattr.
    code = (
        "import importlib.util, torch_compat\n"
        "assert importlib.util.find_spec('flashinfer') is None\n"
        "torch_compat.install_as_flashinfer()\n"
        "import flashinfer.comm as c\n"
        "print(importlib.util.find_spec('flashinfer') is not None,"
        " hasattr(c, 'allreduce_fusion') and hasattr(c, 'create_allreduce_fusion_workspace'))\n"
    )
    r = run_code(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


def test_torch_dist_backend_over_gloo(gloo_world1, shim):
    from flashinfer.comm.mnnvl import CommBackend, TorchDistBackend

    b = TorchDistBackend(group=gloo_world1)
    assert isinstance(b, CommBackend) and (b.Get_rank(), b.Get_size()) == (0, 1)
    assert b.allgather({"a": 1}) == ({"a": 1},) and b.bcast("x", 0) == "x"
    b.barrier()
    assert b.Split(color=0, key=0).Get_size() == 1


def test_legacy_create_and_call_reach_the_op(shim, fake_create, cpu_stream):
    m, h = 16, 1024
    handles, tensor, meta = shim.trtllm_create_ipc_workspace_for_all_reduce_fusion(
        0, 2, 64, h, use_fp32_lamport=False, group=None, create_metadata=True
    )
    ws = handles.workspace
    assert meta == ws.metadata and meta["tp_size"] == 2 and not meta["use_fp32_lamport"]
    # FlashInfer caches the function: the same arguments give the same workspace.
    assert shim.trtllm_create_ipc_workspace_for_all_reduce_fusion(0, 2, 64, h)[0] is handles
    for dtype in (torch.bfloat16, torch.float16):  # a 16-bit workspace serves both
        x, res, gamma = rc.inputs(m, h, dtype, seed=0)
        io = dict(residual_in=res, rms_gamma=gamma, allreduce_out=None)
        io.update(residual_out=torch.empty_like(x), norm_out=torch.empty_like(x))
        flags = dict(launch_with_pdl=True, trigger_completion_at_end=False, fp32_acc=True)
        flags.update(pattern_code=shim.AllReduceFusionPattern.kARResidualRMSNorm, rms_eps=1e-5)
        _legacy_call(shim, tensor, allreduce_in=x, metadata=meta, **io, **flags)
        args, kw = ws._rank_obj.launches[-1]
        assert args[0] == 1 and args[2:5] == (m, h, x.data_ptr())
        for name in ("residual_in", "norm_out", "residual_out", "rms_gamma"):
            assert kw[name] == io[name].data_ptr(), name
        assert kw["rms_eps"] == pytest.approx(1e-5) and kw["fp32_acc"] is True
        assert kw["trigger_completion_at_end"] is False and kw["launch_with_pdl"] is True
    # Pattern 0 writes allreduce_out (rms_eps None, as the legacy callers pass it).
    out = torch.empty_like(x)
    # FlashInfer's positional order: input, world, rank, tokens, hidden, workspace, pdl,
    # trigger, fp32_acc, pattern, use_oneshot, allreduce_out, then nine optional tensors.
    positional = (x, 2, 0, m, h, tensor, False, True, False, 0, None, out) + (None,) * 9
    shim.trtllm_allreduce_fusion(*positional)
    assert ws._rank_obj.launches[-1][1]["allreduce_out"] == out.data_ptr()
    shim.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles)
    assert ws.destroyed
    with pytest.raises(ValueError, match="not a workspace tensor"):
        shim.trtllm_allreduce_fusion(*positional)
    create = shim.trtllm_create_ipc_workspace_for_all_reduce_fusion
    with pytest.raises(ValueError, match="use_symm_dev_mem"):
        create(0, 2, 64, 1024, create_metadata=True, use_symm_dev_mem=True)


# The optional tensors and numbers, None unless a test passes them.
NONE_BY_DEFAULT = "residual_in residual_out norm_out quant_out scale_out rms_gamma rms_eps"
NONE_BY_DEFAULT += " scale_factor layout_code"


def _legacy_call(shim, tensor, **over):
    """trtllm_allreduce_fusion by keyword: pattern 0 on 16 x 1024 bfloat16 rows of a 2-rank
    group, each argument overridable."""
    x = torch.randn(16, 1024, dtype=torch.bfloat16)
    kw = dict(allreduce_in=x, world_size=2, world_rank=0, token_num=16, hidden_dim=1024)
    kw.update(workspace_ptrs=tensor, launch_with_pdl=False, trigger_completion_at_end=True)
    kw.update(fp32_acc=False, pattern_code=0, use_oneshot=None, allreduce_out=torch.empty_like(x))
    return shim.trtllm_allreduce_fusion(**kw | dict.fromkeys(NONE_BY_DEFAULT.split()) | over)


@pytest.mark.parametrize(
    "over, error, match",
    [
        ({"world_size": 4}, ValueError, "not the workspace's"),
        ({"world_rank": 1}, ValueError, "not the workspace's"),
        ({"token_num": 8}, ValueError, "token_num x hidden_dim"),
        ({"metadata": {"tp_size": 2}}, ValueError, "missing required keys"),
        ({"workspace_ptrs": torch.zeros(1, dtype=torch.int64)}, ValueError, "not a workspace"),
        ({"workspace_ptrs": [1, 2]}, TypeError, "workspace tensor"),
        ({"allreduce_in": torch.randn(16, 1024)}, ValueError, "element width"),  # float32
        ({"use_oneshot": "yes"}, TypeError, "use_oneshot"),
    ],
)
def test_legacy_call_refuses_what_flashinfer_would_misread(
    shim, fake_create, cpu_stream, over, error, match
):
    handles, tensor = shim.trtllm_create_ipc_workspace_for_all_reduce_fusion(0, 2, 64, 1024)
    with pytest.raises(error, match=match):
        _legacy_call(shim, tensor, **over)
    assert not handles.workspace._rank_obj.launches


def test_legacy_create_without_a_gpu_is_torch_compats_refusal(gloo_world1, shim):
    # The real creation on CPU: torch_compat's own checks answer (here the world size the
    # kernel has no build for), before any memory is touched.
    with pytest.raises(Exception) as info:
        shim.trtllm_create_ipc_workspace_for_all_reduce_fusion(0, 1, 64, 1024, group=gloo_world1)
    with pytest.raises(type(info.value), match=str(info.value)[:30].replace("(", r"\(")):
        torch_compat.create_allreduce_fusion_workspace(
            "trtllm", 1, 0, 64, 1024, torch.bfloat16, group=gloo_world1
        )


def test_fp4_swizzled_size():
    size = trtllm_ar.compute_fp4_swizzled_layout_sf_size
    assert size(5, 16) == 128 * 16 and size(129, 3) == 256 * 4
