"""The key-value store for runtime bootstrap values (e.g. a collective library's unique id). No I/O."""

from __future__ import annotations

from ifrt.errors import InvalidArgument, KeyExists

MAX_KEY_BYTES = 1024


class KeyValueStore:
    """Keys are text, values bytes up to ``max_value_bytes``. Setting the same value again is a no-op."""

    def __init__(self, max_value_bytes: int = 1 << 20) -> None:
        self.max_value_bytes = max_value_bytes
        self._values: dict[str, bytes] = {}

    def check(self, key: str, value: bytes, allow_overwrite: bool) -> None:
        """Raises what ``set`` would raise, without changing anything."""
        if not key or len(key.encode()) > MAX_KEY_BYTES:
            raise InvalidArgument(f"key of {len(key.encode())} bytes: expected 1 to {MAX_KEY_BYTES} bytes")
        if len(value) > self.max_value_bytes:
            raise InvalidArgument(f"value for key {key!r} is {len(value)} bytes: expected at most "
                                  f"{self.max_value_bytes} (the coordinator's --kv-max-value-bytes)")
        old = self._values.get(key)
        if old is not None and old != value and not allow_overwrite:
            raise KeyExists(f"key {key!r} already holds another value ({len(old)} bytes): pass allow_overwrite=True "
                            "to replace it")

    def set(self, key: str, value: bytes, allow_overwrite: bool = False) -> bool:
        """Stores ``value``; returns whether anything changed."""
        self.check(key, value, allow_overwrite)
        if self._values.get(key) == value:
            return False
        self._values[key] = value
        return True

    def get(self, key: str) -> bytes | None:
        return self._values.get(key)

    def dir(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, sorted by key."""
        return sorted((k, v) for k, v in self._values.items() if k.startswith(prefix))
