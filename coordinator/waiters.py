"""Calls waiting for an answer the state machine has yet to decide, by what they wait for. The shell resolves them
from the effects that carry the answers, once those are durable."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

WOKEN = object()
"""What a waiter is given when it is woken without an answer (a step-down, a new attempt): it looks again."""
PUBLISHED = ("published",)
"""What a Register (or RegisterHost) call waits for while the topology is incomplete."""


class Waiters:
    """Futures by key; each key's waiters are resolved together, once."""

    def __init__(self) -> None:
        self._waiting: dict[Hashable, dict[asyncio.Future, None]] = {}  # ordered sets

    def expect(self, key: Hashable) -> asyncio.Future:
        """A future resolved with the next answer for ``key``."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, {})[future] = None
        return future

    def drop(self, key: Hashable, future: asyncio.Future) -> None:
        """Stops waiting (the call timed out or ended); the last waiter of a key takes the key with it."""
        futures = self._waiting.get(key)
        if futures is not None and futures.pop(future, 0) is None and not futures:
            del self._waiting[key]

    def resolve(self, key: Hashable, answer: object) -> None:
        """Hands ``answer`` to every call waiting for ``key``."""
        for future in self._waiting.pop(key, ()):
            if not future.done():
                future.set_result(answer)

    def wake_all(self) -> None:
        """Wakes every waiting call without an answer (each looks again at whether, and what, it may answer)."""
        waiting, self._waiting = self._waiting, {}
        for futures in waiting.values():
            for future in futures:
                if not future.done():
                    future.set_result(WOKEN)


async def resolved_within(future: asyncio.Future, seconds: float) -> object:
    """What ``future`` is resolved with, or None once ``seconds`` passed (a timeout scope: no task per call)."""
    try:
        async with asyncio.timeout(seconds):
            return await future
    except TimeoutError:
        return None
