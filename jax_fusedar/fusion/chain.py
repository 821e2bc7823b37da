"""Checkpointed layers called one after another (MaxText's ``scan_layers=False``, a Python
loop over ``jax.checkpoint``'d or ``nn.remat``'d layers): the residual add that closes layer
i's call and the norm that opens layer i + 1's are one site, in no one scope.

Each call is rotated as a scan's iteration is (fusion/rotation.py), one call at a time: its
body takes the norm of its input (``h``) as one more input instead of computing it, and
computes the next norm of its output at its end, with the next call's gamma (or the final
norm after the last call, the equations as the program writes them). The first call's norm
is computed before it. Where the program computes the next gamma after the call (a slice of
stacked gammas before each layer's call), the rewritten call stands after that gamma. Each
rewritten call keeps the original call's derivative: a ``custom_jvp`` whose tangent is the
call as written (its checkpoint, ``jax.checkpoint``'s default policy only) followed by the
next norm, under one checkpoint, at the same inputs. So the program saves for its backward
pass what the original saves (the calls' inputs) and recomputes what it recomputes, and its
gradients are the original's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
from jax.extend import core as jcore

from . import graph as G
from . import norm_proof, validation
from .report import Reject
from .rotation import add_at_end, bind, dce, self_contained

CHECKPOINTS = ("remat2", "checkpoint")


@dataclasses.dataclass
class Norm:
    """A norm the chain moves: its proof in ``graph``, the var it normalizes there, and where
    its gamma's root comes from in the outer scope (an atom)."""

    graph: Any
    proof: Any
    x: Any
    outer_gamma: Any = None


@dataclasses.dataclass
class Link:
    """One call of the chain: eqn index ``i``; ``head``: the norm at its body's start that
    it takes as an input (None: it computes it, the first call); ``tail``: the norm of its
    output ``out`` (index among the call's outputs) it computes at its end (None: the last
    call without a final norm); ``final``: the outer norm ``tail`` is, if any; ``at``: the
    eqn index before which its rewritten call is emitted (``_emitted_at``)."""

    i: int
    head: Optional[Norm]
    tail: Optional[Norm]
    at: int = -1
    out: Optional[int] = None
    final: Any = None  # NormProof in the outer graph
    view: Any = None
    plan: Any = None
    h_in: Any = None  # outer vars carrying h between the calls
    h_out: Any = None


def call_body(eqn):
    return G.open_jaxpr(eqn.params["jaxpr"])


def _checkpoint(eqn) -> bool:
    return (
        G.name(eqn) in CHECKPOINTS
        and eqn.params.get("policy") is None
        and not getattr(eqn.params["jaxpr"], "consts", ())
    )


def _body_graph(eqn, graphs: dict):
    """(body, its Graph) of a call, the Graph built once per body (``graphs``)."""
    body = call_body(eqn)
    if id(body) not in graphs:
        graphs[id(body)] = G.Graph(body)
    return body, graphs[id(body)]


def _head_norm(eqn, k_in: int, allow, graphs: dict) -> Optional[Norm]:
    """The norm of the call's input ``k_in`` at the start of its body, reading only that
    input, gamma (another input) and literals, or None."""
    body, bg = _body_graph(eqn, graphs)
    x = body.invars[k_in]
    if G.dtype(x) not in G.FLOATS or not G.shape(x) or not G.shape(x)[-1]:
        return None
    try:
        proof = norm_proof.prove_rms_norm(bg, x, allow)
    except Reject:
        return None
    if proof.quant_var is not None or proof.bias is not None or proof.out_var in body.outvars:
        return None
    outer_gamma = None
    if proof.gamma is not None:
        if not G.is_var(proof.gamma) or proof.gamma not in body.invars:
            return None
        outer_gamma = eqn.invars[body.invars.index(proof.gamma)]
    if not self_contained(bg, proof, x):
        return None
    return Norm(bg, proof, x, outer_gamma)


def _emitted_at(g: G.Graph, i: int, gamma) -> Optional[int]:
    """Where the rewritten call of eqn ``i`` can stand, reading the next norm's ``gamma``:
    at the call, or, when the program computes that gamma after the call (a slice of
    stacked gammas before the next layer's call), after it, provided no equation between
    reads the call's outputs; None where it cannot."""
    at = g.defs.get(gamma, -1) + 1 if G.is_var(gamma) else 0
    if at <= i:
        return i
    outs = set(v for v in g.eqns[i].outvars if not isinstance(v, jcore.DropVar))
    if any(G.is_var(a) and a in outs for k in range(i + 1, at) for a in g.eqns[k].invars):
        return None
    return at


