"""Whether key-value histories are linearizable: Wing & Gong's search with Lowe's memoization (the way Porcupine and
Knossos check histories), per key, over a sequential model of the coordinator's store (coordinator/core/kv.py).

An operation that failed with an unknown outcome (a lost reply, a timeout) has ``ret`` infinity and result
``UNKNOWN``: it may take effect at any moment after its call, or never. One refused for sure (it was never applied)
is left out of the history by its caller.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()
"""The result of an operation whose outcome is unknown: any result is accepted."""
OK = "ok"
"""A set that stored its value."""
EXISTS = "exists"
"""A set refused with KeyExists (the key held another value and ``allow_overwrite`` was false)."""
INVALID = "invalid"
"""An increment refused with InvalidArgument (the key held no decimal integer, or the sum left int64)."""
_INTEGER = re.compile(rb"-?[0-9]{1,19}")


@dataclass(frozen=True)
class Op:
    """One call as its client saw it: ``kind`` on ``key`` with ``args``, called at ``call`` and answered ``result`` at
    ``ret`` (seconds on one clock). Kinds and their args and results:

    - ``get`` (): the value (bytes) or None (absent)
    - ``set`` (value, allow_overwrite): OK or EXISTS
    - ``cas`` (expected, desired): what the key holds afterwards, or None (empty ``expected``: the key is absent)
    - ``incr`` (amount,): the new value as an int, or INVALID
    - ``delete`` (): how many keys went (0 or 1)
    """

    kind: str
    key: str
    args: tuple = ()
    call: float = 0.0
    ret: float = math.inf
    result: Any = UNKNOWN
    client: str = ""


def apply(value: bytes | None, op: Op) -> tuple[Any, bytes | None]:
    """What ``op`` answers on a key holding ``value`` (None: absent), and what the key holds after it."""
    if op.kind == "get":
        return value, value
    if op.kind == "set":
        new, allow_overwrite = op.args
        if value is not None and value != new and not allow_overwrite:
            return EXISTS, value
        return OK, new
    if op.kind == "cas":
        expected, desired = op.args
        if value == expected or (value is None and not expected):
            return desired, desired
        return value, value
    if op.kind == "incr":
        old = b"0" if value is None else value
        if not _INTEGER.fullmatch(old) or not -(1 << 63) <= int(old) + op.args[0] < 1 << 63:
            return INVALID, value
        total = int(old) + op.args[0]
        return total, str(total).encode()
    if op.kind == "delete":
        return int(value is not None), None
    raise ValueError(f"unknown operation kind {op.kind!r}")


class _Entry:
    """A call or return in the history's doubly linked list (a call knows its return: ``match``)."""

    __slots__ = ("index", "match", "next", "op", "prev")

    def __init__(self, op: Op | None, index: int) -> None:
        self.op, self.index = op, index
        self.match: _Entry | None = None
        self.prev: _Entry | None = None
        self.next: _Entry | None = None


def _lift(call: _Entry) -> None:
    for e in (call, call.match):
        e.prev.next = e.next
        if e.next is not None:
            e.next.prev = e.prev


def _unlift(call: _Entry) -> None:
    for e in (call.match, call):
        e.prev.next = e
        if e.next is not None:
            e.next.prev = e


def linearizable(ops: Sequence[Op], initial: bytes | None = None, budget: int = 5_000_000) -> bool | None:
    """Whether the history ``ops`` of one key is linearizable from ``initial``; None if ``budget`` search steps did
    not decide it. Intervals that touch (a return at the very time of another call) count as concurrent."""
    ops = [op for op in ops if not (op.kind == "get" and op.result is UNKNOWN)]  # a read nobody saw constrains nothing
    order = sorted([(op.call, 0, i) for i, op in enumerate(ops)] + [(op.ret, 1, i) for i, op in enumerate(ops)])
    head = _Entry(None, -1)
    calls: dict[int, _Entry] = {}
    last = head
    for _, is_return, i in order:
        entry = _Entry(ops[i], i)
        if is_return:
            calls[i].match = entry
        else:
            calls[i] = entry
        last.next, entry.prev, last = entry, last, entry
    value, done = initial, 0  # done: the bits of the operations linearized so far
    seen: set[tuple[int, bytes | None]] = set()
    stack: list[tuple[_Entry, bytes | None]] = []
    entry = head.next
    for _ in range(budget):
        if head.next is None:
            return True
        assert entry is not None  # every call's return follows it, so a return ends each pass over the list
        if entry.match is not None:  # a call: try to linearize it here
            result, after = apply(value, entry.op)
            if entry.op.result is UNKNOWN or result == entry.op.result:
                key = (done | 1 << entry.index, after)
                if key not in seen:  # Lowe: this set of operations has never before left the key in this state
                    seen.add(key)
                    stack.append((entry, value))
                    value, done = after, key[0]
                    _lift(entry)
                    entry = head.next
                    continue
            entry = entry.next
        else:  # a return whose call could not be linearized before it: undo the last choice
            if not stack:
                return False
            entry, value = stack.pop()
            done &= ~(1 << entry.index)
            _unlift(entry)
            entry = entry.next
    return None


def check(ops: Iterable[Op], budget: int = 5_000_000) -> dict[str, bool | None]:
    """Each key's verdict (``linearizable``), every key starting absent."""
    by_key: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        by_key[op.key].append(op)
    return {key: linearizable(history, budget=budget) for key, history in sorted(by_key.items())}
