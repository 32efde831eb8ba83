"""The key-value calls of the state machine (``coordinator.keyvalues``), with who may make them: a live process of
the topology any key, any caller (past the token) those under AGENT_KEY_PREFIX. No I/O; a part of ``ClusterState``,
which provides ``_kv``, ``_admission`` and ``process_id_of``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from coordinator.effects import Effect
from coordinator.kv import AGENT_KEY_PREFIX

if TYPE_CHECKING:
    from coordinator.admission import Admission
    from coordinator.keyvalues import KeyValues


class KeyValueCalls:
    """Each key-value call checks its caller for every key it touches, then asks the store."""

    _kv: KeyValues
    _admission: Admission
    process_id_of: Callable[..., int]

    def kv_set(self, client_uid: str, key: str, value: bytes, allow_overwrite: bool, *,
               proof: str = "") -> list[Effect]:
        """Stores a value; returns the change (empty when the key held that value already)."""
        self._check_kv_caller(client_uid, key, proof)
        return self._kv.set(key, value, allow_overwrite)

    def kv_set_many(self, client_uid: str, entries: Sequence[tuple[str, bytes]], allow_overwrite: bool, *,
                    proof: str = "") -> list[Effect]:
        """Stores every value in order, all or (when one is refused) none; returns the changes."""
        for key, _ in entries:
            self._check_kv_caller(client_uid, key, proof)
        return self._kv.set_many(entries, allow_overwrite)

    def kv_increment(self, client_uid: str, key: str, amount: int, request_id: str = "", *,
                     proof: str = "") -> tuple[int, list[Effect]]:
        """Adds ``amount`` to the integer ``key`` holds (0 when unset); returns the sum (a retry: the sum it made)."""
        self._check_kv_caller(client_uid, key, proof)
        return self._kv.increment(client_uid, key, amount, request_id, agent=self._is_agent(client_uid))

    def kv_compare_set(self, client_uid: str, key: str, expected: bytes, desired: bytes, request_id: str = "", *,
                       proof: str = "") -> tuple[bytes | None, list[Effect]]:
        """TCPStore's compare-and-set: ``key`` becomes ``desired`` when it holds ``expected`` (or is unset and
        ``expected`` is empty). Returns what the key holds now (None: unset); a retry is answered as the swap was."""
        self._check_kv_caller(client_uid, key, proof)
        return self._kv.compare_set(client_uid, key, expected, desired, request_id,
                                    agent=self._is_agent(client_uid))

    def kv_delete(self, client_uid: str, key: str, prefix: bool, *, proof: str = "") -> tuple[int, list[Effect]]:
        """Deletes ``key`` (or every key starting with it); returns how many keys went."""
        self._check_kv_caller(client_uid, key, proof)
        return self._kv.delete(key, prefix)

    def kv_get(self, client_uid: str, key: str, *, proof: str = "") -> bytes | None:
        """The value of ``key``, None while it is unset."""
        self._check_kv_caller(client_uid, key, proof)
        return self._kv.get(key)

    def kv_get_many(self, client_uid: str, keys: Sequence[str], *, proof: str = "") -> list[bytes | None]:
        """Each key's value (None while unset), in order; ResourceExhausted past ``--max-reply-bytes``."""
        for key in keys:
            self._check_kv_caller(client_uid, key, proof)
        return self._kv.get_many(keys)

    def kv_dir(self, client_uid: str, prefix: str, *, proof: str = "") -> list[tuple[str, bytes]]:
        """Every (key, value) under ``prefix``, sorted by key."""
        self._check_kv_caller(client_uid, prefix, proof)
        return self._kv.dir(prefix)

    def _check_kv_caller(self, client_uid: str, key: str, proof: str) -> None:
        """A live process of the topology may use any key; any caller (past the token) those under
        AGENT_KEY_PREFIX. UnknownClient, PermissionDenied or ProcessDeclaredFailed otherwise."""
        if not key.startswith(AGENT_KEY_PREFIX):
            self.process_id_of(client_uid, proof=proof)

    def _is_agent(self, client_uid: str) -> bool:
        """Whether the caller is no process (a torchrun agent): only the latest such callers' answers are kept."""
        return client_uid not in self._admission.members
