"""What the integration lane measures for each model: the sites a reader of the model's code
counts, what jax_fusedar.fuse finds and fuses (default options and
``allow_rounding_change=True``) and why not the rest, the fused forward and gradient against
the original's, and fuse's analysis time against the original's lower + compile
(``python -m tests.integration.table`` prints docs/fusion_pass.md's table; test_lane.py
holds what is true today). A ``LaneModel``'s ``build()`` gives a ``Built``: the function as
the package runs it, its arguments placed on the mesh, the context it runs in."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jax_fusedar as jf
from jax.sharding import NamedSharding


@dataclasses.dataclass
class Built:
    fn: Callable  # fn(params, *inputs) -> the model's output (an array)
    params: object
    inputs: tuple
    mesh: object
    axis_name: str
    context: Optional[Callable] = None  # () -> the context the model runs in (its mesh)
    layers: int = 2
    # The activations' dtype T: differences are in its eps (a float32 norm weight of a
    # bfloat16 model gets its gradient through bfloat16 values).
    dtype: object = jnp.bfloat16

    def __post_init__(self):
        self.context = self.context or (lambda: jax.set_mesh(self.mesh))


@dataclasses.dataclass(frozen=True)
class LaneModel:
    name: str
    package: str  # the distribution whose code runs (its version is read at run time)
    counted_per_layer: int  # the sites a reader counts, per layer
    how_counted: str
    # build() at the lane's size; build(layers=n) with n layers, where the model's code
    # takes a layer count (ValueError where it does not)
    build: Callable[..., Built]


@dataclasses.dataclass
class Variant:
    """fuse with one set of options."""

    found: int  # sites met per run of the model (a site in a scan body counts its length)
    fused: int  # of those, fused
    found_in_program: int  # sites as they appear in the program (a scan body's once)
    fused_in_program: int
    reasons: dict  # reason -> number of sites
    rounding_changes: dict  # rounding change -> number of sites
    analysis_s: float  # fused.analyze(...) wall time
    lower_compile_s: float  # lower + compile of the fused program (tracing includes the pass)
    forward_bits_equal: bool
    forward_rel: float  # max |fused - original| / (eps_T * max |original|)
    grad_rel: Optional[float]  # the same for the parameters' gradients (the worst leaf)


@dataclasses.dataclass
class Row:
    model: str
    package: str
    version: str
    counted: int
    how_counted: str
    original_lower_compile_s: float
    default: Variant
    rounding: Variant  # allow_rounding_change=True


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def rel_diff(a, b, dtype) -> float:
    """max over the floating leaves of max |a - b| / (eps_T * max |b|), T = ``dtype``."""
    eps = float(jnp.finfo(dtype).eps)
    worst = 0.0
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if not jnp.issubdtype(np.asarray(v).dtype, jnp.floating):
            continue
        u64, v64 = np.asarray(u, np.float64), np.asarray(v, np.float64)
        scale = max(float(np.max(np.abs(v64))), 1e-30) * eps
        worst = max(worst, float(np.max(np.abs(u64 - v64))) / scale)
    return worst


def bits_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(u).dtype == np.asarray(v).dtype
        and np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))
        for u, v in zip(la, lb)
    )


def _timed(f):
    t = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t


def _loss(fn, cotangent):
    """A scalar of the model's output whose gradient reaches every parameter."""
    return lambda params, *inputs: jnp.sum(fn(params, *inputs).astype(jnp.float32) * cotangent)


def measure(model: LaneModel, *, grads: bool = True) -> Row:
    b = model.build()
    with b.context():
        original = jax.jit(b.fn)
        # Each timing starts from empty caches: the fused program of a model where nothing
        # fused is the original's, and would otherwise come from the compilation cache.
        jax.clear_caches()
        compiled, original_s = _timed(lambda: original.lower(b.params, *b.inputs).compile())
        want = compiled(b.params, *b.inputs)
        rng = np.random.default_rng(0)
        cot = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
        loss = _loss(b.fn, cot)
        want_grad = jax.jit(jax.grad(loss))(b.params, *b.inputs) if grads else None
        variants = []
        for allow in (False, True):
            fused = jf.fuse(b.fn, mesh=b.mesh, axis_name=b.axis_name, allow_rounding_change=allow)
            jax.clear_caches()
            report, analysis_s = _timed(lambda: fused.analyze(b.params, *b.inputs))
            jax.clear_caches()
            fused_compiled, fused_s = _timed(
                lambda: jax.jit(fused).lower(b.params, *b.inputs).compile()
            )
            got = fused_compiled(b.params, *b.inputs)
            grad_rel = None
            if grads:
                fused_loss = jf.fuse(
                    loss, mesh=b.mesh, axis_name=b.axis_name, allow_rounding_change=allow
                )
                got_grad = jax.jit(jax.grad(fused_loss))(b.params, *b.inputs)
                grad_rel = rel_diff(got_grad, want_grad, b.dtype)
                fused_loss.close()
            variants.append(
                Variant(
                    found=sum(s.runs or 1 for s in report.sites),
                    fused=sum(s.runs or 1 for s in report.fused),
                    found_in_program=len(report.sites),
                    fused_in_program=len(report.fused),
                    reasons=dict(report.reasons()),
                    rounding_changes=dict(
                        Counter(s.rounding_change for s in report.fused if s.rounding_change)
                    ),
                    analysis_s=analysis_s,
                    lower_compile_s=fused_s,
                    forward_bits_equal=bits_equal(got, want),
                    forward_rel=rel_diff(got, want, b.dtype),
                    grad_rel=grad_rel,
                )
            )
            fused.close()
    return Row(
        model=model.name,
        package=model.package,
        version=_version(model.package),
        counted=model.counted_per_layer * b.layers,
        how_counted=model.how_counted,
        original_lower_compile_s=original_s,
        default=variants[0],
        rounding=variants[1],
    )


def perturb_norm_weights(tree, seed: int = 0):
    """``tree`` with every leaf whose path names a norm drawn from U(0.5, 1.5) (same dtype and
    placement): random weights, as a trained model's gammas are, instead of the packages'
    initial ones, with which a rounding change of gamma's multiplication would not show."""
    rng = np.random.default_rng(seed)

    def new(path, a):
        name = jax.tree_util.keystr(path).lower()
        if "norm" not in name or not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        values = rng.uniform(0.5, 1.5, a.shape).astype(np.float32)
        return jax.device_put(jnp.asarray(values, a.dtype), a.sharding)

    return jax.tree_util.tree_map_with_path(new, tree)


def place(params, mesh, spec_of):
    """``params`` placed by ``spec_of(path)`` on ``mesh``, their norm weights perturbed."""
    put = lambda path, a: jax.device_put(a, NamedSharding(mesh, spec_of(path)))
    return perturb_norm_weights(jax.tree_util.tree_map_with_path(put, params))
