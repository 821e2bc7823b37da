"""The fusion pass, ``jax_fusedar.fuse``, and its sections:

* ``transform``: ``fuse`` itself (the function transform: workspaces, tracing, the report);

* ``graph``: use-def information of a jaxpr;
* ``norm_proof``: the proof that equations compute RMSNorm (and an FP8 tail);
* ``validation``: the proven equations checked in float64 on probe inputs;
* ``matching``: sites (a reduction, the residual add, the proven norm);
* ``scopes``: walking a program's nested jaxprs, and which calls a site may open;
* ``rotation``: a scan's residual add and the next iteration's norm as one site;
* ``chain``: the same across checkpointed layers called one after another;
* ``rewriting``: the program evaluated again with each site replaced by one fused call;
* ``report``: what the pass reports;
* ``jax_internals``: the JAX internals it needs, in one place.
"""
