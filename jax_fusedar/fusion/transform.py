"""``jax_fusedar.fuse(fn, ...)``: the all-reduce fusion pass for JAX, as a function transform.

``fuse(fn, mesh=mesh, axis_name="tp")`` returns a function with ``fn``'s signature whose
computation has every proven

    all-reduce -> residual add -> RMSNorm [-> FP8 quantization]

replaced by one fused call, like vLLM's ``AllReduceFusionPass`` does on torch.compile graphs
(``torch_compat.fusion_pass`` is the torch twin). The all-reduce may be a ``psum`` in the same
``shard_map`` scope, a ``psum`` returned by a ``shard_map`` of its own with the add and the norm
after it (per-linear layout), a ``psum_scatter`` with the add on the token shard and an
``all_gather`` (sequence parallelism), a psum inside a ``custom_vjp`` / ``custom_jvp`` (whose
rule is kept), a psum over several mesh axes of which the others have size 1, or, under
plain ``jax.jit`` with shardings, the partitioner's own all-reduce after a ``dot_general``
(rewritten into ``row_parallel_allreduce_fusion``, which partitions itself).

Exactness. A site is fused only when its equations are proven to compute RMSNorm with every
constant, broadcast and rounding accounted for (``fusion/norm_proof.py``), the proof is
confirmed in float64 on probe inputs of the real shapes (``fusion/validation.py``), and the
fused op rounds where the program does (gamma's own cast chain is replayed before the call):
then the outputs differ only by the documented bound (``docs/fusion_pass.md``). Forms that
round elsewhere (a bias added before the norm's rounding, a gamma that is not a value of the
activation dtype, a float32 all-reduce cast down before the add) are fused only with
``allow_rounding_change=True``, and reported per site. Only what the proof covers is
rewritten: a value the rewrite replaces that is used otherwise (returned twice, copied)
leaves the site unfused. Everything else is left as it is, with its reason; ``fuse`` does
not raise on a program that runs.

The sections of the pass are this module's neighbours in ``jax_fusedar/fusion/`` (matching,
scope walking, loop rotation, workspaces, rewriting, the report, the JAX internals it uses);
this module is the transform itself. Each trace runs four steps, each a plain function of
what the one before gave: analyse (``scopes.Analyzer``: the sites, the rewrite's plan and what
each site needs of a workspace, nothing allocated), plan the workspaces
(``workspaces.plan_workspaces``), allocate them (``workspaces.allocate``: the one step with
effects), rewrite (``rewriting.evaluate``).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Optional

import jax
import numpy as np

from . import jax_internals, rewriting, workspaces
from .matching import Scope
from .report import FusionReport, Reject, Site  # noqa: F401 (public names)
from .scopes import Analyzer

log = logging.getLogger("jax_fusedar")


# --- the transform -------------------------------------------------------------------------------

_MAX_SAME_KEY = 64  # live transforms with workspaces of one key, at most


class FusedFunction:
    """The callable returned by :func:`fuse`; see the module docstring."""

    def __init__(
        self,
        fn,
        *,
        mesh,
        axis_name,
        workspace,
        max_tokens,
        backend,
        allow_rounding_change,
        use_oneshot,
        strict,
        log_level,
    ):
        self.fn = fn
        self.mesh = mesh
        self.axis_name = axis_name
        self.max_tokens = max_tokens
        self.backend = backend
        self.allow_rounding_change = bool(allow_rounding_change)
        self.use_oneshot = use_oneshot
        self.strict = strict
        self.log_level = log_level
        self.given_workspace = workspace
        self.workspaces = []  # the ones this transform created
        self.report: Optional[FusionReport] = None
        self.traced = {}  # rewriting.traced_once's jaxprs, emptied at each trace
        self._jitted = jax.jit(self._run)
        functools.update_wrapper(self, fn, updated=())

    # the steps ------------------------------------------------------------------------------
    def _admission(self, refused) -> workspaces.Admission:
        return workspaces.Admission(
            mesh=self.mesh,
            axis_name=self.axis_name,
            given=self.given_workspace,
            existing=self.workspaces,
            max_tokens=self.max_tokens,
            backend=self.backend,
            allow_rounding_change=self.allow_rounding_change,
            refused=refused,
        )

    def _create(self, spec: workspaces.Spec):
        """A new workspace for ``spec`` (the allocation step's effect). Its stable key
        (what compiled programs find it by) has no name unless another transform's live
        kernel workspace holds that key: then the first free of the names
        ``jax_fusedar.fuse.2``, ``.3``, ... (the same in every process that creates them in
        the same order). Raises Reject when it cannot be created."""
        from ..workspace import WorkspaceKeyTaken, create_allreduce_fusion_workspace

        for n in range(1, _MAX_SAME_KEY + 1):
            try:
                ws = create_allreduce_fusion_workspace(
                    self.mesh,
                    self.axis_name,
                    max_token_num=spec.max_token_num,
                    hidden_dim=spec.hidden,
                    dtype=spec.dtype,
                    backend=self.backend,
                    name=None if n == 1 else f"jax_fusedar.fuse.{n}",
                )
            except WorkspaceKeyTaken:
                continue
            except (ValueError, RuntimeError, MemoryError) as e:
                raise Reject(f"cannot create a workspace: {e}") from None
            self.workspaces.append(ws)
            return ws
        raise Reject(
            f"cannot create a workspace: {_MAX_SAME_KEY} live kernel workspaces of this "
            "site's shape exist in this process (close the transforms no longer used: "
            "fused.close())"
        )

    def _analyse_and_allocate(self, jaxpr):
        """Analyse, plan the workspaces, allocate them; (Analyzer, rewrite Plan, seconds spent
        allocating). A workspace that cannot be created is refused to the analysis, which
        runs again: its sites are then reported unfused with the error (at most once per
        dtype and hidden size)."""
        refused = {}
        allocate_s = 0.0
        while True:
            analyzer = Analyzer(self._admission(refused), self.axis_name)
            plan = analyzer.plan(jaxpr, Scope("", None, None, 1))
            specs = workspaces.plan_workspaces(analyzer.needs, self.workspaces)
            start = time.perf_counter()
            failed = workspaces.allocate(specs, self._create)
            allocate_s += time.perf_counter() - start
            if not failed:
                break
            refused.update(failed)
        for need in analyzer.needs:
            need.match.workspace = need.workspace
        return analyzer, plan, allocate_s

    def close(self) -> None:
        """Destroys the workspaces this transform created (programs using them must not
        run afterwards)."""
        for ws in self.workspaces:
            ws.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # tracing --------------------------------------------------------------------------------
    def _run(self, *args, **kwargs):
        closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(*args, **kwargs)
        flat, _ = jax.tree.flatten((args, kwargs))
        start = time.perf_counter()
        analyzer, plan, allocate_s = self._analyse_and_allocate(closed.jaxpr)
        self.report = FusionReport(analyzer.sites, analyzer.near_misses())
        self.report.allocate_s = allocate_s
        self.report.analysis_s = time.perf_counter() - start - allocate_s
        log.log(self.log_level, "%s", self.report.line())
        self.traced = {}
        outs = rewriting.evaluate(plan.jaxpr, closed.consts, flat, plan, self)
        self.report.pass_s = time.perf_counter() - start
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs)

    def analyze(self, *args, **kwargs) -> FusionReport:
        """Traces ``fn`` at these arguments (arrays or ShapeDtypeStructs) and returns the
        report without running anything (workspaces are still created as needed)."""
        jax.eval_shape(self._run, *args, **kwargs)
        return self.report


def fuse(
    fn=None,
    *,
    mesh=None,
    axis_name: Optional[str] = None,
    workspace=None,
    max_tokens: Optional[int] = None,
    backend: Optional[str] = "auto",
    allow_rounding_change: bool = False,
    use_oneshot: Optional[bool] = None,
    strict: Optional[bool] = None,
    log_level: int = logging.INFO,
):
    """Returns ``fn`` with every proven all-reduce + residual add + RMSNorm (+ FP8 tail)
    replaced by one fused call; see the module docstring and ``docs/fusion_pass.md``.

    Args:
      fn: the function (its arguments: arrays or pytrees of arrays; bind static ones with
        ``functools.partial``). May itself be jitted, contain ``shard_map`` and loops, or be
        a plain-jit model whose arguments carry shardings (Auto or Explicit axes).
      mesh, axis_name: where workspaces are created (the mesh ``fn`` runs on, and its
        tensor-parallel axis; ``axis_name`` may be left out for a 1-D mesh).
      workspace: use this workspace instead (its mesh and axis); sites it cannot serve
        (another dtype, world size or mesh grouping, too large) stay unfused.
      max_tokens: the largest site (tokens) to fuse with created workspaces.
      backend: passed to ``create_allreduce_fusion_workspace`` ("auto": the kernel on GPUs).
      allow_rounding_change: also fuse forms whose rounding differs from the fused op's
        (a bias added before the norm's rounding, a float32 gamma or a float16 one in a
        bfloat16 model, a float32 all-reduce cast down before the add); reported per site
        as ``rounding_change``.
      use_oneshot, strict: passed to every ``allreduce_fusion`` call.
      log_level: level of the one-line report logged at each trace.
    Can be used as a decorator: ``@functools.partial(fuse, mesh=mesh)``.
    """
    if fn is None:
        return functools.partial(
            fuse,
            mesh=mesh,
            axis_name=axis_name,
            workspace=workspace,
            max_tokens=max_tokens,
            backend=backend,
            allow_rounding_change=allow_rounding_change,
            use_oneshot=use_oneshot,
            strict=strict,
            log_level=log_level,
        )
    if not callable(fn):
        raise TypeError(f"fuse: fn must be callable, got {fn!r}")
    if workspace is not None:
        from ..workspace import AllReduceFusionWorkspace

        if not isinstance(workspace, AllReduceFusionWorkspace):
            raise TypeError(
                "fuse: workspace must come from jax_fusedar.create_allreduce_fusion_workspace"
            )
        if mesh is not None and mesh is not workspace.mesh:
            raise ValueError("fuse: pass either mesh= or workspace=, not both")
        if axis_name is not None and axis_name != workspace.axis_name:
            raise ValueError(
                f"fuse: axis_name {axis_name!r} differs from the workspace's "
                f"axis {workspace.axis_name!r}"
            )
        mesh, axis_name = workspace.mesh, workspace.axis_name
    else:
        if mesh is None:
            raise ValueError(
                "fuse needs mesh= (and axis_name=) to create workspaces, or workspace="
            )
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"fuse: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis_name is None:
            if len(mesh.axis_names) != 1:
                raise ValueError(
                    f"fuse: the mesh has axes {tuple(mesh.axis_names)}; pass "
                    f"axis_name= (the tensor-parallel axis)"
                )
            axis_name = mesh.axis_names[0]
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"fuse: axis_name {axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}"
            )
    if max_tokens is not None and (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, (int, np.integer))
        or max_tokens <= 0
    ):
        raise ValueError(f"fuse: max_tokens must be a positive integer, got {max_tokens!r}")
    if backend not in (None, "auto", "trtllm", "xla"):
        raise ValueError(f"fuse: backend must be 'auto', 'trtllm' or 'xla', got {backend!r}")
    for name, value in (("use_oneshot", use_oneshot), ("strict", strict)):
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"fuse: {name} must be None, True or False, got {value!r}")
    if isinstance(log_level, bool) or not isinstance(log_level, int):
        raise TypeError(f"fuse: log_level must be a logging level (int), got {log_level!r}")
    if not isinstance(allow_rounding_change, (bool, np.bool_)):
        raise TypeError(
            f"fuse: allow_rounding_change must be True or False, got {allow_rounding_change!r}"
        )
    # The arguments first (each error names its argument), then whether this JAX can run it.
    jax_internals.require_supported_jax()
    return FusedFunction(
        fn,
        mesh=mesh,
        axis_name=axis_name,
        workspace=workspace,
        max_tokens=None if max_tokens is None else int(max_tokens),
        backend=backend,
        allow_rounding_change=allow_rounding_change,
        use_oneshot=use_oneshot,
        strict=strict,
        log_level=log_level,
    )
