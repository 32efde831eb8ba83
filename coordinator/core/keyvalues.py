"""The key-value commands: the store, retries answered as their first call was (or refused, once their answer was
forgotten: never applied twice), and the journal entries that replay them. No I/O; who may call is the router's check
(``ClusterState``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from coordinator.core import journal
from coordinator.core.effects import Effect, KeyChanged
from coordinator.core.kv import KeyValueStore
from coordinator.core.limits import Limits, check_call_id, shown
from coordinator.core.retries import Answer, Deleted, Forgotten, RetryAnswers, Stored, refusal
from ifrt.errors import InvalidArgument

_CALLS = {int: "an increment", Stored: "a swap or a set", Deleted: "a deletion"}


class KeyValues:
    """Every key's value and each client's remembered answers; ``record`` journals a decision."""

    def __init__(self, limits: Limits, record: Callable[[journal.Entry], None]) -> None:
        self.limits = limits
        self.store = KeyValueStore(limits)
        self.retries = RetryAnswers(limits)
        self._record = record

    def set(self, key: str, value: bytes, allow_overwrite: bool, client_uid: str = "",
            request_id: str = "") -> list[Effect]:
        """Stores a value; returns the change (empty when the key held that value already). A retry (the same
        ``request_id`` on the same key from the same client) of a set that changed the key is answered as done, not
        applied again (a write since then stays)."""
        if self._written(client_uid, request_id, key, value):
            return []
        self.retries.check_room(client_uid, request_id, key, len(value))
        if not self.store.set(key, value, allow_overwrite):
            return []
        self._record(journal.KeySet(key, value, *_call(client_uid, request_id)))
        self._remember(client_uid, request_id, key, Stored.of(value), len(value))
        return [KeyChanged(key, value)]

    def set_many(self, entries: Sequence[tuple[str, bytes]], allow_overwrite: bool, client_uid: str = "",
                 request_id: str = "") -> list[Effect]:
        """Stores every value in order, all or (when one is refused, changing nothing) none; returns the changes. The
        first entry that changes its key carries the call's request id: a retry of a call any of whose keys it names
        is answered as done (its entries were journaled together)."""
        if request_id:
            check_call_id("request_id", request_id, self.limits)
            if any(self._retried(client_uid, request_id, key, Stored) is not None for key, _ in entries):
                return []
            for key, value in entries:  # whichever entry carries the request id
                self.retries.check_room(client_uid, request_id, key, len(value))
        self.store.check_many(entries, allow_overwrite)
        effects: list[Effect] = []
        for key, value in entries:
            effects += self.set(key, value, True, client_uid, "" if effects else request_id)
        return effects

    def _written(self, client_uid: str, request_id: str, key: str, value: bytes) -> bool:
        """Whether this set is a retry of one that changed ``key`` (InvalidArgument for a retry with another value)."""
        if not request_id:
            return False
        check_call_id("request_id", request_id, self.limits)
        if (answer := self._retried(client_uid, request_id, key, Stored)) is None:
            return False
        if answer != Stored.of(value):
            raise InvalidArgument(f"request_id {shown(request_id)} on key {shown(key)} set another value: a retry "
                                  "repeats its call, a new call takes a new request_id")
        return True

    def increment(self, client_uid: str, key: str, amount: int, request_id: str, *,
                  agent: bool = False) -> tuple[int, list[Effect]]:
        """Adds ``amount`` to the integer ``key`` holds (0 when unset); returns the sum. A retry (the same
        ``request_id`` on the same key from the same client) is answered the sum it made, not applied again.
        ``agent`` (the caller is no process) changes nothing: every caller's answers share the same bounds."""
        check_call_id("request_id", request_id, self.limits)
        if isinstance(answer := self._retried(client_uid, request_id, key, int), int):
            return answer, []
        self.retries.check_room(client_uid, request_id, key, 0)
        total = self.store.increment(key, amount)
        self._record(journal.KeyIncremented(key, total, client_uid, request_id))  # replayed as the value
        self._remember(client_uid, request_id, key, total, 0)
        return total, [KeyChanged(key, str(total).encode())]

    def compare_set(self, client_uid: str, key: str, expected: bytes, desired: bytes, request_id: str, *,
                    agent: bool = False) -> tuple[bytes | None, list[Effect]]:
        """TCPStore's compare-and-set; returns what the key holds now (None: unset). A retry of a swap (the same
        ``request_id`` on the same key, with the same ``desired``, from the same client) is answered as the swap
        was, not applied again. ``agent`` changes nothing (see ``increment``)."""
        check_call_id("request_id", request_id, self.limits)
        if (answer := self._retried(client_uid, request_id, key, Stored)) is not None:
            if answer != Stored.of(desired):
                raise InvalidArgument(f"request_id {shown(request_id)} on key {shown(key)} was a swap to another "
                                      "value: a retry repeats its call, a new call takes a new request_id")
            return desired, []
        self.retries.check_room(client_uid, request_id, key, len(desired))
        value, changed = self.store.compare_set(key, expected, desired)
        if not changed:  # nothing to remember: a retry compares again, as if this call never happened
            return value, []
        self._record(journal.KeySwapped(key, desired, client_uid, request_id))
        self._remember(client_uid, request_id, key, Stored.of(desired), len(desired))
        return value, [KeyChanged(key, desired)]

    def _retried(self, client_uid: str, request_id: str, key: str, kind: type) -> Answer | None:
        """The remembered answer of this call (of ``kind``: an increment's sum, a swap's or set's digest, a deletion's
        count), None for a new call; InvalidArgument, changing nothing, when it was a call of another kind or its
        answer is forgotten (by either bound: it may have been applied, see ``coordinator.core.retries``)."""
        answer = self.retries.get(client_uid, request_id, key)
        if isinstance(answer, Forgotten):
            raise InvalidArgument(refusal(answer, request_id, key, self.limits))
        if answer is not None and not isinstance(answer, kind):
            raise InvalidArgument(f"request_id {shown(request_id)} on key {shown(key)} was {_CALLS[type(answer)]}, "
                                  f"not {_CALLS[kind]}: a new call takes a new request_id")
        return answer  # type: ignore[return-value]

    def delete(self, key: str, prefix: bool, client_uid: str = "", request_id: str = "") -> tuple[int, list[Effect]]:
        """Deletes ``key`` (or every key starting with it); returns how many keys went. A retry of a deletion that
        deleted something is answered its count and deletes nothing more."""
        if request_id:
            check_call_id("request_id", request_id, self.limits)
            if isinstance(answer := self._retried(client_uid, request_id, key, Deleted), Deleted):
                return answer.count, []
            self.retries.check_room(client_uid, request_id, key, 0)
        deleted = self.store.delete(key, prefix)
        if deleted:
            self._record(journal.KeysDeleted(key, prefix, *_call(client_uid, request_id),
                                             len(deleted) if request_id else 0))
            self._remember(client_uid, request_id, key, Deleted(len(deleted)), 0)
        return len(deleted), [KeyChanged(k, None) for k in deleted]

    def _remember(self, client_uid: str, request_id: str, key: str, answer: Answer, stored: int) -> None:
        """Remembers a call's answer after its entry is journaled, and journals each caller's record of forgotten
        answers that this changed (a compacted journal no longer holds the calls forgotten)."""
        for uid in self.retries.remember(client_uid, request_id, key, answer, stored):
            record = self.retries.records[uid]
            self._record(journal.AnswersForgotten(uid, record.through, record.unordered))

    def replay(self, entry: journal.KeySet | journal.KeyIncremented | journal.KeySwapped | journal.KeysDeleted
               | journal.AnswersForgotten, *, agent: bool = False) -> None:
        """Applies a journaled key-value decision again."""
        match entry:
            case journal.KeySet(key=key, value=value, client_uid=uid, request_id=request_id):
                self.store.restore(key, value)
                self.retries.remember(uid, request_id, key, Stored.of(value), len(value))
            case journal.KeyIncremented(key=key, value=value, client_uid=uid, request_id=request_id):
                self.store.restore(key, str(value).encode())
                self.retries.remember(uid, request_id, key, value, 0)
            case journal.KeySwapped(key=key, value=value, client_uid=uid, request_id=request_id):
                self.store.restore(key, value)
                self.retries.remember(uid, request_id, key, Stored.of(value), len(value))
            case journal.KeysDeleted(key=key, prefix=prefix, client_uid=uid, request_id=request_id, count=count):
                self.store.delete(key, prefix)
                self.retries.remember(uid, request_id, key, Deleted(count), 0)
            case journal.AnswersForgotten(client_uid=uid, through=through, unordered=unordered):
                self.retries.forgot(uid, through, unordered)

    def carry(self, before: KeyValues, prefix: str) -> None:
        """Takes over ``before``'s keys under ``prefix`` (a new run of the job: what lives outside its runs, e.g.
        torchrun's rendezvous, goes on; remembered answers do not, as in a new attempt)."""
        for key, value in before.store.dir(prefix):
            self.store.restore(key, value)

    def get(self, key: str) -> bytes | None:
        return self.store.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value (None while unset), in order; ResourceExhausted past ``--max-reply-bytes``."""
        return self.store.get_many(keys, self.limits.reply_bytes)

    def dir(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every (key, value) under ``prefix``, sorted by key; ResourceExhausted past ``--max-reply-bytes``."""
        return self.store.dir(prefix, self.limits.reply_bytes)


def _call(client_uid: str, request_id: str) -> tuple[str, str]:
    """Who made a journaled call, as its retry names it (nothing for a call without a request id: none retries it)."""
    return (client_uid, request_id) if request_id else ("", "")
