"""The key-value store for runtime bootstrap values (e.g. a collective library's unique id). No I/O."""

from __future__ import annotations

import re
from collections.abc import Sequence

from coordinator.core.limits import DEFAULT_LIMITS, FLAGS, KEY_OVERHEAD_BYTES, Limits, exhausted, shown
from ifrt.errors import InvalidArgument, KeyExists

_INTEGER = re.compile(rb"-?[0-9]{1,19}")
AGENT_KEY_PREFIX = "torchrun/"
"""Keys that callers which are no process of the topology may use too: torchrun's agents meet there before any
worker exists (``ifrt.torchrun``). The cluster token still guards them, and the store's limits bound them. They
belong to no run of the job (``coordinator.core.runs``): a new run keeps them."""
ENTRY_FRAMING = 16
"""Bytes a listed entry costs in a KeyValueDir answer besides its key and value (protobuf tags and lengths)."""


def cost(key: str, value: bytes) -> int:
    """What holding ``key`` with ``value`` counts against ``--kv-max-bytes``."""
    return len(key.encode()) + len(value) + KEY_OVERHEAD_BYTES


class KeyValueStore:
    """Keys are text, values bytes, both within ``limits``, as are the number of keys and the bytes held
    (``held``). Setting the same value again is a no-op."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._values: dict[str, bytes] = {}
        self.held = 0
        """Bytes held, as ``--kv-max-bytes`` counts them (see ``cost``)."""

    def check(self, key: str, value: bytes, allow_overwrite: bool) -> None:
        """Raises what ``set`` would raise, without changing anything."""
        self.check_many([(key, value)], allow_overwrite)

    def check_key(self, key: str) -> None:
        """InvalidArgument unless ``key`` is 1 to ``kv_key_bytes`` bytes long (what a get may wait on, too)."""
        if not key or len(key.encode()) > self.limits.kv_key_bytes:
            raise InvalidArgument(f"key of {len(key.encode())} bytes: expected 1 to {self.limits.kv_key_bytes} bytes "
                                  f"(the coordinator's {FLAGS['kv_key_bytes']})")

    def _check_sizes(self, key: str, value: bytes) -> None:
        limits = self.limits
        self.check_key(key)
        if len(value) > limits.kv_value_bytes:
            raise InvalidArgument(f"value for key {shown(key)} is {len(value)} bytes: expected at most "
                                  f"{limits.kv_value_bytes} (the coordinator's {FLAGS['kv_value_bytes']})")

    def check_many(self, entries: Sequence[tuple[str, bytes]], allow_overwrite: bool) -> None:
        """Raises what setting every entry in order would raise, without changing anything: each entry is checked
        against the store as the entries before it would leave it (a key given twice holds its last value)."""
        staged: dict[str, bytes] = {}
        held, count = self.held, len(self._values)
        for key, value in entries:
            self._check_sizes(key, value)
            old = staged[key] if key in staged else self._values.get(key)
            if old is None and count >= self.limits.kv_keys:
                raise InvalidArgument(f"key {shown(key)} would be key number {count + 1} of the store: expected at "
                                      f"most {self.limits.kv_keys} keys (the coordinator's {FLAGS['kv_keys']})")
            if old is not None and old != value and not allow_overwrite:
                raise KeyExists(f"key {shown(key)} already holds another value ({len(old)} bytes): pass "
                                "allow_overwrite=True to replace it")
            after = held + cost(key, value) - (0 if old is None else cost(key, old))
            if after > self.limits.kv_bytes and after > held:
                raise exhausted(f"storing {len(value)} bytes at key {shown(key)}", self.limits.kv_bytes, "kv_bytes",
                                "delete keys that are no longer needed, or raise the flag", held)
            held, count, staged[key] = after, count + (old is None), value

    def set(self, key: str, value: bytes, allow_overwrite: bool = False) -> bool:
        """Stores ``value``; returns whether anything changed."""
        self.check(key, value, allow_overwrite)
        if self._values.get(key) == value:
            return False
        self._put(key, value)
        return True

    def _put(self, key: str, value: bytes) -> None:
        old = self._values.get(key)
        self.held += cost(key, value) - (0 if old is None else cost(key, old))
        self._values[key] = value

    def increment(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the decimal integer ``key`` holds (0 when unset), stores the sum as its decimal text
        and returns it; InvalidArgument, changing nothing, if the value is no integer or the sum leaves int64."""
        old = self._values.get(key, b"0")
        if not _INTEGER.fullmatch(old):
            raise InvalidArgument(f"key {shown(key)} holds {len(old)} bytes that are not a decimal integer: "
                                  "kv_increment adds only to integers (or to an unset key)")
        total = int(old) + amount
        if not -(1 << 63) <= total < 1 << 63:
            raise InvalidArgument(f"key {shown(key)}: {int(old)} + {amount} leaves the signed 64-bit range")
        self.set(key, str(total).encode(), allow_overwrite=True)
        return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> tuple[bytes | None, bool]:
        """TCPStore's compare-and-set: stores ``desired`` when ``key`` holds ``expected``, or is unset and ``expected``
        is empty. Returns what the key holds afterwards (None: unset) and whether it changed anything."""
        old = self._values.get(key)
        if old != expected and not (old is None and not expected):
            self._check_sizes(key, desired)  # bad input is refused whether or not it would have been stored
            return old, False
        return desired, self.set(key, desired, allow_overwrite=True)

    def delete(self, key: str, prefix: bool = False) -> list[str]:
        """Deletes ``key``, or every key starting with it; returns the keys deleted, sorted (none is no error)."""
        gone = sorted(k for k in self._values if k.startswith(key)) if prefix else [key] * (key in self._values)
        for k in gone:
            self.held -= cost(k, self._values.pop(k))
        return gone

    def restore(self, key: str, value: bytes) -> None:
        """Puts back a value from the journal, unchecked: it was accepted under the limits of its time."""
        self._put(key, value)

    def get(self, key: str) -> bytes | None:
        """The value of ``key`` (None while unset); InvalidArgument for a key no set could have stored."""
        self.check_key(key)
        return self._values.get(key)

    def get_many(self, keys: Sequence[str], most_bytes: int | None = None) -> list[bytes | None]:
        """Each key's value (None while unset), in order; InvalidArgument for a key no set could have stored, and
        ResourceExhausted, before any answer is built, when the values (and ``ENTRY_FRAMING`` bytes each) pass
        ``most_bytes``."""
        values = [self.get(key) for key in keys]
        if most_bytes is not None:
            size = sum(len(v or b"") + ENTRY_FRAMING for v in values)
            if size > most_bytes:
                raise exhausted(f"the values of {len(keys)} keys ({size} bytes)", most_bytes, "reply_bytes",
                                "ask for fewer keys at once, or raise the flag")
        return values

    def dir(self, prefix: str, most_bytes: int | None = None) -> list[tuple[str, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, sorted by key. ResourceExhausted, before any answer
        is built, when their keys and values (and ``ENTRY_FRAMING`` bytes each) pass ``most_bytes``."""
        found = sorted(k for k in self._values if k.startswith(prefix))
        if most_bytes is not None:
            size = sum(len(k.encode()) + len(self._values[k]) + ENTRY_FRAMING for k in found)
            if size > most_bytes:
                raise exhausted(f"the listing of {len(found)} keys under {shown(prefix)} ({size} bytes)", most_bytes,
                                "reply_bytes", "list a narrower prefix, or raise the flag")
        return [(k, self._values[k]) for k in found]
