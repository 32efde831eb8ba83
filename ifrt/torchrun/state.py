"""torchrun's rendezvous state checked where torch would unpickle it: nothing a writer put in it runs, nor costs more
than linear time, in any agent that reads it.

The backend (``ifrt.torchrun.backend.IfrtRendezvousBackend``) stores opaque bytes, as torch's backend contract says. But
torch's state holder unpickles whatever its backend returns, and any holder of the cluster token can write the state
key, so the handler reads through ``CheckedStateBackend``: it hands torch only its own pickle of a state that
``check_state`` built from the stored bytes, or RendezvousStateError naming the key and what was found.

``check_state``, none of which runs anything from the bytes and each step linear in them:

1. ``ifrt.torchrun.opcodes.read``: the opcodes into inert records (no class called, no key hashed), refusing any
   class but ``STATE_CLASSES``, an integer longer than ``MAX_INT_BYTES`` before it is built, more than the node
   bound of ``_NodeDesc``, tuples deeper than ``MAX_TUPLE_DEPTH``, memo entries out of order.
2. ``_Builder``: the records must be a ``_RendezvousState`` of exactly torch's fields, each holding what torch's own
   code puts there (ints in range, bools, UTC-style datetimes, nodes of a str and two non-negative ints); it
   builds torch's objects itself from those values. At most ``max_nodes`` participants (the job's ``--nnodes``
   maximum) and ``node_limit`` nodes in all; and before any dict or set is built, the nodes' hashes are
   sorted and refused when more than ``MAX_SAME_HASH`` distinct nodes share one (dicts and sets of colliding keys
   cost quadratic time; sorting does not).

A state of a torch whose layout this check does not know (another field, class or protocol) is named as such, with
this agent's torch version; an installed torch of another layout is refused when the handler is created
(``check_torch_layout``).
"""

from __future__ import annotations

import dataclasses
import gc
import pickle
from datetime import datetime, timedelta, timezone

import torch
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    _NodeDesc,
    _RendezvousState,
)

from ifrt.torchrun.opcodes import MAX_INT_BYTES, MAX_TUPLE_DEPTH, Call, Items, Pairs, Refused, read, shown

STATE_CLASSES: dict[tuple[str, str], type] = {
    (cls.__module__, cls.__qualname__): cls for cls in (_RendezvousState, _NodeDesc, datetime, timezone, timedelta)}
"""Every class a pickle of torch's rendezvous state names (sets, dicts, ints and strings need no class)."""
FIELDS = ("round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list", "last_heartbeats")
"""The fields of torch's ``_RendezvousState`` this check knows (those of torch 2.13, which the tests run)."""
NODE_FIELDS = ("addr", "pid", "local_id")
"""The fields of torch's ``_NodeDesc`` this check knows."""
MAX_NODES = 8192
"""The most ``_NodeDesc`` objects a state's pickle may hold, unless four times the job's ``--nnodes`` maximum is more:
a node is pickled once per collection it is in unless it is one object in all of them (participants or a waiting
list, and the heartbeats), agents beyond the maximum wait or stand by, and dead ones stay until their heartbeat
expires. 33,000 fit in the coordinator's 1 MiB values."""
MAX_SAME_HASH = 4
"""Distinct nodes that may share one hash: more is a state built to make torch's dicts and sets quadratic."""
MAX_ADDR = 1024
"""The longest node address (an FQDN or ``--local-addr``; DNS names stop at 253)."""
_INT_MAX = 2 ** (8 * MAX_INT_BYTES - 1)


def node_limit(max_nodes: int | None) -> int:
    """How many ``_NodeDesc`` objects a state of a job of at most ``max_nodes`` nodes may hold."""
    return max(MAX_NODES, 4 * (max_nodes or 0))


