"""The runs of one job on a coordinator that outlives them, decided without I/O: when a run is over, and what a
registration that must wait for the next run is told.

    run R published ──(every process of it left or failed)──▶ over ──(the next registration)──▶ run R+1 (empty)
         │
         └──(a process left: the run is finishing)──▶ registrations wait for run R+1; live ids stay refused

A run is one formation of the job's topology and its life: its registrations, key-values, barriers and start-up
keys. The router (``ClusterState``) journals the start of each run (``journal.RunStarted``) and starts every
sub-machine but the job's attempts afresh, as a new attempt does; keys under the agents' prefix (torchrun's
rendezvous, which outlives the workers it restarts) carry over.
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.core.admission import Admission
from coordinator.core.effects import WaitingForNextRun

FIRST_RUN = 1
STILL_LIVE_NAMED = 8
"""Processes of a finishing run a waiting registration is told about (the rest are counted)."""


def over(admission: Admission, down: Mapping[int, str]) -> bool:
    """Whether the published run is over: every process id of it is ``down`` (its process failed or left) or held by
    a restarted process still waiting for a generation (which does not keep the run going). O(restarts waiting):
    asked on every departure and tick."""
    if admission.topology is None:
        return False
    waiting = sum(1 for uid in admission.pending
                  if (m := admission.members[uid]).live and admission.process_id(m) not in down)
    return len(down) + waiting >= len(admission.claims)


def waiting(admission: Admission, run: int) -> WaitingForNextRun:
    """What a registration that waits for the next run is told: the run's processes still live, by process id."""
    live = sorted(((pid, m) for pid in admission.claims
                   if (m := admission.member_of(pid)) is not None and m.live and m.uid not in admission.pending),
                  key=lambda pair: pair[0])
    named = tuple(f"{pid} ({m.registration.describe()})" for pid, m in live[:STILL_LIVE_NAMED])
    return WaitingForNextRun(run, admission.config.num_processes, named, len(live))
