"""Loop rotation: the residual add at the end of one ``scan`` iteration and the norm at the
start of the next one become one site.

A pre-norm decoder scanned over its layers computes, in each iteration, ``h = norm(x)`` of
the carry first and ``x + f(...)`` last: the add of layer i and the norm of layer i + 1
are in different iterations, so no scope holds both. Rotating the loop moves the norm: the
body takes ``h`` as one more carry and computes the next layer's norm of its carry out at
its end (the norm's equations copied, gamma read from the next iteration's slice of the
stacked weights); the first ``h`` is computed before the loop (the norm peeled). The site
is then in one scope and is matched like any other. When the program normalizes the loop's
result after it with the same equations (the final norm of a decoder, its own gamma),
that norm is the last iteration's: gamma's stack is shifted by one with the final gamma
last. Otherwise the last iteration's norm is computed for nothing (the program's own norm
after the loop, if any, stays). Values are unchanged: the same equations on the same
values, in another iteration.

``rotation_candidate`` finds the carry to rotate and builds the rotated body
(``Rotation.view``); the analyzer plans it, keeps it only when more sites fuse than in the
body as written, and emits ``RotatedScanEmit`` for the scan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from . import graph as G
from . import jax_internals, norm_proof, validation
from .report import Reject


@dataclasses.dataclass
class Rotation:
    """A scan whose carry ``carry`` is normalized at the start of the body (``proof``, in
    the body's graph) and produced by a residual add at its end."""

    carry: int
    proof: Any  # norm_proof.NormProof of the carry in, in the body
    x_in: Any
    gamma_xs: Optional[int]  # index among the scan's xs of gamma's stack (None: a const)
    view: Any  # the rotated body (Jaxpr): consts, carry + [h], xs + [next gamma]
    bg: Any  # the body's graph (the proof's eqn indices)
    final: Any = None  # (NormProof in the outer graph) the loop result's norm it replaces
    # The body is one checkpoint call (its default policy), opened for the view: the
    # rotated body then keeps the original's derivative (RotatedScanEmit).
    checkpointed: bool = False


def add_at_end(bg: G.Graph, v) -> bool:
    """Whether ``v`` is computed by an ``add`` (through value-preserving eqns)."""
    e = bg.producer(v)
    return e is not None and G.name(e) == "add"


def self_contained(bg: G.Graph, proof, x_in) -> bool:
    """The norm's equations read only the carry, gamma's root, literals and each other."""
    defined = {v for i in proof.eqns for v in bg.eqns[i].outvars}
    for i in proof.eqns:
        e = bg.eqns[i]
        if G.has_subjaxpr(e):
            return False
        for a in e.invars:
            if G.is_var(a) and a not in defined and a is not x_in and a is not proof.gamma:
                return False
    return True


def _inline_call(body, k):
    """``body`` with its call eqn ``k`` (a checkpoint) replaced by the call's eqns (outputs
    that pass an input through read that input), or None."""
    e = body.eqns[k]
    sub = e.params.get(G.CALLS[G.name(e)])
    inner = G.open_jaxpr(sub)
    if getattr(sub, "consts", ()) or inner.constvars or len(inner.invars) != len(e.invars):
        return None
    m = dict(zip(inner.invars, e.invars))
    rename = {}
    for iv, ov in zip(inner.outvars, e.outvars):
        if isinstance(ov, jcore.DropVar):
            continue
        if not G.is_var(iv) or iv in m:
            rename[ov] = m.get(iv, iv)
        else:
            m[iv] = ov
    for iv in {v for ie in inner.eqns for v in ie.outvars} - set(m):
        m[iv] = iv

    def sub_in(a):
        return m.get(a, a) if G.is_var(a) else a

    def sub_out(a):
        return rename.get(a, a) if G.is_var(a) else a

    spliced = [
        ie.replace(invars=[sub_in(a) for a in ie.invars], outvars=[m[v] for v in ie.outvars])
        for ie in inner.eqns
    ]
    after = [oe.replace(invars=[sub_out(a) for a in oe.invars]) for oe in body.eqns[k + 1 :]]
    return body.replace(
        eqns=list(body.eqns[:k]) + spliced + after,
        outvars=[sub_out(a) for a in body.outvars],
    )


def _checkpoint_body(body, nc, nk):
    """The body opened, when it is one checkpoint call (``jax.checkpoint``'s default
    policy, nothing saved but its inputs, as MaxText's and Flax's ``remat`` of a layer) that
    reads the carries and computes them; else None."""
    calls = [k for k, e in enumerate(body.eqns) if G.name(e) in ("remat2", "checkpoint")]
    if len(calls) != 1 or body.eqns[calls[0]].params.get("policy") is not None:
        return None
    e = body.eqns[calls[0]]
    carries_in = body.invars[nc : nc + nk]
    if not any(v in e.invars for v in carries_in):
        return None
    if not any(G.is_var(v) and v in e.outvars for v in body.outvars[:nk]):
        return None
    return _inline_call(body, calls[0])


def rotation_candidate(scan_eqn, allow: bool) -> Optional[Rotation]:
    """The rotation of a forward scan, or None when no carry is normalized at the start of
    the body and added to at its end (or the norm reads anything but the carry, gamma's
    root (a loop constant or a slice of the stacked weights) and literals). A body that is
    one checkpoint call is looked into."""
    p = scan_eqn.params
    if p.get("reverse") or p.get("length", 0) < 1:
        return None
    body = G.open_jaxpr(p["jaxpr"])
    nc, nk = jax_internals.scan_layout(scan_eqn)
    rot = _candidate(body, nc, nk, allow)
    if rot is None:
        opened = _checkpoint_body(body, nc, nk)
        rot = None if opened is None else _candidate(opened, nc, nk, allow)
        if rot is not None:
            rot.checkpointed = True
    return rot


def _candidate(body, nc, nk, allow) -> Optional[Rotation]:
    bg = G.Graph(body)
    for c in range(nk):
        x_in, x_out = body.invars[nc + c], body.outvars[c]
        if G.dtype(x_in) not in G.FLOATS or not G.shape(x_in) or not G.shape(x_in)[-1]:
            continue
        if not G.is_var(x_out) or not add_at_end(bg, x_out):
            continue
        if not any(True for _ in bg.users(x_in)):
            continue
        try:
            proof = norm_proof.prove_rms_norm(bg, x_in, allow)
        except Reject:
            continue
        if proof.quant_var is not None or proof.out_var in body.outvars:
            continue
        gamma_xs = None
        if proof.gamma is not None:
            if not G.is_var(proof.gamma) or proof.gamma not in body.invars:
                continue
            k = body.invars.index(proof.gamma)
            if nc <= k < nc + nk:
                continue  # gamma carried: not a weight
            gamma_xs = k - nc - nk if k >= nc + nk else None
        if not self_contained(bg, proof, x_in):
            continue
        view = _rotated(body, bg, nc, nk, proof, x_in, x_out)
        return Rotation(c, proof, x_in, gamma_xs, view, bg)
    return None


def _rotated(body, bg, nc, nk, proof, x_in, x_out):
    """The body with the norm of its carry in taken as one more carry (``h``), and the same
    norm of its carry out computed at the end (gamma: the next iteration's, one more xs)."""
    y = proof.out_var
    h_in = jcore.Var(y.aval)
    g_next = None
    if proof.gamma is not None and body.invars.index(proof.gamma) >= nc + nk:
        g_next = jcore.Var(proof.gamma.aval)

    def sub(a):
        return h_in if a is y else a

    kept = [
        e.replace(invars=[sub(a) if G.is_var(a) else a for a in e.invars])
        for i, e in enumerate(bg.eqns)
        if i not in proof.eqns or y not in bg.eqns[i].outvars
    ]
    outvars = [sub(a) if G.is_var(a) else a for a in body.outvars]
    kept = dce(kept, outvars)
    # The norm once more, of the carry out, with the next iteration's gamma.
    names = {x_in: x_out}
    if g_next is not None:
        names[proof.gamma] = g_next
    copies = []
    for i in sorted(proof.eqns):
        e = bg.eqns[i]
        for v in e.outvars:
            names[v] = jcore.Var(v.aval)
        copies.append(
            e.replace(
                invars=[names.get(a, a) if G.is_var(a) else a for a in e.invars],
                outvars=[names[v] for v in e.outvars],
            )
        )
    h_out = names[y]
    invars = list(body.invars)
    invars.insert(nc + nk, h_in)
    if g_next is not None:
        invars.append(g_next)
    outs = outvars[:nk] + [h_out] + outvars[nk:]
    return body.replace(invars=invars, outvars=outs, eqns=kept + copies)


def dce(eqns, outvars):
    """``eqns`` without those whose results nothing reads (effect-free ones only)."""
    live = {a for a in outvars if G.is_var(a)}
    out = []
    for e in reversed(eqns):
        if e.effects or any(G.is_var(v) and v in live for v in e.outvars):
            out.append(e)
            live.update(a for a in e.invars if G.is_var(a))
    return out[::-1]


def final_norm(g: G.Graph, scan_i: int, rot: Rotation, allow: bool):
    """The outer norm of the loop's result that is the rotated norm: the same equations, with
    its own gamma of the stack's slice type (or, like the rotated norm, none: MaxText's and
    Hugging Face's gamma multiplied after the rounding stays after both), or None. A loop
    constant gamma is not shifted: its final norm is not merged."""
    if rot.proof.gamma is not None and rot.gamma_xs is None:
        return None
    y = g.eqns[scan_i].outvars[rot.carry]
    try:
        outer = norm_proof.prove_rms_norm(g, y, allow)
    except Reject:
        return None
    if outer.quant_var is not None or (outer.gamma is None) != (rot.proof.gamma is None):
        return None
    if outer.gamma is not None and (
        not G.is_var(outer.gamma)
        or outer.gamma.aval.shape != rot.proof.gamma.aval.shape
        or outer.gamma.aval.dtype != rot.proof.gamma.aval.dtype
        or g.defs.get(outer.gamma, -1) > scan_i
    ):
        return None
    same = validation.signature(
        g, outer.eqns, [("r", y), ("gamma", outer.gamma)]
    ) == validation.signature(rot.bg, rot.proof.eqns, [("r", rot.x_in), ("gamma", rot.proof.gamma)])
    return outer if same else None


def bind(eqns, env):
    from .rewriting import bind_all

    bind_all(eqns, env)


class RotatedScanEmit:
    """The scan again, rotated: the first norm computed before it, the body evaluated as
    its rotated view (with its plan: the sites it now holds fused), gamma's stack shifted
    by one; the loop's outputs written, and the outer final norm's output when it is the
    last iteration's."""

    def __init__(self, eqn, rot: Rotation, plan):
        self.eqn, self.bg, self.rot, self.plan = eqn, rot.bg, rot, plan

    def __call__(self, read, write, fuser, extra_in, extra_out):
        from .rewriting import evaluate, needed_inputs

        e, rot = self.eqn, self.rot
        p = e.params
        nc, nk = jax_internals.scan_layout(e)
        ins = [read(a) for a in e.invars]
        consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        proof = rot.proof
        body = G.open_jaxpr(p["jaxpr"])
        env = {rot.x_in: init[rot.carry]}
        next_gamma = []
        if proof.gamma is not None:
            k = body.invars.index(proof.gamma)
            if rot.gamma_xs is None:
                env[proof.gamma] = ins[k]
            else:
                stack = xs[rot.gamma_xs]
                env[proof.gamma] = stack[0]
                last = read(rot.final.gamma) if rot.final is not None else stack[0]
                next_gamma = [jnp.concatenate([stack[1:], last[None].astype(stack.dtype)])]
        bind([self.bg.eqns[i] for i in sorted(proof.eqns)], env)
        h0 = env[proof.out_var]
        view_consts = getattr(p["jaxpr"], "consts", ())
        view = self.rot.view
        all_xs = [*xs, *next_gamma]
        # The new loop takes only the scanned inputs its iteration reads, and returns as
        # outputs only what it computes: a scanned input the body returns as is (a model's
        # random keys passed through) is the stacked input itself. The rotated body is
        # evaluated again, and where it sits in a custom_jvp (checkpointed) JAX could no
        # longer drop what only dead code reads, as it does for the loop as written.
        n_lead = nc + nk + 1
        xs_vars, ys_vars = view.invars[n_lead:], view.outvars[nk + 1 :]
        through = {k: xs_vars.index(v) for k, v in enumerate(ys_vars) if v in xs_vars}
        own_ys = [k for k in range(len(ys_vars)) if k not in through]
        needed = needed_inputs(
            view, self.plan, [*view.outvars[: nk + 1], *(ys_vars[k] for k in own_ys)]
        )
        keep = [j for j, v in enumerate(xs_vars) if v in needed]
        original = None
        if rot.checkpointed:
            body = jax_internals.closed_body(p["jaxpr"])
            n_ys = len(body.jaxpr.outvars) - nk
            dced, used = jax_internals.dead_code_eliminated(
                body.jaxpr, [True] * nk + [k not in through for k in range(n_ys)]
            )
            original = (jcore.ClosedJaxpr(dced, body.consts), used)
            # what the body as written reads too, and the shifted gamma (its next norm's)
            read = (j for j in range(len(xs)) if used[nc + nk + j])
            keep = sorted({*keep, *read, *range(len(xs), len(all_xs))})

        def expand(kept):
            full = [None] * len(all_xs)
            for j, v in zip(keep, kept):
                full[j] = v
            return full

        def run(consts_, carry, x):
            outs = evaluate(view, view_consts, [*consts_, *carry, *x], self.plan, fuser)
            return tuple(outs[: nk + 1]), tuple(outs[nk + 1 + k] for k in own_ys)

        def step(carry, x):
            return run(consts, carry, expand(x))

        if rot.checkpointed:
            step = self._with_original_derivative(
                run, original, consts, nk, bool(next_gamma), expand
            )
        carry, ys = jax.lax.scan(
            step,
            (*init, h0),
            tuple(all_xs[j] for j in keep),
            length=p["length"],
            unroll=p.get("unroll", 1),
        )
        own = iter(ys)
        ys = [all_xs[through[k]] if k in through else next(own) for k in range(len(ys_vars))]
        outs = list(carry[:nk]) + ys
        for v, val in zip(e.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                write(v, val)
        if rot.final is not None:
            write(rot.final.out_var, carry[nk])

    def _with_original_derivative(self, run, original, consts, nk, shifted, expand):
        """``run`` (the rotated, fused iteration) with the derivative of the iteration as
        written: the original body (its checkpoint call and policy) and the next layer's
        norm of its carry out, under one checkpoint, linearized at the same inputs. Under
        differentiation the iteration then saves what the original saves (its inputs) and
        recomputes what it recomputes, and gradients are the original's; the rotated
        carry ``h`` gets no cotangent (its value is the next iteration's own norm).
        ``original``: (the body as written without its dead code, the inputs it reads);
        ``expand``: the loop's scanned inputs, those it does not read as None."""
        from jax.extend.core import jaxpr_as_fun

        rot, bg = self.rot, self.bg
        proof = rot.proof
        body, used = original
        body = jaxpr_as_fun(body)
        n_const = len(consts)
        c = rot.carry

        @jax.checkpoint
        def written(args, g_next):
            outs = body(*(a for a, u in zip(args, used) if u))
            env = {rot.x_in: outs[c]}
            if proof.gamma is not None:
                env[proof.gamma] = g_next if shifted else args[bg.jaxpr.invars.index(proof.gamma)]
            bind([bg.eqns[i] for i in sorted(proof.eqns)], env)
            return outs, env[proof.out_var]

        def split(flat):
            consts_, carry, xs = (
                flat[:n_const],
                flat[n_const : n_const + nk + 1],
                expand(flat[n_const + nk + 1 :]),
            )
            g_next = xs[-1] if shifted else None
            xs = xs[:-1] if shifted else xs
            return [*consts_, *carry[:nk], *xs], g_next

        @jax.custom_jvp
        def fused(*flat):
            carry, xs = flat[n_const : n_const + nk + 1], expand(flat[n_const + nk + 1 :])
            new_carry, ys = run(flat[:n_const], carry, xs)
            return (*new_carry, *ys)

        @fused.defjvp
        def fused_jvp(primals, tangents):
            out = fused(*primals)
            args, g = split(primals)
            dargs, dg = split(tangents)
            (outs, h), (douts, dh) = jax.jvp(written, (args, g), (dargs, dg))
            dout = (*douts[:nk], dh, *douts[nk:])
            return out, tuple(dout)

        def wrapped(carry, xs):
            out = fused(*consts, *carry, *xs)
            return tuple(out[: nk + 1]), tuple(out[nk + 1 :])

        return wrapped