def check_torch_layout() -> None:
    """RendezvousStateError naming the installed torch and the fields it differs in, when its rendezvous state is not
    laid out as this check knows it (it would refuse every state of that torch)."""
    fields = tuple(vars(_RendezvousState()))
    node = tuple(f.name for f in dataclasses.fields(_NodeDesc)) if dataclasses.is_dataclass(_NodeDesc) else ()
    if sorted(fields) != sorted(FIELDS) or node != NODE_FIELDS:
        odd = [f"_RendezvousState.{f} is new" for f in fields if f not in FIELDS]
        odd += [f"_RendezvousState.{f} is gone" for f in FIELDS if f not in fields]
        odd += [f"_NodeDesc has the fields ({', '.join(node)}), not ({', '.join(NODE_FIELDS)})"] * (node != NODE_FIELDS)
        raise RendezvousStateError(
            f"ifrt's torchrun backend does not know the rendezvous state of torch {torch.__version__} "
            f"({'; '.join(odd)}): it checks the state (ifrt/torchrun/state.py) as it knows it, with the fields "
            f"({', '.join(FIELDS)}) and _NodeDesc({', '.join(NODE_FIELDS)}), and would refuse every state this torch "
            f"writes. Use a torch with that layout (2.13 is tested) or an ifrt-topology that knows this one")


def check_state(data: bytes, key: str, max_nodes: int | None = None) -> _RendezvousState:
    """The state ``data`` holds, checked as the module says, for a job of at most ``max_nodes`` nodes (None: any up
    to ``MAX_NODES``); RendezvousStateError naming ``key`` and what was found when it is anything else."""
    collecting = gc.isenabled()
    gc.disable()  # the records are many small objects: collections as they are made would cost more than the check
    try:
        state = _Builder(max_nodes).state(read(data, STATE_CLASSES, {_NodeDesc: node_limit(max_nodes)}))
    except Refused as e:
        if e.other_torch:
            who = (f"an agent of another torch than this one ({torch.__version__}) wrote it, or something else did: "
                   f"run every agent of the job with the same torch")
        else:
            who = ("torchrun's agents write only torch's rendezvous state there; something else wrote this key (any "
                   "holder of the cluster token can)")
        raise RendezvousStateError(
            f"refused the rendezvous state at {key!r} on ifrt's coordinator, {len(data)} bytes starting "
            f"{data[:16]!r}: {e}. Nothing in it was run. {who}. Delete the key or use another --rdzv-id, and find "
            f"who wrote it") from e
    finally:
        if collecting:
            gc.enable()
    return state


