"""The fusion pass's sections (``jax_fusedar.fuse`` in ``jax_fusedar/fusion_pass.py`` uses them):

* ``graph``: use-def information of a jaxpr;
* ``norm_proof``: the proof that equations compute RMSNorm (and an FP8 tail);
* ``validation``: the proven equations checked in float64 on probe inputs;
* ``matching``: sites (a reduction, the residual add, the proven norm);
* ``scopes``: walking a program's nested jaxprs, and which calls a site may open;
* ``rewriting``: the program evaluated again with each site replaced by one fused call;
* ``report``: what the pass reports;
* ``jax_internals``: the JAX internals it needs, in one place.
"""
