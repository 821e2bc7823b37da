"""Per-process body of tests/gpu/test_flashinfer_shim.py: FlashInfer's legacy TRT-LLM API as
torch_compat serves it (``torch_compat.as_flashinfer.comm``, which ``install_as_flashinfer()``
installs as ``flashinfer.comm``) against FlashInfer's own unified ``allreduce_fusion`` (the
anchor; same kernel), else torch_compat's: poisoned outputs, fresh inputs per case, bytes
compared and both held to the float64 oracle's bounds (anchor_compare.run_case).
"""

import time

from tests.gpu.workers.anchor_compare import DTYPES, PATTERNS, new_result, sweep


# The unified call's optional keywords, None where not given
_OPTIONAL = ("output", "residual_in", "residual_out", "norm_out", "quant_out", "scale_out")
_OPTIONAL += ("rms_gamma", "scale_factor", "block_quant_group_size")


def _legacy(comm, handles, tensor, meta, world, rank):
    """The unified call's keywords onto the legacy call, in its argument order; returns
    what the unified call would (the legacy one returns None)."""

    def fn(input, workspace, pattern, launch_with_pdl, rms_eps, use_oneshot, fp32_acc, **kw):
        if set(kw) - set(_OPTIONAL):
            raise TypeError(f"unexpected keywords {sorted(set(kw) - set(_OPTIONAL))}")
        o = {**dict.fromkeys(_OPTIONAL), **kw}
        m, h = input.shape
        args = [input, world, rank, m, h, tensor, launch_with_pdl, True, fp32_acc, pattern]
        args += [use_oneshot, o["output"], o["residual_in"], o["residual_out"], o["norm_out"]]
        args += [o["quant_out"], o["scale_out"], o["rms_gamma"], rms_eps, o["scale_factor"], None]
        group = o["block_quant_group_size"]
        comm.trtllm_allreduce_fusion(*args, metadata=meta, block_quant_group_size=group)
        if o["norm_out"] is not None:
            return o["norm_out"]
        return o["quant_out"] if o["quant_out"] is not None else o["output"]

    return fn


def worker(rank, world, chan, *, port, seed, anchor_path, tokens, hiddens):
    from tests.gpu import anchor
    from tests.gpu.workers.common import anchor_workspace
    from tests.gpu.workers.torch_workers import _gloo, _workspace

    with _gloo(rank, world, port) as (torch, dist, device, tc):
        t0 = time.monotonic()
        # The shim's modules themselves, not installed under flashinfer's name: the anchor
        # loader puts FlashInfer's own there (the name's install is tested on CPU).
        from torch_compat.as_flashinfer import comm

        fi = anchor.load(anchor_path) if anchor_path else None
        against = getattr(fi, "__file__", "FlashInfer") if fi else "torch_compat unified"
        result = new_result(rank, device, torch.__version__, against)
        kw = dict(use_fp32_lamport=False, group=dist.group.WORLD, create_metadata=True)
        handles, tensor, meta = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank, world, max(tokens), max(hiddens), **kw
        )
        # One 16-bit legacy workspace serves both dtypes, as FlashInfer's does.
        ours = _legacy(comm, handles, tensor, meta, world, rank)

        def make_calls(dtype):
            if fi is not None:
                ref_ws = anchor_workspace(fi, dist, world, rank, max(tokens), max(hiddens), dtype)
                return {"ours": (ours, None), "anchor": (fi.allreduce_fusion, ref_ws)}, (ref_ws,)
            ref_ws = _workspace(tc, torch, world, rank, max(tokens), max(hiddens), dtype)
            return {"ours": (ours, None), "anchor": (tc.allreduce_fusion, ref_ws)}, (ref_ws,)

        sweep(torch, dist, result, make_calls, world, seed, tokens, hiddens, DTYPES, PATTERNS)
        dist.barrier()
        comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(handles)
        result["destroyed"] = bool(handles.workspace.destroyed)
        result["seconds"] = time.monotonic() - t0
        return result
