"""The command-line tools: ``python -m jax_fusedar {demo,doctor}`` (``main``) and their
argument types (``argtypes``). ``main``, ``argtypes``, ``demo_args`` (the demo's flags),
``ranks`` (the TP plan) and ``doctor`` (the environment report) import no JAX, so that the
device count is settled before JAX starts; ``demo`` and ``moe_demo`` do. The benchmarks are
not here: ``benchmarks/`` of the source checkout."""
