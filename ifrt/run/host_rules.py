"""The pure decisions of an ``ifrt run`` agent that carries its host's workers (``--worker-link agent``): when the
host's pending registrations go to the coordinator as one ``RegisterHost``, which job events a worker's session
still lacks, which worker stopped answering (or is busy), which reports await the coordinator's acknowledgement, and
who watches a key. No threads, clocks, sockets or gRPC here."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
EXITS_KEPT = 1024
"""Unacknowledged exit reports the agent keeps (the oldest goes first past it: a coordinator that never acknowledges
cannot make its agent hold more)."""
BUSY_SHARE = 0.25
"""A silent worker that used at least this share of a core since its silence was last looked at is busy, not hung."""

E = TypeVar("E")


@dataclass(eq=False)
class Ticket(Generic[E]):
    """One client uid's registration waiting to be sent; ``round`` is set to what it was sent with."""

    uid: str
    entry: E
    round: Any = None
    deadline: float = 0.0
    """When the worker's own call ends (its latest ask's)."""


class Batcher(Generic[E]):
    """The host's registrations waiting to be sent (in the order they came), and those in flight."""

    def __init__(self, workers: int, wait_s: float = BATCH_WAIT_S) -> None:
        self.limit = max(1, workers) * PENDING_PER_WORKER
        self.wait_s = wait_s
        self.unsent: dict[str, Ticket[E]] = {}
        self._first_at = 0.0
        self._in_flight: Counter[str] = Counter()

    def join(self, uid: str, entry: E, now: float) -> Ticket[E]:
        """``uid``'s registration, unsent (a uid that asks again before it was sent replaces its entry);
        ResourceExhausted, changing nothing, when the host already has as many pending as its workers may."""
        if (ticket := self.unsent.get(uid)) is not None:
            ticket.entry = entry
            return ticket
        if uid not in self._in_flight and self.pending() >= self.limit:
            raise ResourceExhausted(f"this host's agent holds {self.pending()} pending registrations already: "
                                    f"expected at most {PENDING_PER_WORKER} per worker it started ({self.limit}); "
                                    "a worker registers once per client")
        if not self.unsent:
            self._first_at = now
        ticket = self.unsent[uid] = Ticket(uid, entry)
        return ticket

    def pending(self) -> int:
        """Distinct client uids unsent or in flight."""
        return len(self.unsent.keys() | self._in_flight.keys())

    def due(self, now: float, expected: int) -> bool:
        """Whether unsent registrations go now: every live worker (``expected``) has asked (unsent or in flight),
        or the first unsent one has waited ``wait_s``."""
        if not self.unsent:
            return False
        return self.pending() >= expected or now >= self._first_at + self.wait_s

    def wait(self, now: float) -> float:
        """Seconds until the unsent registrations are due by time alone."""
        return max(0.0, self._first_at + self.wait_s - now) if self.unsent else self.wait_s

    def take(self, most: int, round_: Any) -> list[Ticket[E]]:
        """The first ``most`` unsent registrations (one call may carry no more than the workers the agent runs),
        now in flight with ``round_``; the others stay unsent, as due as they were."""
        taken = [self.unsent.pop(uid) for uid in list(self.unsent)[:max(1, most)]]
        for ticket in taken:
            ticket.round = round_
        self._in_flight.update(t.uid for t in taken)
        return taken

    def answered(self, taken: list[Ticket[E]]) -> None:
        """``taken``'s call returned (answered or failed)."""
        self._in_flight.subtract(t.uid for t in taken)
        self._in_flight = +self._in_flight


def batch_window(asks: Iterable[tuple[float, int]]) -> tuple[float, int]:
    """A batch's call from its registrations' ``(deadline, wait_ms)``: it is retried until the latest deadline (one
    worker's short call does not cut the others' short), and answered within the shortest wait (each worker hears
    within its own)."""
    deadlines, waits = zip(*asks, strict=True)
    return max(deadlines), min(waits)


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


