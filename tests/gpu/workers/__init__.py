"""Per-process bodies of the GPU tests (tests/gpu/test_*.py): the rank processes that
``tests.gpu.harness.run_ranks`` spawns, and the modules a test starts as
``python -m tests.gpu.workers.<name>``."""
