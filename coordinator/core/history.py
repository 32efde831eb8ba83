"""The job's events, numbered and bounded: what a session that opens from a position is sent, decided without I/O.

Events are numbered 1, 2, ... in the order the state machine decides them. Only events take numbers (key-values and
barriers take none), and every event follows from a journal entry that compaction keeps (a registration, a failure,
a departure, a preemption notice), so a replay, whole or compacted, rebuilds the same history with the same numbers.

    #1 generation 1   #2 process 3 failed   #3 process 3 restarted   #4 generation 2   ...
    a process holding generation 1 (published at #1) opens from 1 and is sent #2, #3, #4, then what follows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted


@dataclass(frozen=True)
class GenerationPublished:
    """A topology generation was published (a session is sent the current topology in its place)."""

    generation: int


JobEvent = ProcessFailed | ProcessLeft | ProcessRestarted | PreemptionNotice | GenerationPublished


@dataclass(frozen=True)
class Numbered:
    number: int
    event: JobEvent


@dataclass(frozen=True)
class Snapshot:
    """What a session is sent instead of events the history no longer holds: each process's state that differs from
    the topology, as of event ``position``."""

    position: int
    failed: tuple[ProcessFailed, ...] = ()
    left: tuple[ProcessLeft, ...] = ()
    restarted: tuple[ProcessRestarted, ...] = ()
    preemption: PreemptionNotice | None = None


@dataclass(frozen=True)
class CatchUp:
    """What a session opening from a position is sent, in order: a snapshot (when the history is too short) or the
    events after the position; then the events numbered above ``head``, as they come."""

    head: int
    events: tuple[Numbered, ...] = ()
    snapshot: Snapshot | None = None


class History:
    """The last ``most`` job events and the number of the latest."""

    def __init__(self, most: int, first: int = 0) -> None:
        """``first``: the number of the last event before this history (a run's events go on from the run before,
        so a position never goes back within a journal)."""
        self._events: deque[Numbered] = deque(maxlen=most)
        self.head = first
        """The number of the latest event (0: none yet)."""

    def add(self, event: JobEvent) -> int:
        """Numbers ``event`` and keeps it (dropping the oldest past the bound); returns its number."""
        self.head += 1
        self._events.append(Numbered(self.head, event))
        return self.head

    def kept(self) -> list[Numbered]:
        """Every event still kept, oldest first."""
        return list(self._events)

    def since(self, position: int) -> list[Numbered] | None:
        """Every event numbered above ``position``, oldest first; None when some of them are no longer kept."""
        if position >= self.head:
            return []
        oldest = self._events[0].number if self._events else self.head + 1
        if position + 1 < oldest:
            return None
        return list(islice(self._events, position + 1 - oldest, None))
