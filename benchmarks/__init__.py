"""The benchmarks of the source checkout (not part of the package; the wheel holds none):

* ``python -m benchmarks.jax_bench``: the JAX op against its unfused XLA twin;
* ``python -m benchmarks.torch_bench``: torch_compat against FlashInfer's own build (the
  anchor, ``tools/flashinfer_anchor.py``), NCCL and torch symmetric memory;
* ``python -m benchmarks.fuse_cost``: ``jax_fusedar.fuse``'s analysis time and the fused
  program's lower + compile time against the original's.

They are clients of the product like any user's script: they use only its public API (the
names ``jax_fusedar`` and ``torch_compat`` export, ``jax_fusedar.timing`` for device clocks,
and ``jax_fusedar.common.plan`` to say what a call runs), never its internals, and
tests/common/test_no_framework_imports.py holds them to it. ``report`` is what both share:
arguments, sample statistics, the progress bar, the table and the result files.
"""
