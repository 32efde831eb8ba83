"""The coordinator's answers in wire form, each serialized once and sent as the same bytes to every receiver: a
published generation, job events, snapshots and progress."""

from __future__ import annotations

import logging

from coordinator.core.effects import WaitingForHolder, WaitingForNextRun
from coordinator.core.history import Numbered, Snapshot
from coordinator.core.limits import shown
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.progress import Progress
from ifrt.records import TopologyContent

log = logging.getLogger("ifrt.coordinator")


class PublishedGeneration:
    """The current generation's bytes: the shared part of every Register answer and the session event, made once."""

    def __init__(self) -> None:
        self.generation = 0
        self.fingerprint = ""
        self.position = 0
        """The job event number of its publication."""
        self.attempt = self.run = 0
        self.answer_tail = b""  # Register answer minus process_id
        self.event = b""  # SessionEvent(topology_changed)

    def sync(self, topology: TopologyContent | None, position: int, attempt: int, run: int) -> None:
        """Serializes ``topology`` (published at job event ``position`` in ``run`` of ``attempt``) once, when it is
        new."""
        if topology is None or (topology.generation, attempt, run) == (self.generation, self.attempt, self.run):
            return
        canonical = wire.encode(topology)
        fingerprint = wire.fingerprint(canonical)
        encoding, payload = wire.compress(canonical)
        shared = pb.RegisterResponse(topology=payload, encoding=encoding, fingerprint=fingerprint,
                                     generation=topology.generation, event_position=position, attempt=attempt,
                                     run=run)
        self.answer_tail = shared.SerializeToString()
        self.event = pb.SessionEvent(topology_changed=shared, event_number=position).SerializeToString()
        self.generation, self.fingerprint, self.position = topology.generation, fingerprint, position
        self.attempt, self.run = attempt, run
        log.info("published generation %d: %d processes, %d devices, %d bytes (%d sent), fingerprint %s",
                 topology.generation, len(topology.processes), len(topology.devices), len(canonical), len(payload),
                 fingerprint[:16], extra={"event": "published", "generation": topology.generation,
                                          "fingerprint": fingerprint})
        unplaced = [p for p in topology.processes if not p.network]
        if unplaced and len(unplaced) < len(topology.processes):
            log.warning("generation %d: %d processes have no network position and come before every process that has "
                        "one in the network order: %s%s (give their hosts IFRT_NETWORK_NODES, or node labels)",
                        topology.generation, len(unplaced),
                        ", ".join(f"{p.process_id} on {shown(p.hostname)}" for p in unplaced[:8]),
                        " ..." if len(unplaced) > 8 else "", extra={"event": "hosts_without_position"})

    def answer(self, process_id: int) -> bytes:
        """The Register answer of ``process_id``: concatenated protobuf messages parse as one, so the per-process
        field, then the shared bytes."""
        return pb.RegisterResponse(process_id=process_id).SerializeToString() + self.answer_tail


def progress_answer(p: Progress, most_hosts: int) -> bytes:
    """A Register answer that says who is still missing (listing at most ``most_hosts`` registered hosts)."""
    return pb.RegisterResponse(progress=pb.Progress(
        registered=p.registered, expected=p.expected, missing_process_ids=p.missing_process_ids,
        registered_hosts=p.registered_hosts[:most_hosts], waited_seconds=p.waited_seconds,
    )).SerializeToString()


def waiting_answer(w: WaitingForHolder, expected: int, waited_s: float) -> bytes:
    """A Register answer for a registration that waits for its id's holder to attach or fail: not registered, and
    what it waits for (in the hosts' place, where every client shows it)."""
    return pb.RegisterResponse(progress=pb.Progress(
        registered=0, expected=expected, registered_hosts=[w.describe()], waited_seconds=waited_s,
    )).SerializeToString()


def next_run_answer(w: WaitingForNextRun, waited_s: float) -> bytes:
    """A Register answer for a registration that waits for the job's next run: none of it registered yet, and who
    of the finishing run is still live (in the hosts' place, where every client shows it)."""
    return pb.RegisterResponse(progress=pb.Progress(
        registered=0, expected=w.expected, registered_hosts=[w.describe()], waited_seconds=waited_s,
    )).SerializeToString()


def event_message(numbered: Numbered) -> tuple[int, bytes]:
    """A job event's number and the SessionEvent every session is sent for it (the same bytes for each)."""
    match numbered.event:
        case ProcessFailed(process_id=pid, reason=reason):
            message = pb.SessionEvent(process_failed=pb.ProcessEvent(process_id=pid, reason=reason))
        case ProcessRestarted(process_id=pid, incarnation=incarnation):
            message = pb.SessionEvent(process_restarted=pb.ProcessEvent(process_id=pid, incarnation=incarnation))
        case ProcessLeft(process_id=pid):
            message = pb.SessionEvent(process_left=pb.ProcessEvent(process_id=pid))
        case PreemptionNotice(process_id=pid):
            message = pb.SessionEvent(preemption_notice=pb.ProcessEvent(process_id=pid))
        case _:
            raise AssertionError(f"not a process event: {numbered.event!r}")
    message.event_number = numbered.number
    return numbered.number, message.SerializeToString()


def snapshot_message(snapshot: Snapshot) -> bytes:
    """The SessionEvent that stands for the events up to ``snapshot.position`` a session can no longer be sent."""
    message = pb.EventSnapshot(
        failed=[pb.ProcessEvent(process_id=e.process_id, reason=e.reason) for e in snapshot.failed],
        left=[pb.ProcessEvent(process_id=e.process_id) for e in snapshot.left],
        restarted=[pb.ProcessEvent(process_id=e.process_id, incarnation=e.incarnation) for e in snapshot.restarted])
    if snapshot.preemption is not None:
        message.preemption_notice.process_id = snapshot.preemption.process_id
    return pb.SessionEvent(snapshot=message, event_number=snapshot.position).SerializeToString()
