"""Models written in plain JAX (no jax_fusedar calls), for jax_fusedar.fuse to rewrite."""
