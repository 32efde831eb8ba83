"""The key-value calls of one run (``coordinator.core.keyvalues``), with who may make them: a live process of the
topology any key, any caller (past the token) those under AGENT_KEY_PREFIX. No I/O; the run hands it its check of a
caller."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.core.effects import Effect
from coordinator.core.keyvalues import KeyValues


class KeyValueCalls:
    """Each call checks its caller for every key it touches (``may_use(client_uid, key, proof)`` raises why not),
    then asks the store; ``is_agent`` tells a caller that is no process (whose answers are kept fewer)."""

    def __init__(self, kv: KeyValues, may_use: Callable[[str, str, str], None],
                 is_agent: Callable[[str], bool]) -> None:
        self._kv, self._may_use, self._is_agent = kv, may_use, is_agent

    def set(self, client_uid: str, key: str, value: bytes, allow_overwrite: bool, request_id: str = "", *,
            proof: str = "") -> list[Effect]:
        """Stores a value; returns the change (empty when the key held that value already, or a retry)."""
        self._may_use(client_uid, key, proof)
        return self._kv.set(key, value, allow_overwrite, client_uid, request_id)

    def set_many(self, client_uid: str, entries: Sequence[tuple[str, bytes]], allow_overwrite: bool,
                 request_id: str = "", *, proof: str = "") -> list[Effect]:
        """Stores every value in order, all or (when one is refused) none; returns the changes."""
        for key, _ in entries:
            self._may_use(client_uid, key, proof)
        return self._kv.set_many(entries, allow_overwrite, client_uid, request_id)

    def increment(self, client_uid: str, key: str, amount: int, request_id: str = "", *,
                  proof: str = "") -> tuple[int, list[Effect]]:
        """Adds ``amount`` to the integer ``key`` holds (0 when unset); returns the sum (a retry: the sum it made)."""
        self._may_use(client_uid, key, proof)
        return self._kv.increment(client_uid, key, amount, request_id, agent=self._is_agent(client_uid))

    def compare_set(self, client_uid: str, key: str, expected: bytes, desired: bytes, request_id: str = "", *,
                    proof: str = "") -> tuple[bytes | None, list[Effect]]:
        """TCPStore's compare-and-set: ``key`` becomes ``desired`` when it holds ``expected`` (or is unset and
        ``expected`` is empty). Returns what the key holds now (None: unset); a retry is answered as the swap was."""
        self._may_use(client_uid, key, proof)
        return self._kv.compare_set(client_uid, key, expected, desired, request_id, agent=self._is_agent(client_uid))

    def delete(self, client_uid: str, key: str, prefix: bool, request_id: str = "", *,
               proof: str = "") -> tuple[int, list[Effect]]:
        """Deletes ``key`` (or every key starting with it); returns how many keys went (a retry: as the first call)."""
        self._may_use(client_uid, key, proof)
        return self._kv.delete(key, prefix, client_uid, request_id)

    def get(self, client_uid: str, key: str, *, proof: str = "") -> bytes | None:
        """The value of ``key``, None while it is unset."""
        self._may_use(client_uid, key, proof)
        return self._kv.get(key)

    def get_many(self, client_uid: str, keys: Sequence[str], *, proof: str = "") -> list[bytes | None]:
        """Each key's value (None while unset), in order; ResourceExhausted past ``--max-reply-bytes``."""
        for key in keys:
            self._may_use(client_uid, key, proof)
        return self._kv.get_many(keys)

    def dir(self, client_uid: str, prefix: str, *, proof: str = "") -> list[tuple[str, bytes]]:
        """Every (key, value) under ``prefix``, sorted by key."""
        self._may_use(client_uid, prefix, proof)
        return self._kv.dir(prefix)
