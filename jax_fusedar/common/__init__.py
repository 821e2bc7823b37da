"""The framework-neutral layer: every rule that the JAX API and ``torch_compat`` must apply
alike, so both make the *same* decisions from the same inputs. Pure Python (stdlib + numpy);
never imports jax or torch (``tests/common/test_no_framework_imports.py`` checks it).

* ``plan``: what one call does (whether the kernel serves it, with which algorithm, or
  why not; its results in order), the one decision of both front ends;
* ``limits``: what the FlashInfer kernel can run at all (world size, hidden size, dtype);
* ``moe_limits``: what FlashInfer's MoE kernels (patterns 6 and 7) can run;
* ``sizing``: how big one rank's workspace is, and whether a call fits it;
* ``launch_mode``: whether a call runs one-shot or two-shot;
* ``tp_groups``: which devices or processes form each tensor-parallel group, in which rank
  order, on which hosts;
* ``exchange``: the keys and the two-phase protocol by which a group exchanges its buffers;
* ``join``: the one protocol by which JAX's and torch's processes join a group (publish,
  agree on the options, create, connect);
* ``lifecycle``: the workspace base both front ends subclass (destroy, context manager,
  repr, the element-count rule);
* ``backend_choice``: the kernel ("trtllm") or plain collectives ("xla"), and strict mode;
* ``handshake``: the options of the opt-in cross-rank handshake;
* ``patterns``: FlashInfer's fusion patterns and what each reads and writes (the native
  twin is ffi/core/include/fusedar/patterns.h);
* ``results``: the name, shape and dtype of every result of a call (``result_specs``);
* ``quant_layouts``: shapes and byte layouts of the quantized outputs;
* ``arguments``: the shared argument and environment-variable validators;
* ``environment``: every ``JAX_FUSEDAR_*`` variable, checked at once (the CLI does, first);
* ``lost_traps``: ends a process whose rank trapped while the GPU driver never reported it;
* ``native``: the loader of the native module.

These are the decisions peer projects got wrong (DP groups built over WORLD, TP rank taken
from a device id, colliding random exchange keys, per-rank launch choices that differ;
``docs/decisions.md``), so every rule states the reason it exists.
"""