# Why a call's last site stays unfused when the next norm is found but the rewritten call
# cannot stand where that norm's gamma exists (``_emitted_at`` is None).
GAMMA_AFTER_USE = (
    "the next RMSNorm is in the next checkpoint call (or after this one), but its gamma is "
    "computed after an equation that reads this call's outputs, so the call cannot be "
    "rewritten to compute that norm: compute gamma before the call (e.g. slice the stacked "
    "gammas first)"
)


def find_chains(g: G.Graph, allow: bool, stranded: Optional[dict] = None) -> list:
    """Chains of checkpoint calls in one scope where a call's output, an add at the end of
    its body, is the next call's input normalized first (or is normalized after the last
    call): lists of Links, two calls at least (or one with a final norm). ``stranded``
    (if given) gets {id of a body eqn: reason} for the sums added at the end of the calls
    in no chain whose next norm was found but could not be joined (``GAMMA_AFTER_USE``):
    the reason their sites report."""
    chains = []
    used = set()
    graphs = {}  # id(body) -> its Graph: a call's body is read as the next and as the current
    for i, e in enumerate(g.eqns):
        if i in used or not _checkpoint(e):
            continue
        links = [Link(i, None, None, at=i)]
        while True:
            cur = links[-1]
            ce = g.eqns[cur.i]
            body, bg = _body_graph(ce, graphs)
            nxt, unjoined = None, []
            for o, y in enumerate(ce.outvars):
                if isinstance(y, jcore.DropVar) or not add_at_end(bg, body.outvars[o]):
                    continue
                users = g.users(y)
                if len(users) == 1 and _checkpoint(g.eqns[users[0]]) and y not in g.outs:
                    j = users[0]
                    ks = [k for k, a in enumerate(g.eqns[j].invars) if a is y]
                    head = _head_norm(g.eqns[j], ks[0], allow, graphs) if len(ks) == 1 else None
                    at = None if head is None else _emitted_at(g, cur.i, head.outer_gamma)
                    if at is not None:
                        cur.at = at
                        nxt = (o, Link(j, head, None, at=j))
                        break
                    if head is not None:
                        unjoined.append(body.outvars[o])
                final = _final_norm(g, y, allow)
                at = None if final is None else _emitted_at(g, cur.i, final.gamma)
                if final is not None and at is None:
                    unjoined.append(body.outvars[o])
                if at is not None:
                    cur.out, cur.final, cur.at = o, final, at
                    cur.tail = Norm(g, final, y, final.gamma)
                    break
            if nxt is None:
                break
            o, link = nxt
            cur.out, cur.tail = o, link.head
            links.append(link)
        if len(links) > 1 or links[0].final is not None:
            used.update(link.i for link in links)
            chains.append(links)
        elif stranded is not None:
            for v in unjoined:
                stranded.update((id(e), GAMMA_AFTER_USE) for e in _summands(bg, v))
    return chains


def _summands(bg: G.Graph, v) -> list:
    """The eqns whose results the add computing ``v`` (through value-preserving eqns)
    adds: a site's reduction among them."""
    e = bg.producer(v)
    if e is None or G.name(e) != "add":
        return []
    return [d for d in map(bg.producer, e.invars) if d is not None]


def _final_norm(g: G.Graph, y, allow):
    try:
        proof = norm_proof.prove_rms_norm(g, y, allow)
    except Reject:
        return None
    if proof.quant_var is not None or proof.bias is not None:
        return None
    if proof.gamma is not None and not G.is_var(proof.gamma):
        return None
    if not self_contained(g, proof, y):
        return None
    return proof


