"""The key-value store for runtime bootstrap values (e.g. a collective library's unique id). No I/O."""

from __future__ import annotations

import re

from coordinator.limits import DEFAULT_LIMITS, FLAGS, Limits, shown
from ifrt.errors import InvalidArgument, KeyExists

_INTEGER = re.compile(rb"-?[0-9]{1,19}")


class KeyValueStore:
    """Keys are text, values bytes, both within ``limits`` (as is the number of keys). Setting the same value
    again is a no-op."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._values: dict[str, bytes] = {}

    def check(self, key: str, value: bytes, allow_overwrite: bool) -> None:
        """Raises what ``set`` would raise, without changing anything."""
        limits = self.limits
        self._check_sizes(key, value)
        old = self._values.get(key)
        if old is None and len(self._values) >= limits.kv_keys:
            raise InvalidArgument(f"key {shown(key)} would be key number {len(self._values) + 1} of the store: "
                                  f"expected at most {limits.kv_keys} keys (the coordinator's {FLAGS['kv_keys']})")
        if old is not None and old != value and not allow_overwrite:
            raise KeyExists(f"key {shown(key)} already holds another value ({len(old)} bytes): pass "
                            "allow_overwrite=True to replace it")

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

    def set(self, key: str, value: bytes, allow_overwrite: bool = False) -> bool:
        """Stores ``value``; returns whether anything changed."""
        self.check(key, value, allow_overwrite)
        if self._values.get(key) == value:
            return False
        self._values[key] = value
        return True

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
            del self._values[k]
        return gone

    def restore(self, key: str, value: bytes) -> None:
        """Puts back a value from the journal, unchecked: it was accepted under the limits of its time."""
        self._values[key] = value

    def get(self, key: str) -> bytes | None:
        """The value of ``key`` (None while unset); InvalidArgument for a key no set could have stored."""
        self.check_key(key)
        return self._values.get(key)

    def dir(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, sorted by key."""
        return sorted((k, v) for k, v in self._values.items() if k.startswith(prefix))
