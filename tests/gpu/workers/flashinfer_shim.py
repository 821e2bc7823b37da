"""Per-process body of tests/gpu/test_flashinfer_shim.py: FlashInfer's legacy TRT-LLM API
as torch_compat serves it (``torch_compat.as_flashinfer.comm``, what
``install_as_flashinfer()`` installs as ``flashinfer.comm``:
``trtllm_create_ipc_workspace_for_all_reduce_fusion`` and ``trtllm_allreduce_fusion``),
against a reference on the same inputs: FlashInfer's own build (the anchor's unified
``allreduce_fusion``; same kernel) where the anchor is there, else torch_compat's unified
``allreduce_fusion``. Every output poisoned first, fresh inputs per case, bytes compared and
both held to the float64 oracle's bounds (anchor_compare.run_case).
"""

from __future__ import annotations

import time

from tests.gpu.workers.anchor_compare import DTYPES, PATTERNS, new_result, sweep


def _legacy(comm, handles, tensor, meta, world, rank):
    """The unified call's keywords onto the legacy call, in its argument order; returns
    what the unified call would (the legacy one returns None)."""

    def fn(
        input,
        workspace,
        pattern,
        launch_with_pdl,
        rms_eps,
        use_oneshot,
        fp32_acc,
        output=None,
        residual_out=None,
        norm_out=None,
        quant_out=None,
        scale_out=None,
        residual_in=None,
        rms_gamma=None,
        scale_factor=None,
        block_quant_group_size=None,
    ):
        m, h = input.shape
        comm.trtllm_allreduce_fusion(
            input,
            world,
            rank,
            m,
            h,
            tensor,
            launch_with_pdl,
            True,
            fp32_acc,
            pattern,
            use_oneshot,
            output,
            residual_in,
            residual_out,
            norm_out,
            quant_out,
            scale_out,
            rms_gamma,
            rms_eps,
            scale_factor,
            None,
            metadata=meta,
            block_quant_group_size=block_quant_group_size,
        )
        return (
            norm_out if norm_out is not None else (quant_out if quant_out is not None else output)
        )

    return fn


def worker(rank, world, chan, *, port, seed, anchor_path, tokens, hiddens):
    from tests.gpu import anchor
    from tests.gpu.workers.common import anchor_workspace
    from tests.gpu.workers.torch_workers import _init, _workspace

    torch, dist, device = _init(rank, world, port, rank)
    import torch_compat as tc

    t0 = time.monotonic()
    try:
        # The shim's modules themselves, not installed under flashinfer's name: the anchor
        # loader puts FlashInfer's own there (the name's install is tested on CPU).
        from torch_compat.as_flashinfer import comm

        fi = anchor.load(anchor_path) if anchor_path else None
        against = getattr(fi, "__file__", "FlashInfer") if fi else "torch_compat unified"
        result = new_result(rank, device, torch.__version__, against)
        handles, tensor, meta = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank,
            world,
            max(tokens),
            max(hiddens),
            use_fp32_lamport=False,
            group=dist.group.WORLD,
            create_metadata=True,
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
    finally:
        dist.destroy_process_group()
