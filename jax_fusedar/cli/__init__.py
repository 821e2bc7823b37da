"""The command-line tool ``python -m jax_fusedar demo`` (``main``) and its argument types
(``argtypes``); ``main`` and ``argtypes`` import no JAX, ``demo`` and ``moe_demo`` do. The
benchmarks are not here: ``benchmarks/`` of the source checkout."""
