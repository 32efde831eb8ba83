"""The operator's view of a cluster (``ifrt status``, metrics): plain values from the state machine, and their
wire form (``StatusResponse``)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from coordinator.core.job_records import Agent
from ifrt._generated import coordinator_pb2 as pb

WAITING = "waiting"
PUBLISHED = "published"
DEGRADED = "degraded"
STANDBY = "standby"
"""The cluster states ``ifrt status`` shows (``standby``: the replica asked does not lead)."""


@dataclass(frozen=True)
class ProcessReport:
    """One registered process (its current incarnation)."""

    process_id: int | None
    """None while ids are assigned and not yet fixed (before publication)."""
    hostname: str
    host_address: str
    local_rank: int
    address: str
    devices: int
    phase: str
    """joining, alive, failed or left."""
    reason: str
    incarnation: int
    heartbeat_age_s: float
    """Since the process was last heard from: its session's last Heartbeat, else its last call (0 while a call of
    it is in flight and no session is open)."""
    attached: bool
    network: tuple[str, ...] = ()
    """Where its host sits in the network, root to leaf (empty: no position)."""
    os_pid: int = 0
    """Its OS pid on its host, as it registered (0: not said)."""


@dataclass(frozen=True)
class StatusReport:
    """What the leading replica's state says, as of one instant."""

    cluster_id: str
    state: str
    """waiting, published or degraded."""
    generation: int
    registered: int
    expected: int
    missing_process_ids: tuple[int, ...]
    """Known only with explicit process ids."""
    waited_s: float
    processes: tuple[ProcessReport, ...]
    sessions_open: int
    heartbeat_timeout_s: float
    slow_after_s: float
    """A process alive whose session has sent no Heartbeat for longer is slow."""

    @property
    def failed(self) -> tuple[ProcessReport, ...]:
        return tuple(p for p in self.processes if p.phase == "failed")

    @property
    def slow(self) -> tuple[ProcessReport, ...]:
        """Processes alive whose session has sent no Heartbeat for more than ``slow_after_s``."""
        return tuple(p for p in self.processes
                     if p.phase == "alive" and p.attached and p.heartbeat_age_s > self.slow_after_s)

    @property
    def max_heartbeat_age_s(self) -> float:
        """The oldest sign of life among processes still joining or alive (0 with none)."""
        return max((p.heartbeat_age_s for p in self.processes if p.phase in ("joining", "alive")), default=0.0)


_CLUSTER_PHASES = {WAITING: pb.CLUSTER_PHASE_WAITING, PUBLISHED: pb.CLUSTER_PHASE_PUBLISHED,
                   DEGRADED: pb.CLUSTER_PHASE_DEGRADED}
_PROCESS_PHASES = {"joining": pb.PROCESS_PHASE_JOINING, "alive": pb.PROCESS_PHASE_ALIVE,
                   "failed": pb.PROCESS_PHASE_FAILED, "left": pb.PROCESS_PHASE_LEFT}


def leader_answer(report: StatusReport, *, fingerprint: str, replica: str, leader: str, store: str,
                  time_to_publish_s: float | None, attempt: int, agents: Iterable[Agent] = (),
                  watching: Collection[str] = ()) -> pb.StatusResponse:
    """The Status answer of the replica that leads (``agents``: the job's, ``watching``: the ids of those whose
    watch is open on it)."""
    return pb.StatusResponse(
        cluster_id=report.cluster_id, state=_CLUSTER_PHASES[report.state], generation=report.generation,
        fingerprint=fingerprint, registered=report.registered, expected=report.expected,
        missing_process_ids=report.missing_process_ids, missing=report.expected - report.registered,
        processes=[_process(p) for p in report.processes], leader=leader, replica=replica, store=store,
        waited_seconds=report.waited_s, time_to_publish_seconds=time_to_publish_s or 0.0,
        sessions_open=report.sessions_open, heartbeat_timeout_seconds=report.heartbeat_timeout_s, attempt=attempt,
        slow_after_seconds=report.slow_after_s,
        agents=[pb.AgentStatus(host=a.host, address=a.address, workers=a.workers, spare=a.spare,
                               joined_unix_s=a.joined_unix_s, watching=a.uid in watching) for a in agents])


def standby_answer(*, cluster_id: str, expected: int, replica: str, leader: str | None, store: str,
                   reason: str, attempt: int) -> pb.StatusResponse:
    """The Status answer of a replica that does not lead: it names the leader its store knows."""
    return pb.StatusResponse(cluster_id=cluster_id, state=pb.CLUSTER_PHASE_STANDBY, expected=expected,
                             leader=leader or "", replica=replica, store=store, reason=reason, attempt=attempt)


def _process(p: ProcessReport) -> pb.ProcessStatus:
    message = pb.ProcessStatus(hostname=p.hostname, host_address=p.host_address, local_rank=p.local_rank,
                               address=p.address, devices=p.devices, phase=_PROCESS_PHASES[p.phase],
                               reason=p.reason, incarnation=p.incarnation, heartbeat_age_seconds=p.heartbeat_age_s,
                               attached=p.attached, network=p.network, os_pid=p.os_pid)
    if p.process_id is not None:
        message.process_id = p.process_id
    return message
