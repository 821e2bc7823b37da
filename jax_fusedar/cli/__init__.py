"""The command-line tools: ``python -m jax_fusedar {demo,bench,doctor}`` (``main``), their
shared argument types (``argtypes``) and result reporting (``report``: progress, table, plot,
JSON). ``main``, ``argtypes``, ``report``, ``demo_args`` (the demo's flags), ``ranks`` (the TP
plan) and ``doctor`` (the environment report) import no JAX, so that the device count is
settled before JAX starts; ``demo`` and ``bench`` do."""
