"""A session's events waiting to be written, bounded in bytes: a process that stops reading its session cannot make
the coordinator hold every later event for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Outbox:
    """A queue of serialized events (and the session's own markers, which cost nothing). Once the events waiting
    would pass ``most_bytes``, they are dropped, the marker ``overflow(bytes waiting)`` makes is queued instead,
    and everything after it is dropped too: the session ends there."""

    def __init__(self, most_bytes: int, overflow: Callable[[int], object]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._most = most_bytes
        self._overflow = overflow
        self._bytes = 0
        self.overflowed = False

    def put_nowait(self, item: object) -> None:
        """Queues ``item`` (bytes count against the bound)."""
        if self.overflowed:
            return
        if isinstance(item, bytes):
            if self._bytes + len(item) > self._most:
                self.overflowed = True
                waiting = self._bytes + len(item)
                while not self._queue.empty():
                    self._queue.get_nowait()
                self._bytes = 0
                self._queue.put_nowait(self._overflow(waiting))
                return
            self._bytes += len(item)
        self._queue.put_nowait(item)

    async def get(self) -> object:
        """The next item, waiting for one."""
        item = await self._queue.get()
        if isinstance(item, bytes):
            self._bytes -= len(item)
        return item
