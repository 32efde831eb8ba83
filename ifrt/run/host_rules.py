"""The pure decisions of an ``ifrt run`` agent that carries its host's workers (``--worker-link agent``): when the
host's pending registrations go to the coordinator as one ``RegisterHost`` and which call answers a worker's ask,
which job events a worker's session still lacks, which worker stopped answering (or is busy), which reports await the
coordinator's acknowledgement, and who watches a key. No threads, clocks, sockets or gRPC here."""

from __future__ import annotations

import hmac
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ifrt.errors import PermissionDenied, ResourceExhausted

BATCH_WAIT_S = 0.2
"""How long the first unsent registration waits for the host's other workers: a slow one does not hold it back."""
PROGRESS_KEPT_S = 8.0
"""How long the host's latest progress answer may answer a worker whose registration rides on a call that outlives
the worker's own wait: while its workers wait, a host's calls come back at least every long poll (5 s); an older one
means none came back (a coordinator out of reach), and the worker waits for its call or its own deadline."""
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
    """One client uid's registration and the asks (its worker's Register calls to the agent) waiting on it until a
    call that carries the uid comes back; ``answer`` is what that call said of this uid."""

    uid: str
    entry: E
    round: Any = None
    """The latest call it went with."""
    deadline: float = 0.0
    """When its asks' calls end (the latest's)."""
    wait_until: float = math.inf
    """When the coordinator would have answered its latest ask's own call (that call's ``wait_ms``)."""
    asks: int = 0
    answer: Any = None
    owner: str = ""
    """The proof of the process secret its asks carry."""


