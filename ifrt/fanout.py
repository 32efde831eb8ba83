"""``Fanout``: hands each event of the live session to every watcher and callback, in order, and keeps the job
events received since the held topology, so a late watcher misses none of them."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ifrt.events import (
    Event,
    JobWhole,
    PreemptionNotice,
    ProcessFailed,
    ProcessLeft,
    ProcessRestarted,
    TopologyChanged,
)

log = logging.getLogger("ifrt.client")

JOB_EVENTS = (ProcessFailed, ProcessLeft, ProcessRestarted, PreemptionNotice, TopologyChanged, JobWhole)
"""What ``since_topology`` keeps: a TopologyChanged begins a new list."""
CLOSED = object()
"""Put in a queue handed out by ``watch`` (or a key watch) when the client closes: the iterator ends."""


class Fanout:
    """The events of one client: watchers (iterators), callbacks, and the job events since the held topology."""

    def __init__(self, kept: int) -> None:
        self._lock = threading.Lock()
        self._dispatch = threading.RLock()  # one event at a time reaches the callbacks, in order
        self._watchers: set[queue.Queue] = set()
        self._callbacks: list[Callable[[Event], None]] = []
        self._since_topology: deque[Event] = deque(maxlen=kept)

    def watch(self, timeout: float | None = None, *, since_topology: bool = False) -> Iterator[Event]:
        """Events from now on until ``timeout`` seconds pass or ``close``; with ``since_topology``, first the job
        events kept since the held topology, none missed or repeated in between."""
        events: queue.Queue = queue.Queue()
        with self._lock:
            for event in self._since_topology if since_topology else ():
                events.put(event)
            self._watchers.add(events)
        return self._drain(events, None if timeout is None else time.monotonic() + timeout)

    def _drain(self, events: queue.Queue, deadline: float | None) -> Iterator[Event]:
        try:
            yield from until(events, deadline)
        finally:
            with self._lock:
                self._watchers.discard(events)

    def on_event(self, callback: Callable[[Event], None], *, since_topology: bool = False) -> None:
        """Calls ``callback(event)`` for every later event (from the session thread); with ``since_topology``,
        first (in this thread) for every job event kept since the held topology, in order."""
        with self._dispatch:
            with self._lock:
                earlier = list(self._since_topology) if since_topology else []
                self._callbacks.append(callback)
            for event in earlier:
                _call(callback, event)

    def since_topology(self) -> list[Event]:
        """The job events received since the held topology, oldest first."""
        with self._lock:
            return list(self._since_topology)

    def emit(self, event: Event) -> None:
        """Hands ``event`` to every watcher and callback (and keeps it if it is a job event)."""
        with self._dispatch:
            with self._lock:
                if isinstance(event, TopologyChanged):
                    self._since_topology.clear()
                if isinstance(event, JOB_EVENTS):
                    self._since_topology.append(event)
                watchers, callbacks = list(self._watchers), list(self._callbacks)
            for events in watchers:
                events.put(event)
            for callback in callbacks:
                _call(callback, event)

    def close(self) -> None:
        """Ends every watcher's iterator."""
        with self._lock:
            watchers = list(self._watchers)
        for events in watchers:
            events.put(CLOSED)


def _call(callback: Callable[[Event], None], event: Event) -> None:
    try:
        callback(event)
    except Exception:
        log.exception("on_event callback %r failed on %r", callback, event)


def until(items: queue.Queue, deadline: float | None) -> Iterator[Any]:
    """What arrives in ``items`` until ``deadline`` (None: no deadline) or until CLOSED arrives."""
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return
        try:
            item = items.get(timeout=remaining)
        except queue.Empty:
            return
        if item is CLOSED:
            return
        yield item
