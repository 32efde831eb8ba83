"""The operator's report of a cluster, read off its admission state at one instant. Pure."""

from __future__ import annotations

from coordinator.core.admission import Admission
from coordinator.core.members import Member, Status
from coordinator.core.status import DEGRADED, PUBLISHED, WAITING, ProcessReport, StatusReport


def cluster_report(admission: Admission, now: float) -> StatusReport:
    """The cluster as an operator sees it at ``now``: its state, every current process and its liveness."""
    config = admission.config
    processes = []
    for claim, uid in admission.holder.items():
        member = admission.members[uid]
        r = member.registration
        pid = admission.process_ids.get(claim, r.process_id)
        age = heartbeat_age(member, now)
        processes.append(ProcessReport(pid, r.hostname, r.host_address, r.local_rank, r.address, len(r.devices),
                                       member.status.value, member.reason, member.incarnation, age,
                                       member.sessions > 0, r.network, r.os_pid))
    processes.sort(key=lambda p: (p.process_id is None, p.process_id or 0, p.hostname, p.host_address,
                                  p.local_rank))
    topology = admission.topology
    if topology is None:
        state = WAITING
    else:
        state = DEGRADED if any(p.phase == Status.FAILED.value for p in processes) else PUBLISHED
    return StatusReport(
        cluster_id=config.cluster_id, state=state, generation=topology.generation if topology else 0,
        registered=admission.registered, expected=config.num_processes, missing_process_ids=admission.missing_ids(),
        waited_s=admission.waited_s(now), processes=tuple(processes),
        sessions_open=sum(m.sessions for m in admission.members.values()),
        heartbeat_timeout_s=config.heartbeat_timeout_s, slow_after_s=config.slow_after_s)


def heartbeat_age(member: Member, now: float) -> float:
    """Since the process was last heard from: its session's last Heartbeat (0 for a session that sends none: its
    keepalive vouches for it), else 0 while a call of it waits on us, else since its last call or session ended."""
    if member.sessions:
        return 0.0 if member.heard_at is None else max(0.0, now - member.heard_at)
    return 0.0 if member.calls else max(0.0, now - member.last_seen)
