"""``Store``: a c10d store on ifrt's key-value store, so that torch.distributed's groups start on the coordinator
(durable and highly available as it is) instead of a TCPStore on rank 0."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from ifrt.client import Client
from ifrt.errors import KeyValueTimeout
from ifrt.pushed import PushedKeys
from ifrt.startup import RECHECK_S

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""A Store's default timeout for ``get`` and ``wait``: c10d's own default."""


class Store(dist.Store):
    """A c10d store on ifrt's key-value store: every key lives at ``prefix + key`` in the coordinator, so it is as
    durable and highly available as the coordinator, and a Python process can hand it to ``init_process_group``,
    ``new_group`` or a DeviceMesh. Keys are str or bytes (UTF-8), values bytes (str is encoded); ``get`` and
    ``wait`` block up to the store's timeout and then raise ``torch.distributed.DistStoreError`` naming the keys.

    Each call is one round trip to the coordinator while its keys are set (``multi_get``, ``multi_set``, ``wait``
    and ``check`` of many keys too), and a ``get`` of the one key the same thread's previous call on this store (or
    a clone) waited for is none: it answers the value that wait read (gloo waits for each rank's key, then gets it).
    While a process group starts on it (``follow_start``), the ranks' keys come pushed and reads of them need no
    call at all. Every call waits out a coordinator failover (up to the client's failover window), also past the
    store's timeout.

    Keep a reference to it for as long as a process group uses it: c10d holds the C++ half only.
    """

    def __init__(self, client: Client, prefix: str = "", timeout: timedelta | float = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self.client = client
        self.prefix = prefix
        self.set_timeout(timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))
        self.watch: Callable[[], None] = lambda: None
        """Called between waits; raises to end them (``init_process_group``: a peer failed)."""
        self.describe_missing: Callable[[Sequence[str]], str] = lambda keys: ""
        """Who was expected to set ``keys`` (store keys, without the prefix), where that is known."""
        self._clones: list[Store] = []
        self._waited = _Waited()
        self._start = _Start()

    def set(self, key: str | bytes, value: bytes | str) -> None:
        """Stores ``value`` under ``key``, replacing what it held."""
        self._waited.last = None
        self._start.first_set(self.client, self._key(key))
        self.client.kv_set(self._key(key), _bytes(value), allow_overwrite=True)

    def get(self, key: str | bytes) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set."""
        waited, self._waited.last = self._waited.last, None
        if waited is not None and waited[:2] == (threading.get_ident(), self._key(key)):
            return waited[2]  # nothing ran on this store since the wait read it
        return self._wait_all([key], self._seconds(None))[0]

    def multi_get(self, keys: Sequence[str | bytes]) -> list[bytes]:
        """The values of ``keys``, waiting up to the store's timeout for all of them."""
        self._waited.last = None
        return self._wait_all(keys, self._seconds(None))

    def multi_set(self, keys: Sequence[str | bytes], values: Sequence[bytes | str]) -> None:
        """Stores each value under its key, in order, in one call (all of them or, when one is refused, none)."""
        self._waited.last = None
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values: expected as many of each")
        self.client.kv_multi_set([(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)],
                                 allow_overwrite=True)

    def wait(self, keys: Sequence[str | bytes], timeout: timedelta | None = None) -> None:
        """Waits until every key is set, up to ``timeout`` (default: the store's)."""
        self._waited.last = None
        values = self._wait_all(keys, self._seconds(timeout))
        if len(keys) == 1:
            self._waited.last = (threading.get_ident(), self._key(keys[0]), values[0])

    def check(self, keys: Sequence[str | bytes]) -> bool:
        """Whether every key is set now (no waiting)."""
        self._waited.last = None
        return all(v is not None for v in self.client.kv_multi_get([self._key(k) for k in keys]))

    def add(self, key: str | bytes, amount: int) -> int:
        """Adds ``amount`` to the integer ``key`` holds (0 when unset), atomically and exactly once; returns the sum."""
        self._waited.last = None
        return self.client.kv_increment(self._key(key), int(amount))

    def compare_set(self, key: str | bytes, expected: bytes | str, desired: bytes | str) -> bytes:
        """TCPStore's compare-and-set: ``key`` becomes ``desired`` if it holds ``expected`` (empty: if it is unset).
        Returns what the key holds now; for an unset key and a non-empty ``expected``, ``expected`` (as TCPStore)."""
        self._waited.last = None
        expected = _bytes(expected)
        now = self.client.kv_compare_set(self._key(key), expected, _bytes(desired))
        return expected if now is None else now

    def append(self, key: str | bytes, value: bytes | str) -> None:
        """Appends ``value`` to what ``key`` holds (creating it), atomically."""
        value, held = _bytes(value), b""
        while (now := self.compare_set(key, held, held + value)) != held + value:
            held = now

    def delete_key(self, key: str | bytes) -> bool:
        """Deletes ``key``; whether it existed."""
        self._waited.last = None
        return self.client.kv_delete(self._key(key)) > 0

    def num_keys(self) -> int:
        """How many keys the store holds (under its prefix)."""
        self._waited.last = None
        return len(self.client.kv_dir(self.prefix))

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> Store:
        """Another Store on the same client, prefix and timeout (kept referenced by this one)."""
        twin = Store(self.client, self.prefix, self.timeout)
        twin.watch, twin.describe_missing, twin._waited, twin._start = (self.watch, self.describe_missing,
                                                                        self._waited, self._start)
        self._clones.append(twin)
        return twin

    def follow_start(self, rank: int) -> None:
        """While a process group starts on this store as ``rank``: the first key this process sets, if it ends in
        its rank (gloo's ``0//cpu//0/<rank>``), names the keys every rank sets (that key without its rank); those
        are watched from then on, and reads of them are answered from the values the coordinator pushes, waiting
        for a push where a key is still unset. Until ``end_start``."""
        self._start.rank = rank

    def end_start(self) -> None:
        """Ends ``follow_start``: every read asks the coordinator again."""
        self._start.end()

    # The names c10d's C++ side calls a Python store by.
    deleteKey = delete_key
    getNumKeys = num_keys

    def _wait_all(self, keys: Sequence[str | bytes], timeout_s: float) -> list[bytes]:
        """Every key's value: all read in one call while they are set; else a wait of at most RECHECK_S for the
        first unset one (``watch`` before each), then the rest again in one call. DistStoreError naming the keys
        still unset (and who should set them) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        full = [self._key(k) for k in keys]
        values: list[bytes | None] = [None] * len(full)
        pending = list(range(len(full)))
        while pending:
            self.watch()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise dist.DistStoreError(self._timeout_message([keys[i] for i in pending], timeout_s))
            view = self._start.view
            if view is not None and all(view.covers(full[i]) for i in pending) and view.ready():
                for i, value in zip(pending, view.values([full[i] for i in pending]), strict=True):
                    values[i] = value
                pending = [i for i in pending if values[i] is None]
                if pending:
                    view.wait([full[i] for i in pending], min(RECHECK_S, remaining))
                continue
            if len(pending) > 1:
                found = self.client.kv_multi_get([full[i] for i in pending], timeout=min(RECHECK_S, remaining))
                for i, value in zip(pending, found, strict=True):
                    values[i] = value
                pending = [i for i in pending if values[i] is None]
                if not pending:
                    break
            try:
                values[pending[0]] = self.client.kv_get(full[pending[0]], timeout=min(RECHECK_S, remaining))
                pending.pop(0)
            except KeyValueTimeout:
                continue
        return values  # type: ignore[return-value]

    def _timeout_message(self, keys: Sequence[str | bytes], timeout_s: float) -> str:
        names = [_text(k) for k in keys]
        found = self.client.kv_multi_get([self.prefix + k for k in names])
        missing = [k for k, v in zip(names, found, strict=True) if v is None] or names
        who = self.describe_missing(missing)
        # "wait timeout", as TCPStore says it: PyTorch's code and tests match on "timeout".
        return (f"ifrt store: wait timeout: key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} not "
                f"set within {timeout_s:.1f}s (prefix {self.prefix!r})" + (f": {who}" if who else ""))

    def _key(self, key: str | bytes) -> str:
        return self.prefix + _text(key)

    def _seconds(self, timeout: timedelta | None) -> float:
        return (self.timeout if timeout is None else timeout).total_seconds()


class _Start:
    """A process group's start on a store and its clones (``follow_start``): this process's rank, and once its
    first ``set`` named the ranks' keys, the view of them the coordinator pushes."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.view: PushedKeys | None = None

    def first_set(self, client: Client, key: str) -> None:
        """Watches the keys that share ``key``'s stem, if this is the first key set in the start and ends in the
        rank (a key that does not names nothing: reads ask the coordinator, as outside a start)."""
        if self.rank is None:
            return
        rank, self.rank = str(self.rank), None  # the first set only
        stem = key[:-len(rank)]
        if key.endswith(rank) and stem and not stem[-1].isdigit():
            with contextlib.suppress(RuntimeError):  # a client without a live session: no pushes
                self.view = PushedKeys(client, stem)

    def end(self) -> None:
        self.rank = None
        if self.view is not None:
            self.view.close()
            self.view = None


class _Waited:
    """What the previous call on a store (and its clones) read when it was a wait for one key: (thread, full key,
    value); every other call clears it."""

    def __init__(self) -> None:
        self.last: tuple[int, str, bytes] | None = None


def _text(key: str | bytes) -> str:
    return key.decode() if isinstance(key, bytes) else key


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
