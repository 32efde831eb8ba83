"""The key-value calls of ``ifrt.Client`` (its ``kv_*`` methods hand each here): set, get, list, watch and follow the
small store a job bootstraps from, with the request ids that make a retried change apply once."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import CoordinatorUnavailable, IfrtError, KeyValueTimeout
from ifrt.fanout import CLOSED, until

if TYPE_CHECKING:
    from ifrt.client_config import ClientConfig
    from ifrt.session import Session

Unary = Callable[..., Any]
"""``Client._unary``: one call, retried and riding through a failover until its deadline."""


class KeyValueCalls:
    """One client's key-value calls: ``unary`` makes each call, ``session`` is the client's live session (None
    without one) that carries watches, ``where`` names the coordinator for errors."""

    def __init__(self, client_uid: str, config: ClientConfig, unary: Unary, session: Callable[[], Session | None],
                 where: Callable[[], str]) -> None:
        self.client_uid, self.config = client_uid, config
        self._unary, self._session, self._where = unary, session, where
        self._lock = threading.Lock()
        self._watchers: list[tuple[str, queue.Queue | KeyCalls]] = []
        self._calls_made = 0

    def request_id(self) -> str:
        """The request id of a new call that changes the store: 1, 2, 3, ... in the order this client makes them, the
        same on every retry of the call. Increasing, so that the coordinator refuses the retry of a call whose answer
        it forgot (``coordinator.core.retries``) with a bounded record per client instead of applying it again."""
        with self._lock:
            self._calls_made += 1
            return str(self._calls_made)

    def kv_set(self, key: str, value: bytes, *, allow_overwrite: bool = False, timeout: float = 60.0) -> None:
        """Stores ``value`` under ``key``. KeyExists if it holds another value (unless ``allow_overwrite``). At most
        once, also when the call is retried on another coordinator replica (a later write is never undone): a retry
        whose answer the coordinator forgot (``--max-answer-bytes``) is refused, InvalidArgument, not applied."""
        request = pb.KeyValueSetRequest(client_uid=self.client_uid, key=key, value=bytes(value),
                                        allow_overwrite=allow_overwrite, request_id=self.request_id())
        self._unary("KeyValueSet", lambda _: request, time.monotonic() + timeout, what=f"setting key {key!r}")

    def kv_get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for some process to set it."""
        deadline = time.monotonic() + timeout

        def unset(last_error: IfrtError | None) -> IfrtError:
            # The time ran out between the coordinator's answer and the next ask (a call that went unanswered raises
            # CoordinatorUnavailable naming the failover instead).
            return KeyValueTimeout(f"key {key!r} was not set within {timeout:.1f}s")

        while True:
            try:
                response = self._unary("KeyValueGet", lambda remaining: pb.KeyValueGetRequest(
                    client_uid=self.client_uid, key=key, wait_ms=max(0, int(remaining * 1000))), deadline,
                    self.config.answer_slack_s, what=f"waiting for key {key!r}", give_up=unset)
                return response.value
            except KeyValueTimeout:
                if time.monotonic() >= deadline:  # the coordinator caps one wait; ours may be longer
                    raise KeyValueTimeout(f"key {key!r} was not set within {timeout:.1f}s") from None

    def kv_dir(self, prefix: str, timeout: float = 60.0) -> dict[str, bytes]:
        """Every key starting with ``prefix`` and its value, sorted by key. ``ifrt.errors.ResourceExhausted`` (naming
        the coordinator's ``--max-reply-bytes``) when their keys and values together pass what one answer may hold:
        the coordinator refuses the listing rather than build it, so list a narrower prefix."""
        response = self._unary("KeyValueDir", lambda _: pb.KeyValueDirRequest(
            client_uid=self.client_uid, prefix=prefix), time.monotonic() + timeout, what=f"the keys under {prefix!r}")
        return {e.key: e.value for e in response.entries}

    def kv_try_get(self, key: str, timeout: float = 60.0) -> bytes | None:
        """The value of ``key``, or None if it is unset now (no waiting)."""
        response = self._unary("KeyValueTryGet", lambda _: pb.KeyValueTryGetRequest(
            client_uid=self.client_uid, key=key), time.monotonic() + timeout, what=f"reading key {key!r}")
        return response.value if response.found else None

    def kv_multi_get(self, keys: Sequence[str], timeout: float = 60.0) -> list[bytes | None]:
        """Each key's value now (None: unset), in the order given, in one call (no waiting).
        ``ifrt.errors.ResourceExhausted`` when the values together pass the coordinator's ``--max-reply-bytes``."""
        if not keys:
            return []
        response = self._unary("KeyValueMultiGet", lambda _: pb.KeyValueMultiGetRequest(
            client_uid=self.client_uid, keys=keys), time.monotonic() + timeout, what=_keys("reading", keys))
        return [v.value if v.found else None for v in response.values]

    def kv_multi_set(self, items: Sequence[tuple[str, bytes]], *, allow_overwrite: bool = False,
                     timeout: float = 60.0) -> None:
        """Stores each ``(key, value)`` in order, in one call: all of them, or (when one is refused: KeyExists,
        InvalidArgument, ResourceExhausted, naming the key) none."""
        if not items:
            return
        request = pb.KeyValueMultiSetRequest(client_uid=self.client_uid, allow_overwrite=allow_overwrite, entries=[
            pb.KeyValueEntry(key=key, value=bytes(value)) for key, value in items], request_id=self.request_id())
        self._unary("KeyValueMultiSet", lambda _: request, time.monotonic() + timeout,
                    what=_keys("setting", [key for key, _ in items]))

    def kv_increment(self, key: str, amount: int = 1, timeout: float = 60.0) -> int:
        """Adds ``amount`` to the integer ``key`` holds (an unset key holds 0), atomically; returns the sum.

        Exactly once, also when the call is retried on another coordinator replica (or, if the coordinator forgot
        the answer of the call that reached it, InvalidArgument saying so: never applied twice). InvalidArgument if
        the key holds something that is not a decimal integer."""
        request = pb.KeyValueIncrementRequest(client_uid=self.client_uid, key=key, amount=amount,
                                              request_id=self.request_id())
        return self._unary("KeyValueIncrement", lambda _: request, time.monotonic() + timeout,  # the same request id
                           what=f"incrementing key {key!r}").value

    def kv_compare_set(self, key: str, expected: bytes, desired: bytes, timeout: float = 60.0) -> bytes | None:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (empty ``expected``: if it is unset), atomically, as
        torch's TCPStore does; returns what the key holds afterwards (None: it is unset).

        Exactly once, also when the call is retried on another coordinator replica (or InvalidArgument, as for
        ``kv_increment``)."""
        request = pb.KeyValueCompareSetRequest(client_uid=self.client_uid, key=key, expected=bytes(expected),
                                               desired=bytes(desired), request_id=self.request_id())
        response = self._unary("KeyValueCompareSet", lambda _: request, time.monotonic() + timeout,  # the same id
                               what=f"compare-and-set of key {key!r}")
        return response.value if response.found else None

    def kv_delete(self, key: str, *, prefix: bool = False, timeout: float = 60.0) -> int:
        """Deletes ``key`` (with ``prefix=True``, every key starting with it); returns how many keys were deleted.
        Deleting a key that is not there is no error. Exactly once, also when the call is retried on another
        coordinator replica (a key set again after it is not deleted by its retry)."""
        request = pb.KeyValueDeleteRequest(client_uid=self.client_uid, key=key, prefix=prefix,
                                           request_id=self.request_id())
        response = self._unary("KeyValueDelete", lambda _: request, time.monotonic() + timeout,
                               what=f"deleting {'the keys under' if prefix else 'key'} {key!r}")
        return response.deleted

    def kv_watch(self, prefix: str, timeout: float | None = None) -> Iterator[tuple[str, bytes | None]]:
        """Every change of a key under ``prefix`` from now on, as ``(key, value)`` (``None``: deleted), until
        ``timeout`` seconds pass or the client closes. Returns once the coordinator watches (carried on the live
        session; changes made while the session reconnects are not replayed: re-read with ``kv_dir`` on
        ``CoordinatorRestored``)."""
        session = self._session()
        if session is None:
            raise RuntimeError("kv_watch needs the live session: call discover() first, with session=True")
        changes: queue.Queue = queue.Queue()
        with self._lock:
            self._watchers.append((prefix, changes))
        if not session.watch(prefix).wait(self.config.watch_ack_timeout_s):
            with self._lock:
                self._watchers.remove((prefix, changes))
            raise CoordinatorUnavailable(f"the coordinator ({self._where()}) did not start watching "
                                         f"{prefix!r} within {self.config.watch_ack_timeout_s:.0f}s")
        return self._changes(prefix, changes, None if timeout is None else time.monotonic() + timeout)

    def _changes(self, prefix: str, changes: queue.Queue, deadline: float | None) -> Iterator[tuple[str, bytes | None]]:
        try:
            yield from until(changes, deadline)
        finally:
            with self._lock:
                if (prefix, changes) in self._watchers:
                    self._watchers.remove((prefix, changes))

    def kv_follow(self, prefix: str, changed: Callable[[str, bytes | None], None]) -> threading.Event:
        """Calls ``changed(key, value)`` (``None``: deleted) from the session thread for every change of a key under
        ``prefix`` once the event returned is set (the coordinator watches it), until the client closes; without
        waiting for that. As with ``kv_watch``, changes while the session reconnects are lost: CoordinatorLost."""
        session = self._session()
        if session is None:
            raise RuntimeError("kv_follow needs the live session: call discover() first, with session=True")
        with self._lock:
            self._watchers.append((prefix, KeyCalls(changed)))
        return session.watch(prefix)

    def key_changed(self, key: str, value: bytes | None) -> None:
        """From the session: ``key`` changed; hands it to every kv_watch of a prefix of it."""
        with self._lock:
            watchers = [changes for prefix, changes in self._watchers if key.startswith(prefix)]
        for changes in watchers:
            changes.put((key, value))

    def close(self) -> None:
        """The client closes: every watch ends."""
        with self._lock:
            watchers, self._watchers = self._watchers, []
        for _, changes in watchers:
            changes.put(CLOSED)


def _keys(doing: str, keys: Sequence[str]) -> str:
    """What a call on several keys was doing, for an error: ``"reading keys 'a', 'b' and 3 more"``."""
    shown = ", ".join(map(repr, keys[:2])) + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")
    return f"{doing} key{'s' if len(keys) > 1 else ''} {shown}"


class KeyCalls:
    """A key watcher that calls ``changed`` where kv_watch's queues a change (``kv_follow``)."""

    def __init__(self, changed: Callable[[str, bytes | None], None]) -> None:
        self.changed = changed

    def put(self, item: object) -> None:
        if item is not CLOSED:
            self.changed(*item)  # type: ignore[misc]
