"""Device-clock timing of JAX programs on GPUs (``jax_fusedar.timing``; the JAX benchmark,
``benchmarks/jax_bench.py``, times with it).

Wall-clock time around a jitted program measures the host as much as the GPU: dispatching
a program that drives two GPUs from one process costs hundreds of microseconds and varies
from run to run, which swamps kernels of a few microseconds. ``device_timestamp(x)`` instead
enqueues, on the device's own stream, a one-thread kernel that stores the GPU's
``%globaltimer`` (ns). It returns the stamp and ``x`` itself (aliased, no copy): ops that
consume the returned ``x`` run after the stamp, and the stamp runs after whatever produced
``x``. So ``t0, x = device_timestamp(x); y = f(x); t1, y = device_timestamp(y)`` brackets
``f`` on the device, host dispatch excluded (gaps the host leaves between ``f``'s kernels
included, as a model would see them).

CUDA only (the FFI target is registered for CUDA); ``available()`` says whether it can run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..common import native
from .family import register_ffi_targets

TARGET = native.FFI_TARGETS["device_timestamp"]


def available() -> bool:
    """True when the native module is built and the default backend is a GPU."""
    return native.available() and jax.default_backend() == "gpu"


def device_timestamp(x):
    """(stamp uint32[2] = low, high words of the device clock in ns, x passed through)."""
    if not register_ffi_targets():
        raise RuntimeError("jax_fusedar.timing needs the native module (a CUDA build)")
    x = jnp.asarray(x)
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct(x.shape, x.dtype)),
        input_output_aliases={0: 1},
    )
    return call(x)


def stamps_to_ns(stamps) -> np.ndarray:
    """uint32[..., 2] (low, high) stamps as int64 nanoseconds."""
    s = np.asarray(stamps).astype(np.int64)
    return s[..., 0] + (s[..., 1] << 32)
