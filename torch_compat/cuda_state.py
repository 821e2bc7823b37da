"""The CUDA state a launch reads from torch and the native module: the current stream, the
device's compute capability and whether a CUDA graph is being captured. Functions (looked up
through this module at each call) so that CPU tests can stand in for them."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from jax_fusedar.common import native

_capabilities: Dict[int, Tuple[int, int]] = {}


def current_stream(device: int) -> int:
    """The raw cudaStream_t of torch's current stream on ``device`` (so graph capture and
    user streams are honoured)."""
    return torch.cuda.current_stream(device).cuda_stream


def compute_capability(device: int) -> Tuple[int, int]:
    """(major, minor) of ``device``, cached (a host query; safe during graph capture)."""
    cc = _capabilities.get(device)
    if cc is None:
        cc = _capabilities[device] = tuple(native.require().compute_capability(device))
    return cc


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