class _Builder:
    """torch's objects made from ``read``'s records, each value checked first; Refused naming the field otherwise."""

    def __init__(self, max_nodes: int | None) -> None:
        self.max_nodes = max_nodes
        self.nodes: list[_NodeDesc] = []

    def state(self, record: object) -> _RendezvousState:
        if type(record) is not Call or record.cls is not _RendezvousState:
            raise Refused(f"it holds {_kind(record)}, not torch's _RendezvousState")
        if record.how != "NEWOBJ" or record.args or record.state is None:
            raise Refused("its _RendezvousState is not made as a pickler makes one (NEWOBJ, then its fields)")
        fields: dict[str, object] = {}  # keyed by names from FIELDS only
        for name, value in record.state.items:
            if type(name) is not str or name not in FIELDS:
                shown_name = repr(shown(name)) if type(name) is str else f"of type {_kind(name)}"
                raise Refused(f"its field {shown_name} is no field of torch {torch.__version__}'s "
                              f"_RendezvousState ({', '.join(FIELDS)})", other_torch=True)
            if name in fields:
                raise Refused(f"it sets the field {name!r} twice")
            fields[name] = value
        missing = [f for f in FIELDS if f not in fields]
        if missing:
            raise Refused(f"it lacks the field {missing[0]!r} of torch {torch.__version__}'s _RendezvousState",
                          other_torch=True)
        state = _RendezvousState()
        state.round = self.integer(fields["round"], "its field 'round'", 0, _INT_MAX)
        state.complete, state.closed = (self.boolean(fields[f], f) for f in ("complete", "closed"))
        state.deadline = None if fields["deadline"] is None else self.time(fields["deadline"], "deadline")
        participants = self.pairs(fields["participants"], "participants")
        if self.max_nodes is not None and len(participants) > self.max_nodes:
            raise Refused(f"its field 'participants' holds {len(participants)} nodes, more than the job's "
                          f"{self.max_nodes} (--nnodes)")
        ranks = [(self.node(n, "participants"), self.integer(r, "a rank in its field 'participants'", 0,
                                                             self.rank_end)) for n, r in participants]
        wait_list, redundancy_list = ([self.node(n, f) for n in self.items(fields[f], f)]
                                      for f in ("wait_list", "redundancy_list"))
        beats = [(self.node(n, "last_heartbeats"), self.time(t, "last_heartbeats"))
                 for n, t in self.pairs(fields["last_heartbeats"], "last_heartbeats")]
        self.check_hashes()  # before the first dict or set of nodes is built
        state.participants, state.last_heartbeats = dict(ranks), dict(beats)
        state.wait_list, state.redundancy_list = set(wait_list), set(redundancy_list)
        return state

    @property
    def rank_end(self) -> int:
        return node_limit(self.max_nodes) if self.max_nodes is None else self.max_nodes

    @staticmethod
    def integer(value: object, what: str, low: int, end: int) -> int:
        if type(value) is not int or not low <= value < end:
            found = f"the int {value}" if type(value) is int else _kind(value)
            raise Refused(f"{what} holds {found}, expected an int from {low} to {end - 1}")
        return value

    @staticmethod
    def boolean(value: object, field: str) -> bool:
        if type(value) is not bool:
            raise Refused(f"its field {field!r} holds {_kind(value)}, expected a bool")
        return value

    @staticmethod
    def pairs(value: object, field: str) -> list:
        if type(value) is not Pairs:
            raise Refused(f"its field {field!r} holds {_kind(value)}, expected a dict")
        return value.items

    @staticmethod
    def items(value: object, field: str) -> list:
        if type(value) is not Items or value.kind != "set":
            raise Refused(f"its field {field!r} holds {_kind(value)}, expected a set of _NodeDesc")
        return value.items

    def node(self, record: object, field: str) -> _NodeDesc:
        if type(record) is not Call or record.cls is not _NodeDesc:
            raise Refused(f"its field {field!r} holds {_kind(record)} where torch keeps a _NodeDesc")
        if record.built is None:
            values = dict.fromkeys(NODE_FIELDS)  # keyed by NODE_FIELDS only
            names = [n for n, _ in record.state.items] if record.how == "NEWOBJ" and record.state else []
            if record.args or not all(type(n) is str for n in names) or sorted(names) != sorted(NODE_FIELDS):
                raise Refused(f"a _NodeDesc of its field {field!r} is not made as a pickler makes one (NEWOBJ, then "
                              f"exactly {', '.join(NODE_FIELDS)})", other_torch=bool(names))
            values.update(record.state.items)
            addr = values["addr"]
            if type(addr) is not str or not 0 < len(addr) <= MAX_ADDR:
                raise Refused(f"a _NodeDesc of its field {field!r} has an addr that is no string of 1 to {MAX_ADDR} "
                              f"characters")
            pid, local_id = (self.integer(values[f], f"the {f} of a _NodeDesc in its field {field!r}", 0, _INT_MAX)
                             for f in ("pid", "local_id"))
            record.built = _NodeDesc(addr, pid, local_id)
            self.nodes.append(record.built)
        return record.built

    def time(self, record: object, field: str) -> datetime:
        if type(record) is not Call or record.cls is not datetime:
            raise Refused(f"its field {field!r} holds {_kind(record)}, expected a datetime")
        if record.built is None:
            args = record.args
            if (record.how != "REDUCE" or record.state is not None or len(args) != 2 or type(args[0]) is not bytes
                    or len(args[0]) != 10):
                raise Refused(f"a datetime of its field {field!r} is not made as a pickler makes one (its 10 bytes "
                              f"and a timezone)")
            raw, zone = args[0], self.zone(args[1], field)  # datetime's pickle: its fields, in 10 bytes
            record.built = _made(datetime, field, raw[0] << 8 | raw[1], raw[2] & 0x7F, raw[3], raw[4], raw[5], raw[6],
                                 int.from_bytes(raw[7:], "big"), zone, fold=raw[2] >> 7)
        return record.built

    def zone(self, record: object, field: str) -> timezone:
        ok = type(record) is Call and record.cls is timezone and record.how == "REDUCE" and record.state is None
        if not ok or len(record.args) != 1:
            raise Refused(f"a datetime of its field {field!r} has {_kind(record)} for its timezone, expected a "
                          f"timezone of a fixed offset")
        if record.built is None:
            offset = record.args[0]
            ok = type(offset) is Call and offset.cls is timedelta and offset.how == "REDUCE" and offset.state is None
            if not ok or len(offset.args) != 3 or any(type(a) is not int for a in offset.args):
                raise Refused(f"a timezone of its field {field!r} has no timedelta of three ints for its offset")
            record.built = _made(timezone, field, _made(timedelta, field, *offset.args))
        return record.built

    def check_hashes(self) -> None:
        """Refused when more than MAX_SAME_HASH distinct nodes share a hash; sorting costs n log n whatever they are
        (a set of them would cost n squared)."""
        keyed = sorted((hash(n), n.addr, n.pid, n.local_id) for n in self.nodes)
        run = 0
        for i in range(1, len(keyed)):
            if keyed[i][0] != keyed[i - 1][0]:
                run = 0
            elif keyed[i] != keyed[i - 1]:
                run += 1
                if run >= MAX_SAME_HASH:
                    raise Refused(f"more than {MAX_SAME_HASH} of its {len(keyed)} nodes share one hash, which no "
                                  f"agents' nodes do: a state made to slow every agent that reads it")