class Batcher(Generic[E]):
    """The host's registrations: those waiting to be sent (in the order they came), those in flight, and the latest
    progress answer. A uid that a call in flight carries sends no call of its own: its ask waits for a call that
    carries it (each call carries every uid still asking within its wait) and gets what that call says of it, or,
    once its own wait is over, the host's latest progress answer."""

    def __init__(self, workers: int, wait_s: float = BATCH_WAIT_S, kept_s: float = PROGRESS_KEPT_S) -> None:
        self.limit = max(1, workers) * PENDING_PER_WORKER
        self.wait_s, self.kept_s = wait_s, kept_s
        self.unsent: dict[str, Ticket[E]] = {}
        self.asking: dict[str, Ticket[E]] = {}
        """The unanswered ticket of each uid whose asks wait (unsent ones included): one per uid."""
        self.epoch = 0
        """One more at each ``forget``: a progress answer to a call taken before is kept no more."""
        self._first_at = 0.0
        self._in_flight: Counter[str] = Counter()
        self._owners: dict[str, str] = {}  # uid -> the proof it is in flight with
        self._progress: tuple[Any, float] | None = None

    def join(self, uid: str, entry: E, now: float, wait_until: float = math.inf, deadline: float = 0.0,
             owner: str = "") -> Ticket[E]:
        """An ask of ``uid``'s registration, carrying the proof ``owner``: the ticket it waits on. A uid asking already
        shares its ticket (its entry replaced); one that a call in flight carries waits on that call, sending nothing;
        any other is unsent. Changing nothing, PermissionDenied when another proof asks or is in flight for ``uid`` (it
        would get another process's answer), ResourceExhausted when the host already has as many pending as its
        workers may."""
        ticket = self.asking.get(uid)
        held_by = ticket.owner if ticket is not None else self._owners.get(uid)
        if held_by is not None and not hmac.compare_digest(held_by, owner):
            raise PermissionDenied(f"client {uid!r} is another process's: this call's process secret is not the one "
                                   "its registration carried")
        if ticket is None:
            if uid not in self._in_flight and uid not in self.unsent and self.pending() >= self.limit:
                raise ResourceExhausted(f"this host's agent holds {self.pending()} pending registrations already: "
                                        f"expected at most {PENDING_PER_WORKER} per worker it started ({self.limit}); "
                                        "a worker registers once per client")
            ticket = self.asking[uid] = Ticket(uid, entry, wait_until=wait_until, owner=owner)
            if uid not in self._in_flight:  # news, or a re-poll that no call in flight carries
                if not self.unsent:
                    self._first_at = now
                self.unsent[uid] = ticket
        ticket.entry = entry
        ticket.asks += 1
        ticket.deadline = max(ticket.deadline, deadline)
        ticket.wait_until = max(ticket.wait_until, wait_until) if ticket.asks > 1 else wait_until
        return ticket

    def leave(self, ticket: Ticket[E]) -> None:
        """An ask of ``ticket`` stops waiting (answered, or its own time is over); an unsent ticket still goes."""
        ticket.asks -= 1
        if ticket.asks <= 0 and self.asking.get(ticket.uid) is ticket:
            del self.asking[ticket.uid]

    def drop(self, uid: str) -> None:
        """``uid``'s worker exited: its registration is neither sent nor carried any more."""
        self.asking.pop(uid, None)
        self.unsent.pop(uid, None)

    def pending(self) -> int:
        """Distinct client uids unsent or in flight."""
        return len(self.unsent.keys() | self._in_flight.keys())

    def due(self, now: float, expected: int) -> bool:
        """Whether unsent registrations go now: every live worker still awaited (``expected``: those with no admitted
        registration, or asking again) has asked (unsent or in flight), or the first unsent one has waited
        ``wait_s``."""
        if not self.unsent:
            return False
        return self.pending() >= expected or now >= self._first_at + self.wait_s

    def wait(self, now: float) -> float:
        """Seconds until the unsent registrations are due by time alone (none unsent: never)."""
        return max(0.0, self._first_at + self.wait_s - now) if self.unsent else math.inf

    def take(self, most: int, round_: Any, now: float | None = None) -> list[Ticket[E]]:
        """The first ``most`` unsent registrations (one call may carry no more than the workers the agent runs),
        now in flight with ``round_``; the others stay unsent, as due as they were. Given ``now``, the call also
        carries, up to ``most`` in all, every other uid still asking within its wait (its ask waits on an earlier
        call): the host's asks are answered together, by the first of their calls to come back."""
        taken = [self.unsent.pop(uid) for uid in list(self.unsent)[:max(1, most)]]
        if now is not None:
            sent = {t.uid for t in taken}
            carried = [t for uid, t in self.asking.items()
                       if uid not in sent and uid not in self.unsent and t.wait_until > now]
            taken += carried[:max(0, most - len(taken))]
        for ticket in taken:
            ticket.round = round_
            self._owners[ticket.uid] = ticket.owner
        self._in_flight.update(t.uid for t in taken)
        return taken

    def window(self, taken: list[Ticket[E]], now: float) -> tuple[float, float]:
        """A call's ``(deadline, wait_s)``: retried until its asks' latest deadline (one worker's short call does not
        cut the others' short) and answered within their shortest wait; or, while the host's latest progress answer
        stays fresh, up to their longest: an ask whose wait ends first gets that answer then and asks again on the
        same call, so that the host's workers come back together."""
        deadline = max(t.deadline for t in taken)
        ends = [min(t.wait_until, t.deadline) for t in taken]
        ends_at = min(ends)
        if self._progress is not None:
            ends_at = max(ends_at, min(max(ends), self._progress[1] + self.kept_s))
        return deadline, max(0.0, ends_at - now)

    def covered(self, uid: str) -> bool:
        """Whether a call in flight carries ``uid``."""
        return uid in self._in_flight

    def asks(self, uid: str) -> bool:
        """Whether ``uid``'s registration is unsent or in flight."""
        return uid in self.unsent or uid in self._in_flight

    def answered(self, taken: list[Ticket[E]], answers: Mapping[str, Any] | None = None,
                 failed: Any = None) -> list[Ticket[E]]:
        """``taken``'s call came back, with ``answers`` by uid or ``failed``. The tickets it answers, no longer asking:
        its uids' asking tickets, whenever they asked, each with what the call says of its uid (the coordinator's
        answer to that very registration); ``failed`` only those that no other call in flight carries (the others
        wait for that one)."""
        self._in_flight.subtract(t.uid for t in taken)
        self._in_flight = +self._in_flight
        for gone in {t.uid for t in taken} - self._in_flight.keys():
            self._owners.pop(gone, None)
        done = []
        for uid in dict.fromkeys(t.uid for t in taken):
            ticket = self.asking.get(uid)
            if ticket is None or uid in self.unsent:
                continue
            if answers is not None and uid in answers:
                ticket.answer = answers[uid]
            elif failed is not None and uid not in self._in_flight:
                ticket.answer = failed
            else:
                continue
            del self.asking[uid]
            done.append(ticket)
        return done

    def keep(self, progress: Any, now: float, epoch: int) -> None:
        """The latest progress answer, of a call taken in ``epoch`` (one taken before the last ``forget`` is not)."""
        if epoch == self.epoch:
            self._progress = (progress, now)

    def forget(self) -> None:
        """No progress answer kept so far answers anyone: a topology came (what follows is another generation, run or
        attempt), or a worker started (its answers come from the coordinator)."""
        self._progress = None
        self.epoch += 1

    def kept(self, ticket: Ticket[E], now: float) -> Any | None:
        """What answers an ask of ``ticket`` whose own wait is over while a call in flight still carries its uid: the
        host's latest progress answer while fresh; None (the ask waits on) otherwise."""
        if self._progress is None or ticket.uid not in self._in_flight or ticket.uid in self.unsent:
            return None
        progress, at = self._progress
        return progress if now - at <= self.kept_s else None


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

    def current(self) -> list[str]:
        """The uids of the ranks whose current worker registered."""
        return [uid for rank, (uid, serial) in self._uids.items() if serial == self._serials.get(rank, 0)]

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
        self._asked = Counter(self._by_prefix.keys())  # one ask of each prefix
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
