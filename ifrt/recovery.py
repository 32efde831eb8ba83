"""In-place recovery's view of the job (``ifrt run --recover replace``): which processes failed and are not replaced
yet, from the client's events, and the wait until every process of the job is live again.

A runtime that re-forms its groups in place (``ifrt.torch.recover``) marks where its group began (``mark``); a
recovery then waits until at least one process failed since that mark and no process is down (each failed one
replaced, or dropped by a new generation: the job shrank to its survivors). Every wait is
bounded and says every few seconds, then in its timeout error, which processes it waits for.
"""

from __future__ import annotations

import logging
import threading
import time

from ifrt import events, waiting
from ifrt.client import Client
from ifrt.errors import DiscoveryTimeout
from ifrt.waiting import Pacer


class Peers:
    """The processes of ``client``'s job that are down now (failed or left, neither replaced nor dropped by a new
    generation since), and every failure seen, in order; fed by the client's events from its topology on."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self._changed = threading.Condition()
        self._down: dict[int, str] = {}
        self._failures: list[tuple[int, str]] = []  # bounded by the job's restart budget: each failure is replaced
        self._generation = client.topology.generation if client.topology is not None else 0
        client.on_event(self._on_event, since_topology=True)

    def _on_event(self, event: events.Event) -> None:
        with self._changed:
            if isinstance(event, events.ProcessFailed | events.ProcessLeft):
                why = f"failed: {event.reason}" if isinstance(event, events.ProcessFailed) else "left"
                self._down[event.process_id] = why
                self._failures.append((event.process_id, why))
            elif isinstance(event, events.ProcessRestarted):
                self._down.pop(event.process_id, None)
            elif isinstance(event, events.TopologyChanged):  # a process it drops (a shrink) is no longer awaited
                ids = {p.process_id for p in event.topology.processes}
                self._down = {pid: why for pid, why in self._down.items() if pid in ids}
                self._generation = max(self._generation, event.topology.generation)
            else:
                return
            self._changed.notify_all()

    def mark(self) -> int:
        """Where a group begins: the failures seen so far."""
        with self._changed:
            return len(self._failures)

    def wait_failed(self, since: int, timeout: float) -> dict[int, str]:
        """The processes that failed since the mark ``since``, waiting up to ``timeout`` for the coordinator to
        declare one (a peer's death breaks a collective before the coordinator decides); empty if none did."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._failures) > since, timeout)
            return dict(self._failures[since:])

    def wait_whole(self, since: int, deadline: float, who: str, *, failed_first: bool = True) -> int:
        """Waits until a process failed since the mark ``since`` (unless not ``failed_first``: a group re-formed for
        a process that joins) and none is down; returns the mark then. DiscoveryTimeout at ``deadline`` naming the
        processes still down (or that none failed), said every few seconds meanwhile (``who``: this process, for the
        lines)."""
        config = self.client.config
        pacer = Pacer(config.first_report_s, config.poll_s)
        with self._changed:
            while not ((len(self._failures) > since or not failed_first) and not self._down):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DiscoveryTimeout(f"recovery of {who} timed out after {pacer.waited():.0f}s: "
                                           f"{self._missing()}")
                if pacer.due():
                    waited = pacer.waited()
                    waiting.say(logging.WARNING if waited >= config.warn_after_s else logging.INFO,
                                "recovery of %s waiting (%.0fs so far, %.0fs left): %s", who, waited, remaining,
                                self._missing())
                self._changed.wait(min(remaining, config.poll_s))
            return len(self._failures)

    def wait_generation(self, generation: int, deadline: float) -> bool:
        """Waits until this process holds topology ``generation`` or a later one (another process saw it first);
        whether it does by ``deadline``."""
        with self._changed:
            return self._changed.wait_for(lambda: self._generation >= generation,
                                          max(0.0, deadline - time.monotonic()))

    def _missing(self) -> str:
        if self._down:
            return "processes not replaced yet: " + ", ".join(f"{p} ({why})" for p, why in sorted(self._down.items()))
        return "no process failed since the group started: nothing to recover from (a collective failed on its own)"
