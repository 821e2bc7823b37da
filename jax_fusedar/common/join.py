"""How the processes of TP groups join into workspaces: one protocol for JAX and torch.
Framework-neutral (never imports jax or torch); the channel is the framework's
(``jax_fusedar.workspace._KVChannel`` over JAX's distributed key-value store,
``torch_compat.channel.StoreChannel`` over the c10d store, or an in-memory fake in tests).

For every group this process has members in (``agree``, then ``connect``):

1. publish: if the group spans several processes, this process publishes, under a key
   unique to the group, the workspace and itself (``exchange.exchange_key``), what the others
   need before anything is allocated: its host, its pid, the CUDA device of each member it
   drives, and its value of every option in ``AGREED_OPTIONS``;
2. agree: it reads what every other process of the group published and, from the same data
   on every process (so all accept or refuse alike), checks the options agree and runs the
   caller's own check (torch: the backend, from the members' hosts);
3. create: ``exchange.create_and_publish`` allocates this process's members of every group
   and publishes their IPC handles;
4. connect: ``exchange.connect_and_finalize`` opens the peers' handles, initialises each
   member and waits until the whole group is ready.

Every process publishes for all its groups before it waits for any, and creates all its
members before it connects any, so processes sharing several groups never wait on each other.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import handshake, exchange
from .tp_groups import TPGroup


@dataclasses.dataclass(frozen=True)
class AgreedOption:
    """An option every process of a group must pass alike (a checked rank whose peer is not
    checked would wait for a handshake that never comes)."""

    default: Any  # what a process that did not publish the option means
    env_var: Optional[str] = None  # named in the advice when the option also comes from one


# Adding an option the group must agree on is one line here.
AGREED_OPTIONS: Dict[str, AgreedOption] = {
    "handshake": AgreedOption(False, handshake.HANDSHAKE_ENV_VAR),
}


def _describe_value(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value)


def check_options_agree(
    options_by_member: Mapping[str, Mapping[str, Any]], what: str = "members"
) -> None:
    """Raises ValueError unless every member passed the same value of every option in
    ``AGREED_OPTIONS``. ``options_by_member``: {member description: {option: value}}, the same
    dict on every member, so all of them accept or refuse alike; an absent option is its
    default."""
    for name, option in AGREED_OPTIONS.items():
        by_value: Dict[Any, List[str]] = {}
        for member, options in options_by_member.items():
            value = options.get(name, option.default)
            by_value.setdefault(value, []).append(str(member))
        if len(by_value) > 1:
            # Booleans read "on ...; off ...", as the options are spelled.
            order = sorted(
                by_value, key=lambda v: (not v, repr(v)) if isinstance(v, bool) else (True, repr(v))
            )
            parts = "; ".join(
                f"{_describe_value(v)} for {', '.join(sorted(by_value[v]))}" for v in order
            )
            how = f"Pass the same {name}"
            if option.env_var:
                how += f" (or set ${option.env_var} identically)"
            raise ValueError(
                f"the {what} of this TP group disagree on {name}: {parts}. {how} in every process"
            )


@dataclasses.dataclass(frozen=True)
class GroupJoin:
    """This process's view of one group before the join: which process drives each TP rank,
    and the devices of the members that this process drives."""

    group: TPGroup
    processes: Tuple[int, ...]  # process of each TP rank
    my_devices: Mapping[int, int]  # TP rank -> CUDA device ordinal, this process's members

    @property
    def spans_processes(self) -> bool:
        return len(set(self.processes)) > 1


@dataclasses.dataclass(frozen=True)
class Agreed:
    """A group whose processes agreed: its members and what each process published."""

    join: GroupJoin
    members: Tuple[exchange.Member, ...]  # in TP-rank order
    infos: Mapping[int, Mapping[str, Any]]  # process -> what it published


def _publish_key(namespace: str, group: TPGroup, serial: int, process: int) -> str:
    return exchange.exchange_key(namespace, group, serial, f"join/process{process}")


def _fetch_all(channel, whos: Mapping[str, str]) -> Dict[str, bytes]:
    """One timeout for all keys where the channel can wait on several at once (torch's
    store names every missing member then); one fetch per key otherwise."""
    fetch_many = getattr(channel, "fetch_many", None)
    if fetch_many is not None:
        return fetch_many(whos)
    return {key: channel.fetch(key, who) for key, who in whos.items()}


def agree(
    joins: Sequence[GroupJoin],
    me: int,
    channel,
    *,
    namespace: str,
    serial: int,
    host: str,
    options: Mapping[str, Any],
    name: Callable[[TPGroup, int], str],
    name_waited: Optional[Callable[[TPGroup, int], str]] = None,
    accept: Optional[Callable[[GroupJoin, Mapping[int, Mapping[str, Any]]], None]] = None,
    what: str = "members",
) -> List[Agreed]:
    """Steps 1 and 2 (publish, agree) for ``joins``, the groups this process has members in;
    nothing is allocated. ``options``: this process's value of every option in
    ``AGREED_OPTIONS``. ``name(group, process)``: how the agreement message names a process
    (``what`` says what they are); ``name_waited``: how a wait that times out names it (default:
    ``name`` and the group). ``accept(join, infos)``: the caller's check of what every process
    published ({process: {"host", "pid", "devices", "options"}}), run identically on every
    process."""
    missing = set(AGREED_OPTIONS) - set(options)
    if missing:
        raise ValueError(f"options {sorted(missing)} must be given to join a group")
    if name_waited is None:

        def name_waited(group, process):
            return f"{name(group, process)} of TP group {list(group.members)}"

    def info_of(j: GroupJoin) -> Dict[str, Any]:
        return {
            "host": host,
            "pid": os.getpid(),
            "devices": {str(r): int(d) for r, d in j.my_devices.items()},
            "options": {o: options[o] for o in AGREED_OPTIONS},
        }

    for j in joins:  # 1. publish, for every group, before waiting for any
        if j.spans_processes:
            if channel is None:
                raise RuntimeError(
                    "this TP group spans several processes but there is no "
                    "channel to exchange workspace handles"
                )
            channel.publish(
                _publish_key(namespace, j.group, serial, me), json.dumps(info_of(j)).encode()
            )
    agreed = []
    for j in joins:  # 2. agree, from the same data on every process
        infos = {me: info_of(j)}
        others = sorted(set(j.processes) - {me})
        if others:
            got = _fetch_all(
                channel,
                {
                    _publish_key(namespace, j.group, serial, p): name_waited(j.group, p)
                    for p in others
                },
            )
            for p in others:
                infos[p] = json.loads(got[_publish_key(namespace, j.group, serial, p)])
        check_options_agree(
            {name(j.group, p): infos[p]["options"] for p in sorted(infos)}, what=what
        )
        if accept is not None:
            accept(j, infos)
        members = tuple(
            exchange.Member(p, int(infos[p]["devices"][str(r)])) for r, p in enumerate(j.processes)
        )
        agreed.append(Agreed(j, members, infos))
    return agreed


def connect(
    agreed: Sequence[Agreed],
    me: int,
    channel,
    *,
    namespace: str,
    serial: int,
    make_rank: Callable[[int, int], object],
) -> List[exchange.GroupPlan]:
    """Steps 3 and 4 (create, connect). ``make_rank(device, tp_rank)`` allocates one member's
    native workspace; the caller owns it from birth, so that a later failure can free it."""
    plans = [
        exchange.create_and_publish(
            a.join.group, a.members, me, make_rank, channel, namespace=namespace, serial=serial
        )
        for a in agreed
    ]
    for plan in plans:
        exchange.connect_and_finalize(plan, me, channel, namespace=namespace, serial=serial)
    return plans
