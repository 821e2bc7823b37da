"""``jax.export`` of programs that use jax_fusedar's op.

``jax.export`` refuses custom calls whose targets are not on its list of targets with a
compatibility guarantee. jax_fusedar's ops keep their own guarantee instead: each target's
name is versioned (``jax_fusedar_allreduce_fusion_v2``, ``jax_fusedar_moe_allreduce_fusion_v1``),
its operands, results and attributes never change under that name (a new layout gets a new
name), and the handler re-checks the operand and result lists, so an artifact never meets a
handler it was not built for. The targets come from the one registry of the package's ops
(``family.export_safe_targets``: every op declared through ``family.FfiOp``, the dense op and
both MoE ops); ``DISABLED_CHECKS`` states exactly that exemption (for those targets only), and
``export`` applies it::

    exp = jax_fusedar.export.export(jax.jit(f), platforms=("cpu", "cuda"))(*arg_specs)
    blob = exp.serialize()
    ...                                    # another process, after creating the workspace:
    jax_fusedar.export.deserialize(blob).call(*args)

At run time the custom call finds its workspace by the hash of a stable key (backend, the
mesh axis's members by device id, max_token_num, hidden_dim, dtype and an optional
``name``; see ``jax_fusedar.workspace``), so the serving process must create a workspace
with the same arguments (``abstract_workspace`` on the exporting side, which allocates
nothing, describes the same key); a missing one is an FFI error naming the id and the key's
fields. Multi-platform exports run the reference (psum + RMSNorm) on CPU. A program lowered
for cuda from a workspace on the XLA backend of a GPU-less process would silently hold the
reference instead of the kernel: ``export`` refuses it (plain lowering warns). Exporting
needs no native module (a custom call is its target's name and attributes), so it works on
any machine; running an artifact that calls the kernel needs it (``deserialize`` says so).
Symbolic token counts are refused with a clear error: export one artifact per token count.
``row_parallel_allreduce_fusion`` exports on Explicit mesh axes (on Auto axes its
partitioning is a Python callback, which ``export`` refuses with an explanation).
Serializing needs the ``flatbuffers`` package (``jax.export``'s requirement).
"""

from __future__ import annotations

import re

import jax

from .ops import dense, moe  # noqa: F401 (their ops fill the registry)
from .common import native
from .ops.family import (
    allowing_reference_for_cuda,
    export_safe_targets,
    refusing_reference_for_cuda,
    register_ffi_targets,
)

DISABLED_CHECKS = tuple(
    jax.export.DisabledSafetyCheck.custom_call(target) for target in export_safe_targets()
)


def export(fun, *, platforms=None, disabled_checks=(), **kwargs):
    """``jax.export.export(fun, ...)`` with ``DISABLED_CHECKS`` added; ``fun`` is wrapped in
    ``jax.jit`` if it is not jitted. Returns the function of argument specs that gives the
    ``jax.export.Exported``, as ``jax.export.export`` does. Raises ValueError when a call
    would be exported for cuda with the reference because its workspace is an XLA-backend
    workspace of this GPU-less process (use ``abstract_workspace(..., backend="trtllm")``)."""
    if not hasattr(fun, "trace"):
        fun = jax.jit(fun)
    exporter = jax.export.export(
        fun, platforms=platforms, disabled_checks=(*DISABLED_CHECKS, *disabled_checks), **kwargs
    )

    def do_export(*args, **kw):
        try:
            with refusing_reference_for_cuda():
                return exporter(*args, **kw)
        except NotImplementedError as e:
            if "host_callbacks" not in str(e):
                raise
            raise ValueError(
                f"jax.export: {e}. If the program calls row_parallel_allreduce_fusion on "
                "Auto mesh axes, that is its partition rule (custom_partitioning runs a "
                "Python callback when XLA compiles): export it on a mesh with Explicit axes "
                "(jax.make_mesh's default, under jax.set_mesh), where the op is placed at "
                "trace time, or write the layer with shard_map + allreduce_fusion"
            ) from e

    return do_export


def deserialize(blob) -> jax.export.Exported:
    """``jax.export.deserialize`` after registering jax_fusedar's FFI targets with XLA (the
    cuda handlers and their host twins), which a fresh process needs before it can compile
    the artifact. An artifact that calls them, in a process without the native module
    (where the handlers are compiled), raises RuntimeError saying what to install: it could
    not be compiled there, not even on CPU, where a ``("cpu", "cuda")`` artifact's cuda
    branch needs the handler's host twin."""
    registered = register_ffi_targets()
    exported = jax.export.deserialize(blob)
    if not registered:
        called = [t for t in export_safe_targets() if f"@{t}" in exported.mlir_module()]
        if called:
            try:
                native.require()
            except RuntimeError as e:
                raise RuntimeError(
                    f"jax_fusedar.export.deserialize: the artifact calls {', '.join(called)}, "
                    f"whose handlers this process needs to compile it, but {e}"
                ) from e
    return exported


def workspace_ids(exported) -> list:
    """The workspace ids (``workspace_id`` attributes) the artifact's fused calls look up."""
    text = exported.mlir_module() if hasattr(exported, "mlir_module") else str(exported)
    return sorted({int(m) for m in re.findall(r"workspace_id = (\d+) : i64", text)})


def allow_reference_for_cuda():
    """A context inside which ``export`` lets a cuda lowering keep the reference for
    XLA-backend workspaces (the program then never uses the kernel)."""
    return allowing_reference_for_cuda()
