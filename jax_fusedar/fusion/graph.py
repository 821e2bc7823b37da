"""Use-def information of a jaxpr and the small queries the matchers share."""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import numpy as np
from jax.extend import core as jcore

FLOATS = ("bfloat16", "float16", "float32")
CAST = "convert_element_type"
# Value-preserving: they change only the varying-axes type (check_vma), the placement
# (sharding constraints, Flax's logical constraints, reshard), or name the value for remat
# policies (checkpoint_name). The pass looks through them; those on values the rewrite keeps
# stay in the program around the fused call.
NO_OPS = (
    "pvary",
    "pcast",
    "copy",
    "copy_p",
    "sharding_constraint",
    "reshard",
    "mesh_cast",
    "name",
)
CHECKPOINT_NAME = "name"
PSUMS = ("psum", "psum_invariant")
# Call-like primitives and the parameter holding their jaxpr.
CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}
CUSTOM_RULE_CALLS = ("custom_jvp_call", "custom_vjp_call")


def name(eqn) -> str:
    return eqn.primitive.name


def dtype(atom) -> str:
    return np.dtype(atom.aval.dtype).name


def shape(atom) -> tuple:
    return tuple(atom.aval.shape)


def is_var(atom) -> bool:
    return isinstance(atom, jcore.Var) and not isinstance(atom, jcore.DropVar)


def has_subjaxpr(eqn) -> bool:
    """Whether one of the eqn's params is a jaxpr (or a sequence of them)."""
    for v in eqn.params.values():
        items = v if isinstance(v, (tuple, list)) else (v,)
        if any(isinstance(b, (jcore.Jaxpr, jcore.ClosedJaxpr)) for b in items):
            return True
    return False


def open_jaxpr(j):
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


class Graph:
    """Use-def information of one jaxpr."""

    def __init__(self, jaxpr):
        self.jaxpr = jaxpr
        self.eqns = jaxpr.eqns
        self.defs = {}
        self.uses = defaultdict(list)
        for i, e in enumerate(self.eqns):
            for v in e.invars:
                if isinstance(v, jcore.Var):
                    self.uses[v].append(i)
            for v in e.outvars:
                self.defs[v] = i
        self.outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}

    def eqn(self, v):
        i = self.defs.get(v) if isinstance(v, jcore.Var) else None
        return (i, self.eqns[i]) if i is not None else (None, None)

    def producer(self, v):
        """The eqn computing ``v``, looking through value-preserving eqns (``NO_OPS``);
        None for an input of the jaxpr or a literal."""
        while True:
            _, e = self.eqn(v)
            if e is None or name(e) not in NO_OPS or len(e.invars) != 1:
                return e
            v = e.invars[0]

    def users(self, v):
        return sorted(set(self.uses.get(v, ())))

    def only_user(self, v) -> Optional[int]:
        """The one eqn using ``v`` when nothing else (not even the jaxpr's outputs) does."""
        us = self.users(v)
        if len(us) != 1 or v in self.outs:
            return None
        return us[0]

    def used_outside(self, v, inside: set) -> bool:
        return v in self.outs or any(u not in inside for u in self.users(v))


def scalar_constant(g: Graph, atom, chain: Optional[set] = None):
    """The Python value of ``atom`` when it is a constant with one value everywhere (a
    literal, possibly through pvary, casts, broadcasts and reshapes, whose eqns are added to
    ``chain``), else None."""
    seen = []
    while True:
        if isinstance(atom, jcore.Literal):
            val = np.asarray(atom.val)
            if val.size < 1 or not np.all(val == val.reshape(-1)[0]):
                return None
            if chain is not None:
                chain.update(seen)
            return float(val.reshape(-1)[0])
        i, e = g.eqn(atom)
        if e is None or len(e.invars) != 1:
            return None
        if name(e) not in NO_OPS + (CAST, "broadcast_in_dim", "reshape", "squeeze", "expand_dims"):
            return None
        seen.append(i)
        atom = e.invars[0]


def other_operand(eqn, v):
    """The operand of a binary eqn that is not ``v`` (None when both or neither are)."""
    a, b = eqn.invars
    if a is v and b is not v:
        return b
    if b is v and a is not v:
        return a
    return None
