"""The command-line tools: ``python -m jax_fusedar {demo,bench}`` (``main``), their shared
argument types (``argtypes``) and result reporting (``report``: progress, table, plot, JSON).
``main``, ``argtypes`` and ``report`` import no JAX; ``demo`` and ``bench`` do."""
