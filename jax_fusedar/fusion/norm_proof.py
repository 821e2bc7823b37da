"""Proof that the equations after a residual sum compute RMSNorm (and an FP8 tail), in the
fused op's canonical form, with every rounding accounted for, or the precise reason they do not.

Starting from the residual sum ``r`` (``[..., H]`` in the activation dtype T), every value
computed from it is given a symbolic meaning, equation by equation:

* ``Sq``: ``f^2`` elementwise, ``f`` the float32 view of ``r``;
* ``Row``: a per-token value ``c * (a * Q + b) ** p`` with ``Q = sum_j f_j^2`` over the last
  axis (or LayerNorm's ``sum_j f_j``);
* ``Elem``: ``k * f * row * col`` elementwise, ``col`` a free ``[H]`` vector (gamma, with the
  steps that made it from its array: casts, Gemma's ``1 + w``) placed on the hidden axis.

Values not computed from ``r`` are free: a scalar constant, or a gamma whose broadcasts are
followed back to its root to check that its one non-unit dimension lands on the hidden
axis. Every constant is folded into ``a``, ``b``, ``c`` or ``k``, so nothing is dropped: the
output is RMSNorm exactly when it reduces to ``overall * f * (Q / H + eps) ** -1/2 * col``
with ``eps = b / (a H) >= 0`` and ``overall = 1`` up to the float32 rounding of the constants
it is made of (``1/H`` or ``sqrt(H)`` written as float32 literals). Dimensions have roles by
position (the last is the hidden axis, the others are token axes), never by size, so a
per-token value is not taken for gamma when T == H.

Roundings. Between the site's inputs and ``norm_out`` a value is rounded wherever the
program casts it to a narrower dtype or computes in one. The fused op rounds at fixed points
(the all-reduce's sum and the residual add in T, the norm in float32, one rounding of the
normalized value times ``weight_bias + float32(gamma)`` to T, gamma read in T). Each rounding
of the program is either one of those, or is reproduced outside the kernel (gamma's own cast
chain is replayed on gamma before the call), or is a declared :class:`RoundingChange`
(fused only with ``allow_rounding_change``, reported per site), or the site is refused with
it as the reason:

* the normalized value's path (``_path_roundings``): every factor applied in float32 before
  one rounding to T; gamma multiplied only after that rounding leaves the multiplication in
  the program (the fused norm is the rounded value: ``_rounded_before_gamma``), a bias added
  before it is a declared change (``_declare_bias``);
* gamma's cast chain (``_gamma_feed``): the value the program multiplies must be the
  kernel's ``weight_bias + float32(g)`` for a ``g`` in T computed from gamma's array by the
  program's own steps; a gamma whose values are not T's (a float32 gamma, a float16 gamma in
  a bfloat16 model) is a declared change where T's range holds them, refused otherwise;
* the all-reduce's input in float32, cast down before the add (``matching.py``): declared.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from jax.extend import core as jcore

from . import graph as G
from .report import Reject

# One float32 constant (1/H, sqrt(H), 1/sqrt(H)) is within 2^-24 (relative) of the exact
# value it stands for: the proof accepts an overall constant that far from 1 per constant
# folded into it, a difference of the kind float32 arithmetic itself makes (an order of
# operations). Anything farther is another formula.
FLOAT32_CONSTANT = 2.0**-24
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (512.0 * 448.0)
SHAPE_OPS = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")
NO_NORM_IN_SCOPE = "no RMSNorm of the residual sum in the same scope"
STOP_GRADIENT = (
    "lax.stop_gradient inside the norm (the fused op differentiates through the whole norm, "
    "so fusing would change the gradient)"
)


@dataclasses.dataclass(frozen=True)
class Row:
    """``c * (a * Q + b) ** p`` per token (``mean``: ``c * sum_j f_j`` instead). ``nk``: how
    many constants were folded into it; ``stopped``: it passed a ``stop_gradient``."""

    a: float
    b: float
    p: float
    c: float
    dtype: str
    mean: bool = False
    nk: int = 0
    stopped: bool = False

    def scaled(self, k: float) -> "Row":
        if self.p == 1 and self.c == 1 and not self.mean:
            return dataclasses.replace(self, a=self.a * k, b=self.b * k, nk=self.nk + 1)
        return dataclasses.replace(self, c=self.c * k, nk=self.nk + 1)

    def inverse(self) -> "Row":
        return dataclasses.replace(self, p=-self.p, c=1.0 / self.c)


@dataclasses.dataclass(frozen=True)
class Col:
    """gamma along the hidden axis: ``root`` its array, ``ops`` the steps that change its
    values (or its derivative) on the way to the norm, in order: ``("cast", dtype)``,
    ``("add", c, dtype)`` (Gemma's ``1 + w``, computed in dtype), ``("stop_gradient",)``."""

    root: Any
    ops: tuple


@dataclasses.dataclass(frozen=True)
class Elem:
    """``k * f**e * row * col`` elementwise. ``path``: what happened to the value, in order:
    ("op", factor, dtype) for each factor applied ("row", "col", "k") and ("round", row
    applied, col applied) for each narrowing cast to T. ``nk``: constants folded into ``k``;
    ``stopped``: the value passed a ``stop_gradient``."""

    e: int
    row: Optional[Row]
    col: Optional[Col]
    k: float
    dtype: str
    path: tuple = ()
    nk: int = 0
    stopped: bool = False
    bias: Optional[Col] = None  # a [H] vector added (Equinox's RMSNorm(use_bias=True))

    def applied(self, what: str) -> "Elem":
        if self.bias is not None and what != "bias":
            raise Reject("the normalized value is scaled after a bias is added to it")
        return dataclasses.replace(self, path=self.path + (("op", what, self.dtype),))


@dataclasses.dataclass(frozen=True)
class Sq:
    """``k2 * f^2`` elementwise."""

    dtype: str
    k2: float = 1.0
    nk: int = 0
    stopped: bool = False


@dataclasses.dataclass
class NormProof:
    """What the fused op needs of a proven norm, and what of the program it replaces."""

    out_var: Any  # the norm output (norm_out)
    gamma: Any  # gamma's root atom, or None (ones)
    weight_bias: float
    eps: float
    rounding_change: Optional[str]
    out_dtype: str  # the norm output's dtype (T, or float32: cast back)
    eqns: set  # every eqn of the proof (for validation and liveness)
    pattern: int = 1
    scale: Any = None  # static FP8 scale atom
    quant_var: Any = None  # FP8 output
    scale_out_var: Any = None  # dynamic FP8 per-token scale
    tail_note: Optional[str] = None
    tail_eqns: tuple = ()  # the FP8 tail's eqns (from out_var and scale), in order
    gamma_ops: tuple = ()  # gamma's steps (Col.ops) the rewrite replays before the call
    overall: float = 1.0  # the program's constant factor over the fused op's formula
    # A bias added to the normalized value (declared: added after the fused norm's
    # rounding, in ``bias_dtype``): its root atom and the casts on the way.
    bias: Any = None
    bias_ops: tuple = ()
    bias_dtype: Optional[str] = None


def _cast_dtype(eqn) -> str:
    import numpy as np

    return np.dtype(eqn.params["new_dtype"]).name


def concrete_problem(shape) -> Optional[str]:
    """Why a site of this shape cannot be fused (a symbolic dimension: jax.export with shape
    polymorphism), or None; the fused op's own rule (ops.checks.check_concrete_shape)."""
    from ..ops.checks import check_concrete_shape

    try:
        check_concrete_shape("the residual sum", tuple(shape), "the fused op")
    except ValueError as e:
        return str(e)
    return None


def _constant_add(g: G.Graph, e, out):
    """(index of the array operand, constant) of an ``add`` of a scalar constant to an array
    shaped like ``out``, or None."""
    for c_side, v_side in ((0, 1), (1, 0)):
        c = G.scalar_constant(g, e.invars[c_side])
        v = e.invars[v_side]
        if c is not None and G.is_var(v) and G.shape(v) == G.shape(out):
            return v_side, c
    return None


class _Prover:
    def __init__(self, g: G.Graph, r, allow: bool):
        self.g = g
        self.r = r
        self.T = G.dtype(r)
        self.shape = G.shape(r)
        self.m = len(self.shape) - 1  # number of token dims
        self.H = self.shape[-1]
        self.allow = allow
        self.sym = {}  # var -> symbolic value
        self.tainted = {r}  # vars computed from r
        self.first_failure = None  # reason of the first refusal met
        self.failure_on_path = False

    # --- free values ------------------------------------------------------------------------
    def free_col(self, atom):
        """The [H] gamma behind a free operand of rank m + 1: its root and the steps from it
        (casts, additions of a constant), its dims followed from the root to the operand's
        positions. None when the operand is constant-shaped."""
        g = self.g
        chain = []  # eqn indices, from the operand back to the root
        cur = atom
        while G.is_var(cur):
            j, e = g.eqn(cur)
            if e is None:
                break
            n = G.name(e)
            if n == "add":
                found = _constant_add(g, e, cur)
                if found is None:
                    break
                chain.append(j)
                cur = e.invars[found[0]]
                continue
            if len(e.invars) != 1 or n not in G.NO_OPS + (G.CAST, "stop_gradient") + SHAPE_OPS:
                break
            chain.append(j)
            cur = e.invars[0]
        root = cur
        root_shape = G.shape(root)
        labels = [d if s != 1 else None for d, s in enumerate(root_shape)]
        ops = []
        for j in reversed(chain):
            e = g.eqns[j]
            out_shape = G.shape(e.outvars[0])
            n = G.name(e)
            if n == G.CAST:
                ops.append(("cast", _cast_dtype(e)))
            elif n == "stop_gradient":  # replayed: gamma's gradient stays stopped
                ops.append(("stop_gradient",))
            elif n == "add":
                ops.append(("add", _constant_add(g, e, e.outvars[0])[1], G.dtype(e.outvars[0])))
            elif n == "broadcast_in_dim":
                new = [None] * len(out_shape)
                for src, dst in enumerate(e.params["broadcast_dimensions"]):
                    new[dst] = labels[src]
                labels = new
            elif n in ("reshape", "squeeze", "expand_dims"):
                kept = [lab for lab in labels if lab is not None]
                if [s for s in out_shape if s != 1] != [root_shape[lab] for lab in kept]:
                    raise Reject(f"gamma {root_shape} is reshaped to {out_shape} inside the norm")
                it = iter(kept)
                labels = [next(it) if s != 1 else None for s in out_shape]
        placed = [pos for pos, lab in enumerate(labels) if lab is not None]
        if not placed:
            return None
        if len(placed) > 1:
            raise Reject(
                f"an array of shape {root_shape} multiplies the normalized value "
                "(only a [hidden] gamma along the last axis is fused)"
            )
        if placed[0] != len(labels) - 1:
            raise Reject(
                f"a per-token factor of shape {root_shape} multiplies the normalized "
                "value (gamma must vary along the hidden axis only)"
            )
        if math.prod(root_shape) != self.H:
            raise Reject(f"gamma of shape {root_shape} is not a [{self.H}] vector")
        return Col(root, tuple(ops))

    # --- the walk ---------------------------------------------------------------------------
    def run(self):
        g = self.g
        self.sym[self.r] = Elem(1, None, None, 1.0, self.T)
        start = g.defs.get(self.r, -1) + 1
        horizon = max(g.users(self.r), default=-1)  # the last eqn reading a symbolic value
        for i in range(start, len(g.eqns)):
            if i > horizon:
                break
            e = g.eqns[i]
            if not any(G.is_var(a) and a in self.tainted for a in e.invars):
                continue
            self.tainted.update(e.outvars)
            try:
                val = self.rule(e)
            except Reject as why:
                # Only refusals on a statistic or a normalized value explain a missing norm
                # (the residual sum's other uses, e.g. the next residual add, do not).
                ins = [self.sym.get(a) for a in e.invars if G.is_var(a)]
                normish = [
                    v
                    for v in ins
                    if isinstance(v, (Sq, Row))
                    or isinstance(v, Elem)
                    and (v.row is not None or v.col is not None)
                ]
                on_path = any(isinstance(v, Elem) and v.row is not None for v in normish)
                squares = G.name(e) in ("square", "integer_pow", "pow", "reduce_sum") or (
                    G.name(e) == "mul" and e.invars[0] is e.invars[1]
                )
                if (normish or squares) and (
                    self.first_failure is None or (on_path and not self.failure_on_path)
                ):
                    self.first_failure, self.failure_on_path = str(why), on_path
                val = None
            if val is not None and len(e.outvars) == 1:
                self.sym[e.outvars[0]] = val
                horizon = max([horizon] + g.users(e.outvars[0]))

    def operand(self, a):
        """("sym", value) for a value computed from r and understood; ("free", atom) for a
        value not computed from r; ("opaque", None) for one computed from r otherwise."""
        if G.is_var(a) and a in self.sym:
            return "sym", self.sym[a]
        if G.is_var(a) and a in self.tainted:
            return "opaque", None
        return "free", a

    def rule(self, e):
        n = G.name(e)
        x = self.sym.get(e.invars[0]) if e.invars and G.is_var(e.invars[0]) else None
        if n in G.NO_OPS:
            return x if len(e.invars) == 1 else None
        if n == "stop_gradient":
            # Forward, the value itself; what it changes is the derivative, which the fused
            # op would take through it: recorded, and refused if it reaches the output.
            return None if x is None else dataclasses.replace(x, stopped=True)
        if n == G.CAST:
            return None if x is None else self.cast(x, _cast_dtype(e))
        if n in ("mul", "div"):
            return self.muldiv(e, n)
        if n in ("add", "sub"):
            return self.addsub(e, n)
        if n in ("square", "integer_pow", "pow"):
            return None if x is None else self.power(e, n, x)
        if n in ("rsqrt", "sqrt"):
            if x is None:
                return None
            if not isinstance(x, Row) or x.p != 1 or x.c != 1 or x.mean:
                raise Reject(f"{n} of something other than the mean of squares inside the norm")
            return self.row_in_f32(dataclasses.replace(x, p=-0.5 if n == "rsqrt" else 0.5))
        if n == "reduce_sum":
            return None if x is None else self.reduce_sum(e, x)
        if n in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
            return None if x is None else self.reshape(e, n, x)
        if n == "neg" and isinstance(x, Elem):
            return dataclasses.replace(x, k=-x.k).applied("k")
        if n in ("max", "min") and any(
            isinstance(self.sym.get(a), Row) for a in e.invars if G.is_var(a)
        ):
            raise Reject(f"{n} of the mean of squares inside the norm (RMSNorm adds eps)")
        return None  # not part of a norm (an FP8 tail, or something else): opaque

    def row_in_f32(self, row: Row) -> Row:
        if row.dtype != "float32":
            raise Reject(f"RMSNorm computed in {row.dtype}, not float32")
        return row

    def cast(self, x, to: str):
        if to not in G.FLOATS or (to != "float32" and to != self.T):
            raise Reject(f"a cast to {to} inside the norm")
        if isinstance(x, (Row, Sq)):
            if to != "float32":
                raise Reject(f"RMSNorm computed in {to}, not float32")
            return dataclasses.replace(x, dtype=to)
        if not isinstance(x, Elem) or to == x.dtype:
            return x
        if to == "float32":
            return dataclasses.replace(x, dtype=to)
        # Narrowing to T: exact while the value is still r itself, or is still the value
        # last rounded to T (widened and narrowed back).
        if (x.e == 1 and x.row is None and x.col is None and x.k == 1) or (
            x.path and x.path[-1][0] == "round"
        ):
            return dataclasses.replace(x, dtype=to)
        return dataclasses.replace(
            x, dtype=to, path=x.path + (("round", x.row is not None, x.col is not None),)
        )

    def muldiv(self, e, n):
        a, b = e.invars
        ka, va = self.operand(a)
        kb, vb = self.operand(b)
        if "opaque" in (ka, kb):
            return None  # e.g. an FP8 tail's division by its dynamic scale
        if ka == kb == "sym":
            if n == "mul" and a is b and isinstance(va, Elem):
                return self.square_of(va)
            return self.combine(n, va, vb)
        if n == "mul":
            x, free = (va, vb) if ka == "sym" else (vb, va)
            return self.times_free(x, free)
        if ka == "sym":
            return self.over_free(va, vb)
        c = G.scalar_constant(self.g, va)  # constant / symbolic
        if isinstance(vb, Row) and c is not None and not vb.mean:
            return self.row_in_f32(vb.inverse().scaled(c))
        raise Reject("a value divided by a statistic of the residual sum inside the norm")

    def square_of(self, x: Elem):
        if x.e != 1 or x.row is not None or x.col is not None:
            raise Reject("a square of the normalized value inside the norm")
        if x.dtype != "float32":
            raise Reject(f"RMSNorm computed in {x.dtype}, not float32")
        return Sq(x.dtype, x.k * x.k, 2 * x.nk, x.stopped)

    def combine(self, n, x, y):
        """Both operands computed from r and understood."""
        if n == "mul":
            if isinstance(x, Row) and isinstance(y, Elem):
                x, y = y, x
            if isinstance(x, Elem) and isinstance(y, Row):
                return self.apply_row(x, y)
            if isinstance(x, Elem) and isinstance(y, Elem) and x.e + y.e == 1:
                f, fac = (x, y) if x.e == 1 else (y, x)  # f: the value, fac: row * col
                if f.row is not None or (f.col is not None and fac.col is not None):
                    raise Reject("two per-token factors multiply the normalized value")
                out = dataclasses.replace(
                    f,
                    row=fac.row,
                    col=f.col or fac.col,
                    k=f.k * fac.k,
                    nk=f.nk + fac.nk,
                    stopped=f.stopped or fac.stopped,
                )
                out = out.applied("row")
                return out.applied("col") if fac.col is not None else out
            raise Reject("two values computed from the residual sum multiplied inside the norm")
        if isinstance(x, Elem) and isinstance(y, Row):
            return self.apply_row(x, y.inverse())
        if isinstance(x, Elem) and isinstance(y, Elem):
            return None  # e.g. an FP8 tail's division by its dynamic scale
        raise Reject("a division of per-token statistics inside the norm")

    def apply_row(self, x: Elem, row: Row):
        if row.mean:
            raise Reject("LayerNorm (mean subtracted), not RMSNorm")
        if x.row is not None:
            raise Reject("two per-token factors multiply the normalized value")
        if x.e != 1:
            raise Reject("two per-token statistics multiplied inside the norm")
        if self.T != "float32":
            self.row_in_f32(row)
        return dataclasses.replace(x, row=row).applied("row")

    def times_free(self, x, free):
        """A symbolic value times a value not computed from r."""
        c = G.scalar_constant(self.g, free)
        if c is not None:
            if isinstance(x, Row):
                return x.scaled(c)
            return self.times_free_const(x, c)
        if math.prod(G.shape(free)) == 1:
            if isinstance(x, Row):
                raise Reject("the mean's factor traced (not a constant)")
            raise Reject("a traced scalar multiplies the normalized value")
        if isinstance(x, Sq):
            raise Reject("the squares are weighted before the sum (not RMSNorm)")
        if len(G.shape(free)) != self.m + 1:
            raise Reject(f"an array of shape {G.shape(free)} multiplies the norm")
        col = self.free_col(free)
        if col is None:
            raise Reject("a traced scalar multiplies the normalized value")
        if isinstance(x, Row):
            if x.mean:
                raise Reject("LayerNorm (mean subtracted), not RMSNorm")
            if self.T != "float32":
                self.row_in_f32(x)
            return Elem(0, x, col, 1.0, x.dtype, stopped=x.stopped)
        if x.col is not None:
            raise Reject("two gamma vectors multiply the normalized value")
        return dataclasses.replace(x, col=col).applied("col")

    def bias_of(self, x: Elem, free) -> Optional[Col]:
        """The [H] vector added to the normalized value ``x`` (a bias), or None."""
        if x.e != 1 or x.row is None or x.bias is not None:
            return None
        if not G.is_var(free) or len(G.shape(free)) != self.m + 1:
            return None
        try:
            col = self.free_col(free)
        except Reject:
            return None
        if col is None or any(op[0] != "cast" for op in col.ops):
            return None
        return col

    def over_free(self, x, free):
        """A symbolic value divided by a value not computed from r."""
        c = G.scalar_constant(self.g, free)
        if c is not None and c != 0:
            return self.times_free_const(x, 1.0 / c)
        if isinstance(x, Row) and math.prod(G.shape(free)) == 1:
            raise Reject("the mean's divisor traced (not a constant)")
        if isinstance(x, Elem) and x.row is not None:
            return None  # e.g. a static FP8 scale: the tail's
        raise Reject("a division by a traced value inside the norm")

    def times_free_const(self, x, k):
        if isinstance(x, Row):
            return x.scaled(k)
        if isinstance(x, Elem):
            return dataclasses.replace(x, k=x.k * k, nk=x.nk + 1).applied("k")
        return dataclasses.replace(x, k2=x.k2 * k, nk=x.nk + 1)

    def addsub(self, e, n):
        a, b = e.invars
        ka, va = self.operand(a)
        kb, vb = self.operand(b)
        if "opaque" in (ka, kb):
            return None
        if ka == kb == "sym":
            if (
                n == "sub"
                and isinstance(va, Elem)
                and (isinstance(vb, Elem) or isinstance(vb, Row) and vb.mean)
            ):
                raise Reject("LayerNorm (mean subtracted), not RMSNorm")
            raise Reject(
                f"an {'addition' if n == 'add' else 'subtraction'} of two values "
                "computed from the residual sum inside the norm"
            )
        if ka == "free":
            if n == "sub":
                raise Reject("a statistic of the residual sum is subtracted from a value")
            va, vb = vb, va
        c = G.scalar_constant(self.g, vb)
        if isinstance(va, Row):
            if va.mean:
                raise Reject("LayerNorm (mean subtracted), not RMSNorm")
            if c is None:
                if n == "add" and math.prod(G.shape(vb)) == 1:
                    raise Reject("eps traced (not a constant)")
                raise Reject("a traced value is added to the mean of squares")
            if va.p != 1 or va.c != 1:
                raise Reject(
                    "eps added after the square root (x / (sqrt(mean) + eps)), not "
                    "inside it as RMSNorm does"
                )
            return dataclasses.replace(va, b=va.b + (c if n == "add" else -c))
        if isinstance(va, Elem):
            if n == "sub" and c == 0.0 and va.e == 1 and va.row is None and va.col is None:
                return va  # flax.linen's (x - 0)
            bias = self.bias_of(va, vb) if n == "add" and c is None else None
            if bias is not None:
                return dataclasses.replace(va, bias=bias).applied("bias")
            if n == "sub":
                raise Reject(
                    "a value is subtracted from the residual sum inside the norm "
                    "(LayerNorm's mean?), not RMSNorm"
                )
            raise Reject(
                "a value is added to the normalized output (a bias: LayerNorm's beta?), not RMSNorm"
            )
        raise Reject("an addition to the squares inside the norm")

    def power(self, e, n, x):
        if n == "square":
            y = 2.0
        elif n == "integer_pow":
            y = float(e.params["y"])
        else:
            y = G.scalar_constant(self.g, e.invars[1])
            if y is None:
                raise Reject("a traced exponent inside the norm")
        if isinstance(x, Elem) and y == 2.0:
            return self.square_of(x)
        if isinstance(x, Row) and not x.mean:
            if y == 1.0:
                return x
            if x.p == 1 and x.c == 1 and y in (0.5, -0.5, -1.0):
                return self.row_in_f32(dataclasses.replace(x, p=y))
            if y == -1.0:
                return x.inverse()
        raise Reject(f"{n}[{y:g}] inside the norm")

    def reduce_sum(self, e, x):
        axes = tuple(int(a) % (self.m + 1) for a in e.params["axes"])
        if axes != (self.m,):
            what = axes[0] if len(axes) == 1 else axes
            raise Reject(f"norm over axis {what}, not the last")
        if isinstance(x, Sq):
            return Row(x.k2, 0.0, 1.0, 1.0, x.dtype, nk=x.nk, stopped=x.stopped)
        if isinstance(x, Elem) and x.e == 1 and x.row is None and x.col is None:
            return Row(1.0, 0.0, 1.0, x.k, x.dtype, mean=True, nk=x.nk, stopped=x.stopped)
        raise Reject("a sum over the hidden axis of something other than the squares")

    def reshape(self, e, n, x):
        src = G.shape(e.invars[0])
        out = G.shape(e.outvars[0])
        if isinstance(x, Row):
            if n == "broadcast_in_dim":
                if len(out) != self.m + 1:
                    raise Reject(f"a per-token statistic broadcast to {out}")
                for d, (s, dst) in enumerate(zip(src, e.params["broadcast_dimensions"])):
                    if s != 1 and dst != d:
                        raise Reject(
                            f"a per-token statistic broadcast along axis {dst} (the "
                            "hidden axis or another token axis)"
                        )
                return x
            pos_in = [(p, s) for p, s in enumerate(src) if s != 1]
            pos_out = [(p, s) for p, s in enumerate(out) if s != 1]
            if (
                pos_in != pos_out
                or len(out) > self.m + 1
                or (len(out) == self.m + 1 and out[-1] != 1)
            ):
                raise Reject(f"a per-token statistic reshaped from {src} to {out}")
            return x
        if isinstance(x, Elem) and (
            out == src
            or (
                n == "broadcast_in_dim"
                and tuple(e.params["broadcast_dimensions"]) == tuple(range(len(out)))
                and all(a == b for a, b in zip(src, out))
            )
        ):
            return x
        raise Reject(f"a value of the norm reshaped from {src} to {out}")


# --- choosing the output and checking it -----------------------------------------------------


def _canonical(prover: _Prover, x: Elem) -> tuple:
    """(eps, overall) of the norm, or raises why ``x`` is not RMSNorm: ``x = k * f * c *
    (a Q + b) ** -1/2 * col`` is ``overall * f * (Q / H + eps) ** -1/2 * col`` with
    ``eps = b / (a H)`` and ``overall = k * c / sqrt(a H)``, which must be 1 but for the
    float32 rounding of the constants folded into it (FLOAT32_CONSTANT each)."""
    row = x.row
    if row.p != -0.5:
        raise Reject(
            f"the residual sum is multiplied by (mean of squares) ** {-row.p:g}, not "
            "its inverse square root"
        )
    if row.a <= 0 or row.c <= 0:
        raise Reject("the norm's mean of squares has a non-positive factor")
    H = prover.H
    eps = row.b / (row.a * H)
    overall = x.k * row.c / math.sqrt(row.a * H)
    tolerance = max(1, x.nk + row.nk) * FLOAT32_CONSTANT
    if abs(overall - 1.0) > tolerance * (1.0 + 1e-9):
        if row.c == 1 and x.k == 1:
            raise Reject(f"the mean divides by {1.0 / row.a:.9g}, not the hidden size {H}")
        raise Reject(
            f"the normalized value is scaled by {overall:.9g} (a constant the fused "
            "op does not apply)"
        )
    if eps < 0:
        raise Reject(f"negative eps ({eps:g}) inside the norm")
    return eps, overall


def _pick_output(prover: _Prover):
    """(var, value) of the norm's output: every factor applied, in T when there is such a
    value (an FP8 tail's cast back to float32 comes after it), else the first in float32."""
    g = prover.g
    cands = [
        (g.defs[v], v, s)
        for v, s in prover.sym.items()
        if isinstance(s, Elem)
        and s.e == 1
        and s.row is not None
        and G.shape(v) == prover.shape
        and v in g.defs
    ]
    if not cands:
        return None
    with_col = [c for c in cands if c[2].col is not None]
    pool = with_col or cands
    roots = {id(c[2].col.root) for c in with_col}
    if len(roots) > 1:
        raise Reject("two RMSNorms of the residual sum (different gammas)")
    in_t = [c for c in pool if c[2].dtype == prover.T]
    _, var, val = min(in_t or pool, key=lambda c: c[0])
    if val.col is not None:
        exact = _rounded_before_gamma(prover, val, cands)
        if exact is not None:
            return exact
    return var, val


def _rounded_before_gamma(prover: _Prover, val: Elem, cands):
    """(var, value) of the normalized value as the program rounds it to T, when gamma is
    multiplied only after that rounding (Hugging Face's ``weight * x.astype(dtype)``,
    MaxText's einsum with gamma in T): the fused op with a gamma of ones computes exactly
    that value, and the program's own multiplication by gamma stays after it. None when
    gamma is applied before the rounding, or no such value exists."""
    rounds = [k for k, ev in enumerate(val.path) if ev[0] == "round"]
    if prover.T == "float32" or not rounds:
        return None
    _, row_applied, col_applied = val.path[rounds[0]]
    after = [ev for ev in val.path[rounds[0] + 1 :] if ev[0] == "op"]
    if col_applied or not row_applied or not after or any(ev[1] != "col" for ev in after):
        return None
    plain = [
        c
        for c in cands
        if c[2].col is None
        and c[2].dtype == prover.T
        and c[2].path
        and c[2].path[-1][0] == "round"
        and c[2].path == val.path[: rounds[0] + 1]
    ]
    if not plain:
        return None
    _, var, v = min(plain, key=lambda c: c[0])
    return var, v


# --- roundings --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RoundingChange:
    """A rounding the program makes elsewhere than the fused op (docs/fusion_pass.md,
    "Rounding changes"): without ``allow_rounding_change`` the site is refused with
    ``refused``; with it, the site is fused and reports ``reported``."""

    refused: str
    reported: str

    def declare(self, allow: bool, changes: list) -> None:
        if not allow:
            raise Reject(self.refused)
        changes.append(self.reported)


def _path_roundings(prover: _Prover, x: Elem, out_dtype: str, allow: bool) -> list:
    """The declared changes of the normalized value's path, or raises why it is not fused.

    Exact: every factor applied in float32, then one rounding to T. Declared: gamma
    multiplied after the normalized value was rounded to T, in T (Hugging Face, MaxText) or
    in float32 (Hugging Face Flax, whose output is then float32, or rounded to T once
    more). In a float32 model nothing on the path is narrower (``cast`` refuses a cast to
    another dtype)."""
    T = prover.T
    changes = []
    if T == "float32":
        return changes
    rounds = [k for k, ev in enumerate(x.path) if ev[0] == "round"]
    for ev in x.path[: rounds[0] if rounds else len(x.path)]:
        if ev[2] != "float32":
            if ev[1] == "col":
                raise Reject(f"gamma multiplied in {T} before the norm")
            raise Reject(f"RMSNorm computed in {T}, not float32")
    if not rounds:
        raise Reject(f"the norm output is not cast back to {T}")
    _, row_applied, col_applied = x.path[rounds[0]]
    if not row_applied:
        raise Reject(f"RMSNorm computed in {T}, not float32")
    ops_after = [ev for ev in x.path[rounds[0] + 1 :] if ev[0] == "op"]
    if any(ev[1] != "col" for ev in ops_after):
        raise Reject(f"the normalized value is scaled after its rounding to {T}")
    if ops_after and ops_after[0][2] == T:  # in T (Hugging Face, MaxText)
        RoundingChange(
            f"gamma multiplied in {T} after the norm is rounded",
            f"gamma multiplied in float32 before one rounding to {T}",
        ).declare(allow, changes)
    elif ops_after:  # in float32 (Hugging Face Flax)
        RoundingChange(
            f"gamma multiplied in float32 after the norm is rounded to {T} (the fused op "
            "rounds once, after it)",
            f"gamma multiplied before one rounding to {T}"
            + ("" if out_dtype == T else f" (the float32 output is the {T} one)"),
        ).declare(allow, changes)
    elif out_dtype != T:
        raise Reject(f"the norm output is not cast back to {T}")
    return changes


# The formats holding every value of a dtype: every bfloat16 and every float16 value is a
# float32, and neither 16-bit format holds all of the other's (bfloat16 has 8 significant
# bits and float32's range, float16 has 11 and a range ending at 65504).
_HOLDERS = {
    "bfloat16": ("bfloat16", "float32"),
    "float16": ("float16", "float32"),
    "float32": ("float32",),
}


def holders(dtype: str) -> frozenset:
    return frozenset(_HOLDERS.get(dtype, (dtype,)))


def formats_after(dtype: str, ops) -> frozenset:
    """The formats holding every value gamma can have after ``ops`` (Col.ops) from an array
    of ``dtype``: a cast to a format that does not hold the value rounds it, an addition
    rounds to its dtype."""
    held = holders(dtype)
    for op in ops:
        if op[0] == "cast":
            if op[1] not in held:
                held = holders(op[1])
        elif op[0] == "add":
            held = holders(op[2])
    return held


@dataclasses.dataclass(frozen=True)
class GammaFeed:
    """What the fused call takes for gamma: ``ops`` replayed on gamma's array, then cast to
    T (exact unless a change was declared), and ``weight_bias``."""

    ops: tuple
    weight_bias: float


def _gamma_feed(col: Col, T: str, allow: bool, changes: list) -> GammaFeed:
    """The kernel computes ``weight_bias + float32(g)`` with ``g`` in T. That is the value
    the program multiplies when the program's gamma is a value of T (the chain ends with a
    rounding to T, or never leaves T's values: Gemma's ``(1 + w)`` rounded by the program
    included), or when it is ``c + float32(v)`` in float32 with ``v`` a value of T (Gemma's
    ``1 + w``: ``weight_bias = c``). Otherwise the kernel would round gamma: declared where
    T's range holds the values (bfloat16), refused in float16 (whose range ends at 65504)."""
    root = G.dtype(col.root)
    ops = col.ops
    held = formats_after(root, ops)
    if T in held:
        return GammaFeed(ops, 0.0)
    # The last step that changes values (a stop_gradient after it commutes with it).
    last = max((n for n, op in enumerate(ops) if op[0] != "stop_gradient"), default=None)
    if (
        last is not None
        and ops[last][0] == "add"
        and ops[last][2] == "float32"
        and T in formats_after(root, ops[:last])
    ):
        return GammaFeed(ops[:last] + ops[last + 1 :], float(ops[last][1]))
    kind = min(held, key=lambda d: (d == "float32", d))  # its narrowest format
    if T == "float16":
        raise Reject(
            f"{kind} gamma in a float16 model: the kernel reads gamma in float16, whose "
            "range ends at 65504 (larger values would become inf); round gamma to float16 "
            "in the model (e.g. gamma.astype(jnp.float16)) to fuse exactly"
        )
    RoundingChange(
        f"{kind} gamma (the kernel reads gamma in {T})", f"gamma rounded to {T}"
    ).declare(allow, changes)
    return GammaFeed(ops, 0.0)


def prove_rms_norm(g: G.Graph, r, allow: bool) -> NormProof:
    """The proof for the residual sum ``r`` (a Var of shape [..., H], dtype T), or raises
    Reject with the reason."""
    problem = concrete_problem(G.shape(r))
    if problem:
        raise Reject(problem)
    prover = _Prover(g, r, allow)
    prover.run()
    picked = _pick_output(prover)
    if picked is None:
        if prover.first_failure is not None:
            raise Reject(prover.first_failure)
        raise Reject(NO_NORM_IN_SCOPE)
    out, x = picked
    out_dtype = G.dtype(out)
    changes = []
    try:
        if x.stopped or x.row.stopped:
            raise Reject(STOP_GRADIENT)
        eps, overall = _canonical(prover, x)
        changes += _path_roundings(prover, x, out_dtype, allow)
        col = x.col
        feed = None if col is None else _gamma_feed(col, prover.T, allow, changes)
        if x.bias is not None:
            _declare_bias(prover, x, allow, changes)
    except Reject:
        if prover.failure_on_path:
            raise Reject(prover.first_failure) from None
        raise
    proof = NormProof(
        out_var=out,
        gamma=None if col is None else col.root,
        weight_bias=0.0 if feed is None else feed.weight_bias,
        eps=eps,
        rounding_change="; ".join(changes) or None,
        out_dtype=out_dtype,
        eqns=set(),
        gamma_ops=() if feed is None else feed.ops,
        overall=overall,
    )
    stop = {r} | ({col.root} if col else set())
    if x.bias is not None:
        proof.bias, proof.bias_ops = x.bias.root, x.bias.ops
        proof.bias_dtype = next(ev[2] for ev in x.path if ev[:2] == ("op", "bias"))
        stop.add(x.bias.root)
    proof.eqns = backward_slice(g, [out], stop=stop)
    if proof.bias is None:  # (an FP8 tail of a biased value stays as written)
        _match_fp8_tail(prover, proof)
    return proof


def _declare_bias(prover: _Prover, x: Elem, allow: bool, changes: list) -> None:
    """A bias added to the normalized value: the fused op has none, so it is added to its
    output, after the rounding to T: a rounding change unless nothing rounds in between
    (a float32 model)."""
    T = prover.T
    rounds = [k for k, ev in enumerate(x.path) if ev[0] == "round"]
    at = next(k for k, ev in enumerate(x.path) if ev[:2] == ("op", "bias"))
    if T == "float32" or (rounds and rounds[0] < at):
        return  # no rounding between the norm and the bias
    RoundingChange(
        f"a bias added to the normalized value before its rounding to {T} (the fused op "
        "has no bias)",
        f"bias added after the fused norm's rounding to {T}",
    ).declare(allow, changes)


def norm_like(g: G.Graph, r) -> bool:
    """Whether something reduces the squares (or the values: LayerNorm) of ``r`` over its
    last axis: a norm, proven or not, reads it."""
    if concrete_problem(G.shape(r)):
        return False
    prover = _Prover(g, r, True)
    prover.run()
    return any(isinstance(v, (Row, Sq)) for v in prover.sym.values()) or (
        prover.first_failure or ""
    ).startswith(("norm over axis", "LayerNorm", "RMSNorm "))


def backward_slice(g: G.Graph, outs, stop: set) -> set:
    """Eqn indices computing ``outs`` back to the ``stop`` vars (and literals)."""
    seen = set()
    todo = [v for v in outs if G.is_var(v)]
    while todo:
        v = todo.pop()
        if v in stop:
            continue
        i = g.defs.get(v)
        if i is None or i in seen:
            continue
        seen.add(i)
        todo.extend(a for a in g.eqns[i].invars if G.is_var(a))
    return seen


# --- FP8 tails --------------------------------------------------------------------------------


def _follow(g, v, names):
    """Through single-use eqns of ``names``; (last var, eqns)."""
    eqns = set()
    while True:
        u = g.only_user(v)
        if u is None or G.name(g.eqns[u]) not in names:
            return v, eqns
        eqns.add(u)
        v = g.eqns[u].outvars[0]


def _clip(g, q):
    """(clipped var, eqns) of clip(q, -448, 448) spelled as jnp.clip, lax.clamp or
    max/min, or None."""
    u = g.only_user(q)
    if u is None:
        return None
    e = g.eqns[u]
    n = G.name(e)
    if n == "clamp" and e.invars[1] is q:
        lo, hi = (G.scalar_constant(g, e.invars[0]), G.scalar_constant(g, e.invars[2]))
        if lo == -FP8_MAX and hi == FP8_MAX:
            return e.outvars[0], {u}
        return None
    if n in ("max", "min"):
        c1 = G.scalar_constant(g, G.other_operand(e, q))
        v1 = e.outvars[0]
        u2 = g.only_user(v1)
        if u2 is None or G.name(g.eqns[u2]) not in ("max", "min") or G.name(g.eqns[u2]) == n:
            return None
        c2 = G.scalar_constant(g, G.other_operand(g.eqns[u2], v1))
        lo, hi = (c1, c2) if n == "max" else (c2, c1)
        if lo == -FP8_MAX and hi == FP8_MAX:
            return g.eqns[u2].outvars[0], {u, u2}
    return None


def drop_tail(proof: NormProof, note: str) -> None:
    """Leaves a proven FP8 tail in the program (the norm alone is fused)."""
    if proof.quant_var is not None:
        proof.quant_var = proof.scale_out_var = proof.scale = None
        proof.pattern = 1
        proof.tail_eqns = ()
        proof.tail_note = note


def _match_fp8_tail(prover: _Prover, proof: NormProof):
    """Extends a proven norm with its FP8 tail when there is one: static
    ``clip(float(y) / scale, -448, 448) -> e4m3`` (patterns 2/4) or dynamic per token
    ``s = max(max|float(y)| / 448, 2^-9/448); clip(float(y) / s) -> e4m3`` (10/11). A tail
    that differs (another amax axis, another minimum) is left in the program with a note."""
    from ..common.patterns import AllReduceFusionPattern as Pattern

    g = prover.g
    y = proof.out_var
    T = prover.T
    if T == "float32" or proof.out_dtype != T:
        return
    casts = [
        u for u in g.users(y) if G.name(g.eqns[u]) == G.CAST and _cast_dtype(g.eqns[u]) == "float32"
    ]
    if len(casts) != 1:
        return
    y32 = g.eqns[casts[0]].outvars[0]
    y32, views = _follow(g, y32, G.NO_OPS)
    divs = [u for u in g.users(y32) if G.name(g.eqns[u]) == "div" and g.eqns[u].invars[0] is y32]
    absu = [u for u in g.users(y32) if G.name(g.eqns[u]) == "abs"]
    if len(divs) != 1:
        return
    tail = {casts[0], divs[0]} | views
    d = g.eqns[divs[0]]
    scale = d.invars[1]
    dyn = None
    if absu:
        if len(absu) != 1:
            proof.tail_note = "FP8 tail not fused: two amax of the norm output"
            return
        v = g.eqns[absu[0]].outvars[0]
        chain = {absu[0]}
        u = g.only_user(v)
        if u is None or G.name(g.eqns[u]) != "reduce_max":
            return
        axes = tuple(int(a) % (prover.m + 1) for a in g.eqns[u].params["axes"])
        if axes != (prover.m,):
            kind = (
                "a per-tensor scale"
                if len(axes) == prover.m + 1
                else "a per-channel scale"
                if prover.m not in axes
                else "not per token"
            )
            proof.tail_note = (
                f"FP8 tail not fused: its amax reduces axes {axes} ({kind}); "
                "the fused op scales per token (the last axis)"
            )
            return
        chain.add(u)
        v = g.eqns[u].outvars[0]
        v, more = _follow(g, v, ("broadcast_in_dim", "reshape", "expand_dims") + G.NO_OPS)
        for j in more:
            e = g.eqns[j]
            if G.name(e) == "broadcast_in_dim" and any(
                s != 1 and dst != k
                for k, (s, dst) in enumerate(
                    zip(G.shape(e.invars[0]), e.params["broadcast_dimensions"])
                )
            ):
                proof.tail_note = (
                    "FP8 tail not fused: its per-token scale is broadcast along another axis"
                )
                return
        chain |= more
        u = g.only_user(v)
        if (
            u is None
            or G.name(g.eqns[u]) != "div"
            or G.scalar_constant(g, g.eqns[u].invars[1]) != FP8_MAX
        ):
            proof.tail_note = "FP8 tail not fused: its scale is not amax / 448"
            return
        chain.add(u)
        v = g.eqns[u].outvars[0]
        u = g.only_user(v)
        if u is None or G.name(g.eqns[u]) != "max":
            proof.tail_note = "FP8 tail not fused: its scale has no minimum of 2^-9 / 448"
            return
        lo = G.scalar_constant(g, G.other_operand(g.eqns[u], v))
        if lo is None or not math.isclose(lo, FP8_MIN_SCALE, rel_tol=1e-6):
            proof.tail_note = (
                "FP8 tail not fused: its scale's minimum is not 2^-9 / 448 (the fused op's)"
            )
            return
        chain.add(u)
        dyn = g.eqns[u].outvars[0]
        dyn_b, more = _follow(g, dyn, ("broadcast_in_dim",) + G.NO_OPS)
        if scale is not dyn and scale is not dyn_b:
            return
        chain |= more
        if math.prod(G.shape(dyn)) != math.prod(prover.shape[:-1]):
            proof.tail_note = "FP8 tail not fused: its scale is not one value per token"
            return
        tail |= chain
    else:
        if not G.is_var(scale) and not isinstance(scale, jcore.Literal):
            return
        if math.prod(G.shape(scale)) != 1 or G.dtype(scale) != "float32":
            return
        if G.is_var(scale) and scale in prover.tainted:
            return
    q = d.outvars[0]
    clipped = _clip(g, q)
    if clipped is None:
        proof.tail_note = "FP8 tail not fused: the quotient is not clipped to [-448, 448]"
        return
    q, clip_eqns = clipped
    tail |= clip_eqns
    u = g.only_user(q)
    if u is None or G.name(g.eqns[u]) != G.CAST or _cast_dtype(g.eqns[u]) != "float8_e4m3fn":
        proof.tail_note = "FP8 tail not fused: the result is not cast to float8_e4m3fn"
        return
    tail.add(u)
    proof.quant_var = g.eqns[u].outvars[0]
    norm_used = y in g.outs or any(x not in tail for x in g.users(y))
    if dyn is not None:
        proof.scale_out_var = dyn
        proof.pattern = int(
            Pattern.kARResidualRMSNormOutDynamicFP8Quant
            if norm_used
            else Pattern.kARResidualRMSNormDynamicFP8Quant
        )
    else:
        proof.scale = scale
        proof.pattern = int(
            Pattern.kARResidualRMSNormOutFP8Quant
            if norm_used
            else Pattern.kARResidualRMSNormFP8Quant
        )
    outs = [proof.quant_var] + ([dyn] if dyn is not None else [])
    stop = {prover.r, y} | (
        {proof.scale} if proof.scale is not None and G.is_var(proof.scale) else set()
    )
    tail_eqns = backward_slice(g, outs, stop)
    proof.eqns |= tail_eqns
    proof.tail_eqns = tuple(g.eqns[i] for i in sorted(tail_eqns))
