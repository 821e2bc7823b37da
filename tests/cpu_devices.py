"""The JAX devices of the CPU tests: 8 virtual CPU devices. JAX reads JAX_PLATFORMS when it
is imported and XLA_FLAGS when it first starts its backend, so the conftest.py of every folder
of CPU tests that use JAX calls use_host_devices() before pytest imports its test modules; a
value already in the environment wins. Imports no JAX."""

import os

HOST_DEVICES = 8
HOST_DEVICES_FLAG = f"--xla_force_host_platform_device_count={HOST_DEVICES}"


def use_host_devices() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", HOST_DEVICES_FLAG)
