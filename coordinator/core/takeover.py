"""A lost host taken over by a spare host: the coordinator's own decision, pure (no clock, no I/O), journaled by the
router (``ClusterState``) as ``journal.HostTakenOver`` so that a failover replays it and decides nothing twice.

A host is lost when its agent has not watched the job for longer than the heartbeat timeout (``absent``, as the
shell counts it) and the coordinator declared a process of that host failed in the current attempt with no
replacement asked for it: nobody on that host will replace it. Then a spare host (``ifrt run --spare-host``), the
first of the job's that watches and can run as many workers, takes over every process id of the lost host: its
workers, and nobody else's, may register under those ids (``Admission.grant``). The takeover counts against the
restart budget as one replacement; with the budget spent, the restarts are exhausted instead. The lost host's
processes still within their grace are failed with the takeover (``ClusterState.take_over_host``), so that no later
failure names an id the spare host holds. Without a spare host
the job waits: the survivors' agents give up after their ``--replace-timeout`` (``ifrt.run.agent``).

    host B's agent absent + B's process declared failed ──(a spare host C watches)──▶ C runs B's ids
                                                        └─(no spare host)──▶ wait, logged; the agents' timeout
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from coordinator.core import journal
from coordinator.core.job_records import Agent, AttemptFailure, Host
from coordinator.core.limits import shown


@dataclass(frozen=True)
class LostHost:
    """An agent of the job gone with its host: the process ids registered from it, and the failure declared first."""

    agent: Agent
    process_ids: tuple[int, ...]
    failure: AttemptFailure

    def describe(self) -> str:
        return (f"host {shown(self.agent.host)} ({self.agent.address}, processes "
                f"{', '.join(map(str, self.process_ids))})")


def find_lost(agents: Iterable[Agent], absent: frozenset[str], declared: dict[int, AttemptFailure],
               ids_of: Callable[[Host], tuple[int, ...]]) -> list[LostHost]:
    """The job's agents (no spare hosts) that are ``absent`` while a process registered from their host is among the
    ``declared`` failures of the attempt (none replaced since); ``ids_of``: the process ids registered from a host."""
    lost = []
    for agent in agents:
        if agent.spare or agent.uid not in absent:
            continue
        ids = ids_of(agent.where)
        failed = [declared[pid] for pid in ids if pid in declared]
        if failed:
            lost.append(LostHost(agent, ids, failed[0]))
    return lost


def decide(lost: list[LostHost], agents: Iterable[Agent], absent: frozenset[str], *, attempt: int,
           exhausted_now: bool) -> journal.HostTakenOver | None:
    """The takeover to journal: the first lost host and the first spare host (in join order) that watches and can
    run all its ids; None when there is none (the job waits). ``exhausted_now``: the restart budget is spent, so the
    decision ends the restarts instead."""
    spares = [a for a in agents if a.spare and a.uid not in absent]
    for host in lost:
        spare = next((a for a in spares if a.workers >= len(host.process_ids)), None)
        if spare is None:
            continue
        reason = (f"host {host.agent.host} lost (its agent gone, {host.failure.reason}); spare host {spare.host} "
                  f"({spare.address}) takes over processes {', '.join(map(str, host.process_ids))}")
        return journal.HostTakenOver(attempt, host.agent.uid, spare.uid, host.process_ids, host.agent.host, reason,
                                     exhausted_now)
    return None