def build_view(g: G.Graph, link: Link):
    """The call's body rewritten: the head norm's output an extra input (h), the tail norm
    of output ``out`` computed at its end (gamma an extra input), h out an extra output."""
    e = g.eqns[link.i]
    body = call_body(e)
    invars, outvars, eqns = list(body.invars), list(body.outvars), list(body.eqns)
    if link.head is not None:
        y = link.head.proof.out_var
        link.h_in = jcore.Var(y.aval)
        eqns = [
            q.replace(invars=[link.h_in if a is y else a for a in q.invars])
            for k, q in enumerate(eqns)
            if y not in q.outvars
        ]
        outvars = [link.h_in if a is y else a for a in outvars]
        eqns = dce(eqns, outvars)
        invars.append(link.h_in)
    if link.tail is not None:
        t = link.tail
        names = {t.x: body.outvars[link.out]}
        g_next = None
        if t.proof.gamma is not None:
            g_next = jcore.Var(t.proof.gamma.aval)
            names[t.proof.gamma] = g_next
            invars.append(g_next)
        for k in sorted(t.proof.eqns):
            q = t.graph.eqns[k]
            for v in q.outvars:
                names[v] = jcore.Var(v.aval)
            eqns.append(
                q.replace(
                    invars=[names.get(a, a) if G.is_var(a) else a for a in q.invars],
                    outvars=[names[v] for v in q.outvars],
                )
            )
        link.h_out = names[t.proof.out_var]
        outvars.append(link.h_out)
    link.view = body.replace(invars=invars, outvars=outvars, eqns=eqns)
    return link.view


def same_norms(a: Norm, b: Norm) -> bool:
    return validation.signature(
        a.graph, a.proof.eqns, [("r", a.x), ("gamma", a.proof.gamma)]
    ) == validation.signature(b.graph, b.proof.eqns, [("r", b.x), ("gamma", b.proof.gamma)])


class ChainCallEmit:
    """One rewritten call of a chain: its head norm (computed before it for the first call),
    its rotated body evaluated with its plan, the original call's derivative."""

    def __init__(self, g, link: Link, h_var, next_i=None):
        self.g, self.link, self.h_var, self.next_i = g, link, h_var, next_i

    def __call__(self, read, write, fuser, extra_in, extra_out):
        from jax.extend.core import jaxpr_as_fun

        from .rewriting import evaluate

        link, g = self.link, self.g
        e = g.eqns[link.i]
        args = [read(a) for a in e.invars]
        extra = []
        if link.head is not None:  # computed by the previous call of the chain
            extra.append(read_h(self.h_var, link.i))
        g_next = None
        if link.tail is not None and link.tail.proof.gamma is not None:
            g_next = read(link.tail.outer_gamma)
            extra.append(g_next)
        closed = e.params["jaxpr"]
        consts = getattr(closed, "consts", ())
        n_args = len(args)
        view, plan, tail = link.view, link.plan, link.tail
        original = jax.checkpoint(
            jaxpr_as_fun(closed if isinstance(closed, jcore.ClosedJaxpr) else _closed(closed)),
            prevent_cse=bool(e.params.get("prevent_cse", True)),
        )

        def next_norm(y, gn):
            env = {tail.x: y}
            if tail.proof.gamma is not None:
                env[tail.proof.gamma] = gn
            bind([tail.graph.eqns[k] for k in sorted(tail.proof.eqns)], env)
            return env[tail.proof.out_var]

        # The next call's norm was inside that call's checkpoint (recomputed); a final norm
        # after the calls was not (its intermediates saved): each as written.
        if tail is not None and link.final is None:
            next_norm = jax.checkpoint(next_norm)

        def written(a, gn):
            outs = original(*a)
            return outs, (None if tail is None else next_norm(outs[link.out], gn))

        @jax.custom_jvp
        def call(*flat):
            return tuple(evaluate(view, consts, list(flat), plan, fuser))

        @call.defjvp
        def call_jvp(primals, tangents):
            out = call(*primals)
            a, da = list(primals[:n_args]), list(tangents[:n_args])
            gn = primals[-1] if g_next is not None else None
            dgn = tangents[-1] if g_next is not None else None
            (outs, _), (douts, dh) = jax.jvp(written, (a, gn), (da, dgn))
            return out, (*douts, *([dh] if tail is not None else []))

        outs = call(*args, *extra)
        for v, val in zip(e.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                write(v, val)
        if tail is not None:
            h = outs[len(e.outvars)]
            if link.final is not None:
                write(link.final.out_var, h)
            else:
                self.h_var[self.next_i] = h


def read_h(h_var, i):
    return h_var[i]


def _closed(jaxpr):
    return jcore.ClosedJaxpr(jaxpr, ())
