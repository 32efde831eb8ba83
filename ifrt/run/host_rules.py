"""The pure decisions of an ``ifrt run`` agent that carries its host's workers (``--worker-link agent``): when the
host's pending registrations go to the coordinator as one ``RegisterHost``, which job events a worker's session
still lacks, which worker stopped answering, and who watches a key. No threads, clocks, sockets or gRPC here."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ifrt.errors import ResourceExhausted

BATCH_WAIT_S = 0.2
"""How long the first unsent registration waits for the host's other workers: a slow one does not hold it back."""
PENDING_PER_WORKER = 4
"""Registrations (client uids) a host may have pending per worker its agent started: a worker that loops on new
clients cannot make its agent hold more."""
EVENTS_KEPT = 4096
"""Job events the agent keeps for its workers' catch-up (a worker asking from before them registers again)."""
EVENT_BYTES_KEPT = 16 << 20
"""... and at most this many bytes of them."""

E = TypeVar("E")


@dataclass
class Round(Generic[E]):
    """The registrations sent together in one ``RegisterHost`` call, by client uid (a uid that asks again while the
    round is unsent replaces its entry)."""

    entries: dict[str, E] = field(default_factory=dict)
    opened_at: float = 0.0
    sent: bool = False


class Batcher(Generic[E]):
    """The host's registrations that wait to be sent: one unsent round at a time, any number in flight."""

    def __init__(self, workers: int, wait_s: float = BATCH_WAIT_S) -> None:
        self.limit = max(1, workers) * PENDING_PER_WORKER
        self.wait_s = wait_s
        self.current: Round[E] = Round()
        self._in_flight: Counter[str] = Counter()

    def join(self, uid: str, entry: E, now: float) -> Round[E]:
        """Adds ``uid``'s registration to the unsent round (which it returns); ResourceExhausted, changing nothing,
        when the host already has as many pending as its workers may."""
        if uid not in self.current.entries and uid not in self._in_flight and self.pending() >= self.limit:
            raise ResourceExhausted(f"this host's agent holds {self.pending()} pending registrations already: "
                                    f"expected at most {PENDING_PER_WORKER} per worker it started ({self.limit}); "
                                    "a worker registers once per client")
        if not self.current.entries:
            self.current.opened_at = now
        self.current.entries[uid] = entry
        return self.current

    def pending(self) -> int:
        """Distinct client uids unsent or in flight."""
        return len(self.current.entries.keys() | self._in_flight.keys())

    def due(self, now: float, expected: int) -> bool:
        """Whether the unsent round goes now: every live worker (``expected``) has asked (unsent or in flight), or
        the first of it has waited ``wait_s``."""
        if not self.current.entries:
            return False
        return self.pending() >= expected or now >= self.current.opened_at + self.wait_s

    def wait(self, now: float) -> float:
        """Seconds until the unsent round is due by time alone."""
        return max(0.0, self.current.opened_at + self.wait_s - now) if self.current.entries else self.wait_s

    def take(self) -> Round[E]:
        """The unsent round, now in flight; a new one opens."""
        taken, self.current = self.current, Round()
        taken.sent = True
        self._in_flight.update(taken.entries.keys())
        return taken

    def answered(self, taken: Round[E]) -> None:
        """``taken``'s call returned (answered or failed)."""
        self._in_flight.subtract(taken.entries.keys())
        self._in_flight = +self._in_flight


class EventBuffer:
    """The job events of the host's session, by number, for workers that attach later: the newest ``count`` (and
    ``max_bytes``) of them; ``floor`` is the number of the last event no longer kept (or the one it opened from)."""

    def __init__(self, floor: int, count: int = EVENTS_KEPT, max_bytes: int = EVENT_BYTES_KEPT) -> None:
        self.floor = floor
        self.head = floor
        self._count, self._max_bytes = count, max_bytes
        self._events: deque[tuple[int, bytes]] = deque()
        self._bytes = 0

    def add(self, number: int, raw: bytes) -> bool:
        """Keeps event ``number``; False (kept nothing) for one it has already."""
        if number <= self.head:
            return False
        self._events.append((number, raw))
        self._bytes += len(raw)
        self.head = number
        while len(self._events) > self._count or (self._bytes > self._max_bytes and len(self._events) > 1):
            gone, raw_gone = self._events.popleft()
            self._bytes -= len(raw_gone)
            self.floor = gone
        return True

    def since(self, number: int) -> list[tuple[int, bytes]] | None:
        """Every kept event after ``number``, oldest first; None when some after it are no longer kept."""
        if number < self.floor:
            return None
        return [(n, raw) for n, raw in self._events if n > number]

    def reset(self, number: int) -> None:
        """Forgets every event: the next ones follow ``number`` (a snapshot stood for what came before)."""
        self._events.clear()
        self._bytes = 0
        self.floor = self.head = number


def stopped_answering(silent_s: float) -> str:
    """The reason an agent reports a worker whose session stays connected but sends no Heartbeat."""
    return f"stopped answering: no heartbeat for {silent_s:.1f}s while its connection to its agent stayed up"


class Silence:
    """When each worker's session last sent a Heartbeat, and which went silent for longer than it may."""

    def __init__(self) -> None:
        self._heard: dict[str, float] = {}
        self._limits: dict[str, float] = {}
        self._reported: set[str] = set()

    def start(self, uid: str, now: float, hung_after_s: float) -> None:
        """``uid``'s session is attached; it may be silent ``hung_after_s`` (0: any time)."""
        self._heard[uid] = now
        if hung_after_s > 0:
            self._limits[uid] = hung_after_s

    def heard(self, uid: str, now: float) -> None:
        if uid in self._heard:
            self._heard[uid] = now

    def stop(self, uid: str) -> None:
        """``uid``'s session ended: its silence is no longer watched."""
        self._heard.pop(uid, None)
        self._limits.pop(uid, None)

    def silent(self, now: float) -> list[tuple[str, str]]:
        """``(uid, reason)`` of each session silent past its limit, each once."""
        found = []
        for uid, limit in self._limits.items():
            silent_s = now - self._heard[uid]
            if silent_s >= limit and uid not in self._reported:
                self._reported.add(uid)
                found.append((uid, stopped_answering(silent_s)))
        return found


class Watches:
    """Which workers watch which key prefixes; each prefix is watched once on the host's session."""

    def __init__(self) -> None:
        self._by_prefix: dict[str, set[str]] = {}
        self.acknowledged: set[str] = set()

    def add(self, uid: str, prefix: str) -> bool:
        """``uid`` watches ``prefix``; True when the host's session must ask for it (no worker did before)."""
        first = prefix not in self._by_prefix
        self._by_prefix.setdefault(prefix, set()).add(uid)
        return first

    def prefixes(self) -> list[str]:
        return sorted(self._by_prefix)

    def acknowledge(self, prefix: str) -> set[str]:
        """The coordinator watches ``prefix``: the workers to tell."""
        self.acknowledged.add(prefix)
        return set(self._by_prefix.get(prefix, ()))

    def watching(self, uid: str, prefix: str) -> bool:
        return prefix in self.acknowledged and uid in self._by_prefix.get(prefix, ())

    def for_key(self, key: str) -> set[str]:
        """The workers watching a prefix of ``key``."""
        return {uid for prefix, uids in self._by_prefix.items() if key.startswith(prefix) for uid in uids}

    def drop(self, uids: Iterable[str]) -> None:
        """Those workers' sessions ended (the host's session keeps watching; nobody is told)."""
        gone = set(uids)
        for uids_of in self._by_prefix.values():
            uids_of -= gone
