"""Skip markers for what a test needs and an environment may lack, each saying what is
missing and how to get it (one place, so every skip names the same remedy)."""

import pytest

from jax_fusedar.common import native

# How to get the native module on a machine without a GPU (./dev builds it where a GPU is
# visible; docs/install.md).
BUILD_NATIVE = "JAX_FUSEDAR_BUILD_KERNELS=1 ./dev setup builds it, with nvcc"
NO_NATIVE = f"jax_fusedar's native module is not built ({BUILD_NATIVE})"


def native_skip_reason(what: str) -> str:
    """The skip reason of a test that needs the native module for ``what``."""
    return f"{what} needs the native module, which is not built ({BUILD_NATIVE})"


needs_native = pytest.mark.skipif(not native.available(), reason=NO_NATIVE)
