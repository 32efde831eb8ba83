"""When the job is whole again after processes were replaced: ``JobWhole`` assembled from a client's own events.

The coordinator tells every session when a process fails or leaves (ProcessFailed, ProcessLeft) and when a new
incarnation takes its id (ProcessRestarted); a new generation that the newcomers' registrations make is numbered
before the restart that completes it, so a process holds it when it hears that restart. A program that re-forms its
own communicators (``ifrt.discover()`` users, no ``ifrt.torch``) needs the moment none is down any more: this reads it
off the events, with no call of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ifrt.events import Event, JobWhole, ProcessFailed, ProcessLeft, ProcessRestarted, TopologyChanged
from ifrt.topology import Topology


@dataclass
class Wholeness:
    """Pure: the processes down now (failed or left, not back since) and those back since the job was last whole."""

    down: set[int] = field(default_factory=set)
    back: dict[int, int] = field(default_factory=dict)
    """Process id -> its incarnation, for each id that came back since the job was last whole."""

    def see(self, event: Event, topology: Topology | None) -> JobWhole | None:
        """The JobWhole that ``event`` completes (``topology``: the one held after it), else None."""
        if isinstance(event, ProcessFailed | ProcessLeft):
            self.down.add(event.process_id)
        elif isinstance(event, ProcessRestarted):
            self.down.discard(event.process_id)
            self.back[event.process_id] = event.incarnation
        elif isinstance(event, TopologyChanged):  # ids it no longer holds (an elastic drop) are no longer awaited
            ids = {p.process_id for p in event.topology.processes}
            self.down &= ids
            self.back = {pid: n for pid, n in self.back.items() if pid in ids}
        else:
            return None
        if self.down or not self.back or topology is None:
            return None
        whole = JobWhole(topology, tuple(ProcessRestarted(pid, n) for pid, n in sorted(self.back.items())))
        self.back = {}
        return whole


def assembling(emit: Callable[[Event], None], topology: Callable[[], Topology | None]) -> Callable[[Event], None]:
    """``emit``, each event followed by the JobWhole it completes (for one session thread: no lock)."""
    wholeness = Wholeness()

    def deliver(event: Event) -> None:
        emit(event)
        if (whole := wholeness.see(event, topology())) is not None:
            emit(whole)

    return deliver
