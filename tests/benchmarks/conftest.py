"""The benchmarks' CPU tests: 8 virtual CPU devices for JAX, set before any test module here
imports it (tests/cpu_devices.py). The torch benchmark's tests skip without torch."""

from tests.cpu_devices import use_host_devices

use_host_devices()
