"""A session's events waiting to be written, bounded in bytes: a process that stops reading its session cannot make
the coordinator hold every later event for it. Sessions that share a ``Backlogs`` are bounded together too: an
event queued for many sessions is serialized once and counted once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Backlogs:
    """The bytes of events all sessions leave unread, each message counted once however many hold it. Past
    ``most_bytes``, the session that holds the most is ended (its backlog dropped) until the rest fit."""

    def __init__(self, most_bytes: int) -> None:
        self.most = most_bytes
        self.held = 0
        self._holders: dict[int, int] = {}  # id of a message queued somewhere -> how many queues hold it
        self._outboxes: dict[Outbox, None] = {}

    def add(self, outbox: Outbox) -> None:
        self._outboxes[outbox] = None

    def remove(self, outbox: Outbox) -> None:
        """Forgets a session that ended, and what it left unread."""
        self._outboxes.pop(outbox, None)
        outbox.drop()

    def hold(self, message: bytes) -> None:
        count = self._holders.get(id(message), 0)
        if not count:
            self.held += len(message)
        self._holders[id(message)] = count + 1

    def release(self, message: bytes) -> None:
        count = self._holders.pop(id(message))
        if count > 1:
            self._holders[id(message)] = count - 1
        else:
            self.held -= len(message)

    def trim(self) -> None:
        """Ends the sessions that hold the most until the rest fit within the bound."""
        while self.held > self.most and self._outboxes:
            largest = max(self._outboxes, key=lambda o: o.waiting)
            if not largest.waiting:
                return
            largest.overflow_now(shared=True)


class Outbox:
    """A queue of serialized events (and the session's own markers, which cost nothing). Once the events waiting
    would pass ``most_bytes`` (or the ``backlogs`` it shares, theirs), they are dropped, the marker
    ``overflow(bytes waiting)`` makes is queued instead, and everything after it is dropped too: the session ends
    there."""

    def __init__(self, most_bytes: int, overflow: Callable[[int], object], backlogs: Backlogs | None = None,
                 shared_overflow: Callable[[int], object] | None = None) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._most = most_bytes
        self._overflow = overflow
        self._shared_overflow = shared_overflow or overflow
        """Makes the marker of a session ended because the ``backlogs`` together passed their bound."""
        self._backlogs = backlogs
        self._bytes = 0
        self.overflowed = False
        if backlogs is not None:
            backlogs.add(self)

    @property
    def waiting(self) -> int:
        """Bytes of events queued and not yet taken."""
        return self._bytes

    def put_nowait(self, item: object) -> None:
        """Queues ``item`` (bytes count against the bound)."""
        if self.overflowed:
            return
        if isinstance(item, bytes):
            if self._bytes + len(item) > self._most:
                self._overflow_with(self._bytes + len(item))
                return
            self._bytes += len(item)
            if self._backlogs is not None:
                self._backlogs.hold(item)
        self._queue.put_nowait(item)
        if self._backlogs is not None and isinstance(item, bytes):
            self._backlogs.trim()

    def overflow_now(self, *, shared: bool = False) -> None:
        """Ends the session here: its backlog is dropped, the overflow marker queued instead (``shared``: the one for
        the shared bound)."""
        self._overflow_with(self._bytes, shared=shared)

    def _overflow_with(self, waiting: int, *, shared: bool = False) -> None:
        self.overflowed = True
        self.drop()
        self._queue.put_nowait((self._shared_overflow if shared else self._overflow)(waiting))

    def drop(self) -> None:
        """Drops every event queued (the session ends, or has ended)."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, bytes) and self._backlogs is not None:
                self._backlogs.release(item)
        self._bytes = 0

    async def get(self) -> object:
        """The next item, waiting for one."""
        item = await self._queue.get()
        if isinstance(item, bytes):
            self._bytes -= len(item)
            if self._backlogs is not None:
                self._backlogs.release(item)
        return item