class Ranks:
    """Which registration is each local rank's current worker's: a worker's exit (seen by waitpid, by rank and the
    serial its start got) names its own registration, never its successor's, however late it is seen."""

    def __init__(self) -> None:
        self._serials: dict[int, int] = {}
        self._uids: dict[int, tuple[str, int]] = {}

    def started(self, rank: int) -> int:
        """A worker starts for ``rank`` (or a spare takes it over): its serial."""
        serial = self._serials[rank] = self._serials.get(rank, 0) + 1
        return serial

    def registered(self, rank: int, uid: str) -> None:
        """``rank``'s current worker registered as ``uid``."""
        self._uids[rank] = (uid, self._serials.get(rank, 0))

    def exited(self, rank: int, serial: int) -> str | None:
        """The uid of ``rank``'s worker ``serial``, once; None where it never registered (or was reported)."""
        found = self._uids.get(rank)
        if found is None or found[1] != serial:
            return None
        del self._uids[rank]
        return found[0]


OWN_KINDS = ("process_failed", "process_left", "process_restarted")
"""The job events about one process that a later incarnation of it is not sent on catch-up."""


def not_its_own(events: list[tuple[int, str, int]], process_id: int) -> list[int]:
    """The numbers of the ``(number, kind, process id)`` events a worker of ``process_id`` catching up is sent: all
    but its own from before its current incarnation (up to its latest restart), as the coordinator leaves them out
    of a process's own catch-up."""
    own_since = max((n for n, kind, pid in events if kind == "process_restarted" and pid == process_id), default=0)
    return [n for n, kind, pid in events if not (n <= own_since and kind in OWN_KINDS and pid == process_id)]


def stopped_answering(silent_s: float) -> str:
    """The reason an agent reports a worker whose session stays connected but sends no Heartbeat."""
    return f"stopped answering: no heartbeat for {silent_s:.1f}s while its connection to its agent stayed up"


class Silence:
    """When each worker's session last sent a Heartbeat, and which went silent for longer than it may: hung, unless
    its CPU time advanced meanwhile (one long native call holding the GIL burns CPU; a stuck process burns none)."""

    def __init__(self) -> None:
        self._heard: dict[str, float] = {}
        self._limits: dict[str, float] = {}
        self._reported: set[str] = set()
        self._cpu: dict[str, tuple[float, float]] = {}  # uid -> (its CPU seconds, when read) during a silence

    def start(self, uid: str, now: float, hung_after_s: float) -> None:
        """``uid``'s session is attached; it may be silent ``hung_after_s`` (0: any time)."""
        self._heard[uid] = now
        if hung_after_s > 0:
            self._limits[uid] = hung_after_s

    def heard(self, uid: str, now: float) -> None:
        if uid in self._heard:
            self._heard[uid] = now
            self._cpu.pop(uid, None)

    def stop(self, uid: str) -> None:
        """``uid``'s session ended: its silence is no longer watched."""
        self._heard.pop(uid, None)
        self._limits.pop(uid, None)
        self._cpu.pop(uid, None)

    def silent(self, now: float) -> list[tuple[str, str]]:
        """``(uid, reason)`` of each session silent past its limit, each once (no CPU time seen)."""
        return self.check(now, lambda uid: None)[0]

    def check(self, now: float, cpu: Callable[[str], float | None]
              ) -> tuple[list[tuple[str, str]], list[tuple[str, float]]]:
        """``(uid, reason)`` of each session silent past its limit, each once (hung); and ``(uid, CPU seconds)`` of
        each silent past its limit whose CPU time (``cpu``: None where it cannot be read) advanced by BUSY_SHARE of
        the time since it was read halfway through, or since it was last found busy (busy: watched afresh from now)."""
        hung, busy = [], []
        for uid, limit in self._limits.items():
            silent_s = now - self._heard[uid]
            if uid in self._reported or silent_s < limit / 2:
                continue
            if silent_s < limit:
                if uid not in self._cpu and (seconds := cpu(uid)) is not None:
                    self._cpu[uid] = (seconds, now)
                continue
            seconds, (before, at) = cpu(uid), self._cpu.pop(uid, (None, now))
            if seconds is not None and before is not None and seconds - before >= BUSY_SHARE * (now - at) > 0:
                busy.append((uid, seconds - before))
                self._heard[uid], self._cpu[uid] = now, (seconds, now)
            else:
                self._reported.add(uid)
                hung.append((uid, stopped_answering(silent_s)))
        return hung, busy


