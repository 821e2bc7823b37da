"""The integration lane (marker ``integration``, ``tools/integration.sh``): jax_fusedar.fuse
on models exactly as their packages publish them, on 8 CPU devices, in the lane's own venv
(``.venv-integration``). JAX's devices and flags are set before any module here imports it."""

from tests.cpu_devices import use_host_devices

use_host_devices()
