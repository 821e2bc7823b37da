"""The tensor checks the dense op (``ops``) and the MoE ops (``moe``) share: type, shape,
dtype and contiguity against a reference tensor, the RMSNorm weight, placement on the
workspace's device with the alignment the kernels access, whether the sizes are plain ints
(under ``torch.compile`` with dynamic shapes they are SymInts), and the value of an int
argument traced as a SymInt; and the error for a call the kernel does not serve
(``refusal``). Host metadata only, so every check also runs on fake tensors and during
CUDA-graph capture.
"""

from __future__ import annotations

import torch

from jax_fusedar.common import plan as rules

# The kernels move 16-byte vectors: a tensor starting elsewhere (a view with an odd storage
# offset) faults with a misaligned address.
ALIGNMENT = 16
# Scale tensors are read/written per float/int32 word.
SCALE_ALIGNMENT = 4


def check_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_contiguous(name: str, t) -> None:
    check_tensor(name, t)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_shape(name: str, t, shape, dtype) -> None:
    """``t`` is a contiguous tensor of exactly ``shape`` and ``dtype``."""
    check_contiguous(name, t)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(
            f"{name} must have shape {list(shape)} and dtype {dtype}, got {list(t.shape)} {t.dtype}"
        )


def check_like(name: str, t, ref: torch.Tensor) -> None:
    """``t`` must look exactly like ``ref`` (the input): same shape, dtype, contiguous."""
    check_tensor(name, t)
    if tuple(t.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name} must have the input's shape [token_num, hidden_dim] = "
            f"{list(ref.shape)}, got {list(t.shape)}"
        )
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have the input's dtype {ref.dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_gamma(gamma, ref: torch.Tensor) -> None:
    """``rms_gamma`` is [hidden_dim] of ``ref``'s dtype, contiguous."""
    hidden_dim = ref.shape[1]
    check_tensor("rms_gamma", gamma)
    if tuple(gamma.shape) != (hidden_dim,):
        raise ValueError(
            f"rms_gamma must have shape [hidden_dim] = [{hidden_dim}], got {list(gamma.shape)}"
        )
    if gamma.dtype != ref.dtype:
        raise ValueError(f"rms_gamma must have the input's dtype {ref.dtype}, got {gamma.dtype}")
    if not gamma.is_contiguous():
        raise ValueError("rms_gamma must be contiguous")


def check_placement(name: str, t: torch.Tensor, ws, alignment: int = ALIGNMENT) -> None:
    """``t`` is on the device of ``ws`` (a TorchAllReduceFusionWorkspace) and starts on an
    ``alignment``-byte boundary."""
    if t.device != ws.torch_device:
        raise ValueError(
            f"{name} must be on {ws.torch_device} (the workspace's device), got {t.device}"
        )
    if t.data_ptr() % alignment:
        raise ValueError(
            f"{name} must start on a {alignment}-byte boundary (the kernel "
            f"accesses {alignment}-byte words); got address {t.data_ptr():#x}"
        )


def static_shape(t: torch.Tensor) -> bool:
    """Whether ``t``'s sizes are plain ints. Under torch.compile with dynamic shapes they
    are SymInts: the rules on sizes (workspace fit, launch limits, one-shot choice) then
    wait for the eager op, which sees the real sizes; all other checks still run."""
    return all(type(d) is int for d in t.shape)


def concrete(value):
    """``value``, or the int of a SymInt: torch.compile with ``dynamic=True`` traces an int
    argument as a SymInt, but the pattern and the NVFP4 layout decide the outputs' number,
    dtypes and layout formula, so the fake implementations need their value. ``int()``
    fixes it with a guard (another value compiles again); symbolic sizes and group sizes
    stay symbolic (their checks wait for the eager op)."""
    return int(value) if isinstance(value, torch.SymInt) else value


def refusal(decided: rules.Plan) -> str:
    """torch's error for a call whose plan (``common.plan``) the kernel does not serve:
    torch has no fallback, it raises, as FlashInfer does."""
    if decided.kind == rules.TOO_SMALL:
        return f"the call does not fit the workspace: {decided.reason}"
    return decided.reason