def _kind(value: object) -> str:
    if type(value) is Call:
        return f"a {value.cls.__name__}"
    return {Pairs: "a dict", Items: f"a {getattr(value, 'kind', '')}"}.get(type(value), type(value).__name__)


def _made(cls: type, field: str, *args: object, **kwargs: int) -> object:
    """``cls(*args)`` for the checked values of a datetime (its fields, each checked by datetime itself, which its
    pickle's bytes are not), timezone or timedelta; Refused when it rejects them."""
    try:
        return cls(*args, **kwargs)
    except (ValueError, TypeError, OverflowError) as e:
        raise Refused(f"a {cls.__name__} of its field {field!r} does not load as one ({type(e).__name__}: {e})") from e


class CheckedStateBackend(RendezvousBackend):
    """What torch's state holder reads the rendezvous through: ``backend`` (opaque bytes, fenced by its tokens), but
    any state it returns reaches torch only as this agent's own pickle of what ``check_state`` built from it.

    The last state checked is kept (its bytes and the pickle handed on), and so is what torch wrote itself, so an
    unchanged state is compared, not checked again, on each read."""

    def __init__(self, backend: RendezvousBackend, key: str, max_nodes: int | None = None) -> None:
        check_torch_layout()
        self._backend, self._key, self._max_nodes = backend, key, max_nodes
        self._last: tuple[bytes, bytes] | None = None

    @property
    def name(self) -> str:
        return self._backend.name

    def get_state(self) -> tuple[bytes, Token] | None:
        """The stored state, checked and pickled again, and its token; None before any agent wrote one."""
        got = self._backend.get_state()
        return None if got is None else (self._checked(got[0]), got[1])

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """``backend``'s compare-and-set; a state another agent wrote (a lost write) is handed on checked."""
        got = self._backend.set_state(state, token)
        if got is None:
            return None
        stored, new_token, has_set = got
        if has_set:  # exactly the bytes torch's own state holder pickled
            self._last = (stored, stored)
            return stored, new_token, True
        return self._checked(stored), new_token, False

    def _checked(self, stored: bytes) -> bytes:
        if self._last is None or self._last[0] != stored:
            self._last = (stored, pickle.dumps(check_state(stored, self._key, self._max_nodes)))
        return self._last[1]


__all__ = ["FIELDS", "MAX_ADDR", "MAX_INT_BYTES", "MAX_NODES", "MAX_SAME_HASH", "MAX_TUPLE_DEPTH", "NODE_FIELDS",
           "STATE_CLASSES", "CheckedStateBackend", "Refused", "check_state", "check_torch_layout", "node_limit"]
