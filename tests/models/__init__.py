"""Transformer models written in the styles public JAX code uses for tensor parallelism, for
the tests of ``jax_fusedar.fuse`` (tests/jax/test_fuse_styles.py, tests/gpu/test_fuse_styles.py).
None of them calls jax_fusedar: each is the model a user already has. ``styles.py`` lists
them with what fuse must make of each."""
