"""What a session that opens from a job event is sent first: the events it missed, or a snapshot where the history
no longer reaches back. Pure: read off the history and the admission state."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.core.admission import Admission
from coordinator.core.history import CatchUp, GenerationPublished, History, Numbered, Snapshot
from coordinator.core.members import Status
from ifrt.errors import InvalidArgument
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted


def check_since(since: int, head: int) -> None:
    """InvalidArgument when a session opens from job event ``since`` past the latest, ``head``."""
    if since > head:
        raise InvalidArgument(f"the session opened from job event {since}, but the latest event of this cluster "
                              f"is {head}: expected the event_position of a Register answer or the number of an "
                              "event received")


def catch_up(history: History, admission: Admission, published_at: int, incarnated_at: Mapping[int, int],
             notice: PreemptionNotice | None, process_id: int, since: int, generation: int) -> CatchUp:
    """What the session of ``process_id``, holding ``generation`` and opening from job event ``since``, is sent
    before newer events: every event after ``since`` but its own from before its current incarnation
    (``incarnated_at``: process id -> the event number of its latest restart), with the current topology (published
    at event ``published_at``) in place of the generations among them (first, when it holds another and none is
    among them); a snapshot where the history no longer reaches back. InvalidArgument past the latest event."""
    head = history.head
    check_since(since, head)
    assert admission.topology is not None  # a session attaches only once a generation is published
    current = admission.topology.generation
    topology = Numbered(published_at, GenerationPublished(current))
    events = history.since(since)
    if events is None:
        return CatchUp(head, (topology,) if generation != current else (),
                       _snapshot(head, admission, notice, process_id))
    own_since = incarnated_at.get(process_id, 0)
    kept = [n for n in events if not isinstance(n.event, GenerationPublished)
            and not (n.number <= own_since and isinstance(n.event, ProcessFailed | ProcessLeft | ProcessRestarted)
                     and n.event.process_id == process_id)]
    if generation != current:
        kept.append(topology)
        kept.sort(key=lambda n: n.number)  # numbers are unique: a total order
    return CatchUp(head, tuple(kept))


def _snapshot(head: int, admission: Admission, notice: PreemptionNotice | None, process_id: int) -> Snapshot:
    """Each other process's state that differs from the topology, and the preemption notice, as of event ``head``."""
    failed, left, restarted = [], [], []
    for pid in sorted(admission.claims):
        member = admission.member_of(pid)
        if pid == process_id or member is None:
            continue
        if member.status is Status.FAILED:
            failed.append(ProcessFailed(pid, member.reason))
        elif member.status is Status.LEFT:
            left.append(ProcessLeft(pid))
        elif member.incarnation:
            restarted.append(ProcessRestarted(pid, member.incarnation))
    return Snapshot(head, tuple(failed), tuple(left), tuple(restarted), notice)
