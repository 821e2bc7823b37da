"""The op family: every jax_fusedar FFI op, declared once (``family.FfiOp``), and what its
entries share.

* ``family``: the machinery (primitive, lowerings, bind, registry of ops and FFI targets);
* ``dense`` and ``moe``: the family's entries (the public functions, the ops behind them);
* ``plan`` (the JAX side of ``common.plan``: the call described, the plan as a primitive
  parameter, the fallback policy) and ``checks`` (the argument and workspace checks);
* ``transforms``: the dense op's JVP and batching rules;
* ``reference``, ``moe_reference``, ``quant_reference``, ``quant_arrays``: the math in plain
  JAX at the kernels' rounding points (every call the kernel does not serve);
* ``partitioning``: the dense op from plain ``jit``; ``timing``: device clocks.

The layer sits above ``common`` and ``workspace`` and below the package's public face
(``api``, ``export``) and ``fusion`` (``tests/common/test_no_framework_imports.py``).
"""
