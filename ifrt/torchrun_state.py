"""torchrun's rendezvous state read back from the store without running anything a writer put in it.

torch's dynamic rendezvous keeps its state (``_RendezvousState``) as a pickle and unpickles whatever the backend
hands it, so a pickle planted at the state key would run its code in every agent. ``check_state`` is the gate the
backend puts in front of torch: the bytes must be a pickle of torch's state and nothing else, or they are refused
with ``RendezvousStateError`` naming the key and what was found, before torch sees them.

Three checks, in order, none of which runs anything from the bytes:

1. ``scan``: the opcodes alone (``pickletools.genops``, no object built). Only the opcodes a pickle of plain
   objects uses (no persistent ids, extension registry, protocol-0 ``INST``/``OBJ`` or out-of-band buffers);
   ``REDUCE``/``NEWOBJ`` only on a class named by the pickle, ``BUILD`` only with a dict on an object (never on a
   class); tuples nested at most ``MAX_TUPLE_DEPTH`` deep (hashing a tuple nested 1,000,000 deep, one byte per
   level, overflows the C stack while the pickle is loaded: a crash, not an error); memo entries in order (a
   ``LONG_BINPUT`` to entry 2**24 took pickle.loads from 10 to 266 MiB; to 2**31, it would zero 32 GiB).
2. ``SafeUnpickler``: ``find_class`` resolves exactly the classes of torch's state (``STATE_CLASSES``); any other
   name is refused before it is imported or called.
3. ``check_shape``: the result is a ``_RendezvousState`` whose fields hold what torch's own code puts there.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

STATE_CLASSES: dict[tuple[str, str], type] = {
    (cls.__module__, cls.__qualname__): cls for cls in (_RendezvousState, _NodeDesc, datetime, timezone, timedelta)}
"""Every class a pickle of torch's rendezvous state names (sets, dicts, ints and strings need no class)."""
MAX_TUPLE_DEPTH = 4
"""Tuples in a state are constructor arguments, one level deep; deeper ones are refused before loading."""

_ATOMS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING",
          "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
          "BINUNICODE8", "NONE", "NEWTRUE", "NEWFALSE", "FLOAT", "BINFLOAT", "EMPTY_LIST", "EMPTY_SET"}
_MARKED = {"TUPLE": "tuple", "FROZENSET": "tuple", "LIST": "other", "DICT": "dict"}
_TUPLE_N = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_ADD_ONE = {"APPEND": 1, "SETITEM": 2}
_ADD_MARKED = {"APPENDS", "SETITEMS", "ADDITEMS"}
_PUT = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_GET = {"GET", "BINGET", "LONG_BINGET"}
_NOTHING = {"PROTO", "FRAME", "STOP"}


class Refused(ValueError):
    """What a state's bytes hold instead of torch's rendezvous state (the reason, for the operator)."""


def check_state(data: bytes, key: str) -> _RendezvousState:
    """The state ``data`` holds, checked as the module says; RendezvousStateError naming ``key`` and what was found
    when it is anything else."""
    try:
        scan(data)
        state = SafeUnpickler(io.BytesIO(data)).load()
        check_shape(state)
    except Exception as e:  # whatever the allowed constructors raise on odd arguments: all of it is a refusal
        found = str(e) if isinstance(e, Refused) else f"it does not load as one ({type(e).__name__}: {e})"
        raise RendezvousStateError(
            f"refused the rendezvous state at {key!r} on ifrt's coordinator, {len(data)} bytes starting "
            f"{data[:16]!r}: {found}. Nothing in it was run. torchrun's agents write only torch's rendezvous state "
            f"there; something else wrote this key (any holder of the cluster token can). Delete the key or use "
            f"another --rdzv-id, and find who wrote it") from e
    return state


class SafeUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only ``STATE_CLASSES``: any other module and name is refused, never imported."""

    def find_class(self, module: str, name: str) -> type:
        cls = STATE_CLASSES.get((module, name))
        if cls is None:
            allowed = ", ".join(f"{m}.{n}" for m, n in STATE_CLASSES)
            raise Refused(f"it names {_shown(module)}.{_shown(name)}, which is no class of torch's rendezvous state "
                          f"({allowed})")
        return cls


def _shown(text: str) -> str:
    """A name read from the bytes, fit for a log line: as it is when short and printable, else quoted and escaped."""
    return text if text.isprintable() and len(text) <= 200 else repr(text[:200])


def scan(data: bytes) -> None:
    """Refuses (Refused) a pickle whose opcodes could do more than build torch's state, before anything is loaded.

    Follows the unpickler's stack with one (kind, tuple depth) per item: kind is ``class`` (a name the pickle
    imports), ``tuple``, ``dict`` or ``other``; the unpickler would fail on an underflow, this refuses it."""
    stack: list[tuple[str, int]] = []
    marks: list[int] = []
    memo: dict[int, tuple[str, int]] = {}

    def pop(n: int = 1) -> list[tuple[str, int]]:
        if len(stack) - n < (marks[-1] if marks else 0):
            raise Refused(f"its {name} at byte {pos} takes more than the stack holds")
        taken = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return taken

    def to_mark() -> list[tuple[str, int]]:
        if not marks:
            raise Refused(f"its {name} at byte {pos} has no mark")
        taken = stack[marks[-1]:]
        del stack[marks.pop():]
        return taken

    def tuple_of(items: list[tuple[str, int]]) -> tuple[str, int]:
        depth = 1 + max((d for _, d in items), default=0)
        if depth > MAX_TUPLE_DEPTH:
            raise Refused(f"it nests tuples more than {MAX_TUPLE_DEPTH} deep (at byte {pos})")
        return "tuple", depth

    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name in _ATOMS:
                stack.append(("other", 0))
            elif name == "EMPTY_TUPLE":
                stack.append(("tuple", 1))
            elif name == "EMPTY_DICT":
                stack.append(("dict", 0))
            elif name == "MARK":
                marks.append(len(stack))
            elif name in _MARKED:
                items = to_mark()
                stack.append(tuple_of(items) if _MARKED[name] == "tuple" else (_MARKED[name], 0))
            elif name in _TUPLE_N:
                stack.append(tuple_of(pop(_TUPLE_N[name])))
            elif name in _ADD_ONE or name in _ADD_MARKED:
                to_mark() if name in _ADD_MARKED else pop(_ADD_ONE[name])
                if not stack or stack[-1][0] not in ("dict", "other"):
                    raise Refused(f"its {name} at byte {pos} adds to something that is no list, dict or set")
            elif name == "GLOBAL":
                stack.append(("class", 0))
            elif name == "STACK_GLOBAL":
                pop(2)
                stack.append(("class", 0))
            elif name in ("REDUCE", "NEWOBJ"):
                called, args = pop(2)
                if called[0] != "class" or args[0] != "tuple":
                    raise Refused(f"its {name} at byte {pos} calls something other than a class it names")
                stack.append(("other", 0))
            elif name == "BUILD":
                (state,) = pop()
                if state[0] != "dict" or not stack or stack[-1][0] != "other":
                    raise Refused(f"its BUILD at byte {pos} sets something other than a dict on an object")
            elif name in _PUT:
                if not stack:
                    raise Refused(f"its {name} at byte {pos} memoizes an empty stack")
                if arg is not None and arg > len(memo):  # the unpickler would zero a memo table that long
                    raise Refused(f"its {name} at byte {pos} skips to memo {arg} (a pickler writes them in order)")
                memo[len(memo) if arg is None else arg] = stack[-1]
            elif name in _GET:
                if arg not in memo:
                    raise Refused(f"its {name} at byte {pos} reads memo {arg}, never written")
                stack.append(memo[arg])
            elif name == "DUP":
                stack.extend(pop())
                stack.append(stack[-1])
            elif name == "POP":
                if len(stack) > (marks[-1] if marks else 0):
                    stack.pop()
                elif marks:
                    marks.pop()
                else:
                    pop()
            elif name == "POP_MARK":
                to_mark()
            elif name not in _NOTHING:
                raise Refused(f"it uses the opcode {name} (at byte {pos}), which no pickle of torch's rendezvous "
                              f"state does")
    except ValueError as e:  # genops: truncated or unknown opcodes
        if isinstance(e, Refused):
            raise
        raise Refused(f"it is no well-formed pickle ({e})") from e


def check_shape(state: object) -> None:
    """Refuses (Refused) anything but a ``_RendezvousState`` whose fields hold what torch's own code puts there."""
    if type(state) is not _RendezvousState:
        raise Refused(f"it holds a value of type {type(state).__name__}, not torch's _RendezvousState")
    fields = vars(state)
    known = set(vars(_RendezvousState()))
    if set(fields) != known:
        odd = [repr(f)[:40] for f in fields if f not in known][:5] or [f"no {f}" for f in sorted(known - set(fields))]
        raise Refused(f"its fields are not those of torch's _RendezvousState ({', '.join(odd)})")

    def is_int(value: object) -> bool:
        return type(value) is int

    def is_time(value: object) -> bool:
        return type(value) is datetime

    def is_node(value: object) -> bool:
        return (type(value) is _NodeDesc and set(vars(value)) == {"addr", "pid", "local_id"}
                and type(value.addr) is str and is_int(value.pid) and is_int(value.local_id))

    expected = {
        "round": (is_int, "an int"),
        "complete": (lambda v: type(v) is bool, "a bool"),
        "closed": (lambda v: type(v) is bool, "a bool"),
        "deadline": (lambda v: v is None or is_time(v), "a datetime or None"),
        "participants": (lambda v: type(v) is dict and all(is_node(n) and is_int(r) for n, r in v.items()),
                         "a dict of _NodeDesc to int"),
        "wait_list": (lambda v: type(v) is set and all(map(is_node, v)), "a set of _NodeDesc"),
        "redundancy_list": (lambda v: type(v) is set and all(map(is_node, v)), "a set of _NodeDesc"),
        "last_heartbeats": (lambda v: type(v) is dict and all(is_node(n) and is_time(t) for n, t in v.items()),
                            "a dict of _NodeDesc to datetime"),
    }
    for field, (ok, what) in expected.items():
        if field in known and not ok(fields[field]):
            raise Refused(f"its field {field!r} holds {type(fields[field]).__name__}, expected {what}")


__all__ = ["MAX_TUPLE_DEPTH", "STATE_CLASSES", "Refused", "SafeUnpickler", "check_shape", "check_state", "scan"]