class Exits(Generic[E]):
    """The agent's reports of its workers' exits (and hangs) by client uid, each kept until the coordinator
    acknowledged it and sent again on every new stream until then: a report on a stream that broke is not lost."""

    def __init__(self, most: int = EXITS_KEPT) -> None:
        self._pending: dict[str, E] = {}
        self._most = most

    def add(self, uid: str, report: E) -> bool:
        """Keeps ``uid``'s report; False (kept nothing) when one is pending already (the first stands)."""
        if uid in self._pending:
            return False
        self._pending[uid] = report
        while len(self._pending) > self._most:
            del self._pending[next(iter(self._pending))]
        return True

    def pending(self) -> list[E]:
        """The reports not acknowledged yet, oldest first."""
        return list(self._pending.values())

    def acknowledged(self, uid: str) -> None:
        self._pending.pop(uid, None)

    def __contains__(self, uid: object) -> bool:
        return uid in self._pending


class Watches:
    """Which workers watch which key prefixes; each prefix is watched once on the host's session, and no longer once
    no worker watches it. A prefix is acknowledged (its workers told ``watching``) once every watch of it asked for on
    the current stream was answered: an answer to a watch asked before an unwatch is no news."""

    def __init__(self) -> None:
        self._by_prefix: dict[str, set[str]] = {}
        self._asked: Counter[str] = Counter()  # watches asked for on the current stream, not answered yet
        self.acknowledged: set[str] = set()

    def add(self, uid: str, prefix: str) -> bool:
        """``uid`` watches ``prefix``; True when the host's session must ask for it (no worker did before)."""
        first = prefix not in self._by_prefix
        self._by_prefix.setdefault(prefix, set()).add(uid)
        if first:
            self._asked[prefix] += 1
        return first

    def prefixes(self) -> list[str]:
        return sorted(self._by_prefix)

    def reopened(self) -> list[str]:
        """A new stream of the host's session: the prefixes it asks for, each once (nothing is acknowledged on it)."""
        self.acknowledged.clear()
        self._asked = Counter(self._by_prefix)
        return self.prefixes()

    def acknowledge(self, prefix: str) -> set[str]:
        """The coordinator watches ``prefix``: the workers to tell (none while a later ask is unanswered)."""
        if self._asked[prefix] > 0:
            self._asked[prefix] -= 1
        if self._asked[prefix] > 0 or prefix not in self._by_prefix:
            return set()
        self.acknowledged.add(prefix)
        return set(self._by_prefix[prefix])

    def lapse(self) -> dict[str, set[str]]:
        """The host's session broke: changes made until it watches again may be missed. The workers of each prefix
        that was acknowledged, by prefix (they are told); nothing is acknowledged any more."""
        lapsed = {prefix: set(self._by_prefix[prefix]) for prefix in sorted(self.acknowledged)}
        self.acknowledged.clear()
        self._asked.clear()
        return lapsed

    def watching(self, uid: str, prefix: str) -> bool:
        return prefix in self.acknowledged and uid in self._by_prefix.get(prefix, ())

    def for_key(self, key: str) -> set[str]:
        """The workers watching a prefix of ``key``."""
        return {uid for prefix, uids in self._by_prefix.items() if key.startswith(prefix) for uid in uids}

    def drop(self, uids: Iterable[str]) -> list[str]:
        """Those workers' sessions ended: the prefixes no worker watches any more (the host's session unwatches
        them)."""
        gone = set(uids)
        dropped = []
        for prefix, uids_of in list(self._by_prefix.items()):
            uids_of -= gone
            if not uids_of:
                del self._by_prefix[prefix]
                self.acknowledged.discard(prefix)
                dropped.append(prefix)
        return dropped
