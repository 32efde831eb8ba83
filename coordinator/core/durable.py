"""What a replay of the journal must give back, as plain values: the run and attempt, the topology and event numbers,
each process's registration, phase and incarnation, the ids, the job's attempts and agents, the key-values, the job's
events and the barriers that ended. ``difference`` compares a live state with one that replayed its journal (the
test suite after every test, ``ifrt-coordinator --check-replay`` at a graceful stop): a decision applied one way live
and another on replay shows there, named.

Left out because the journal does not keep them: liveness (after a replay every process has a grace period to
re-attach), calls still waiting (a pending barrier, a live-set round, a preemption sync) and their clocks.
"""

from __future__ import annotations

from typing import Any

from coordinator.core.state import ClusterState


def durable(state: ClusterState) -> dict[str, Any]:
    """What a replay of ``state``'s journal must give back, part by part."""
    run, attempts = state.current, state.attempts
    admission = run.admission
    return {
        "run": state.run, "attempt": attempts.current, "event position": state.event_position,
        "published at": state.published_at, "topology": admission.topology,
        "members": {uid: (m.registration, m.status, m.incarnation, m.reason, m.replaced)
                    for uid, m in admission.members.items()},
        "process ids": dict(admission.process_ids) if admission.topology is not None else None,
        "job": attempts.view(), "agents": attempts.listed(), "declared": attempts.declared,
        "replacing": sorted(attempts.replacing), "shrunk": sorted(attempts.shrunk),
        "key-values": run.kv.store.dir(""),
        "events": run.history.kept(),
        "barriers ended": {name: (b.participants, b.done, type(b.error).__name__, str(b.error or ""))
                           for name, b in run.barriers.ended().items()},
    }


def difference(live: ClusterState, replayed: ClusterState) -> str | None:
    """The first part in which ``replayed`` differs from ``live`` (both values), or None."""
    ours, theirs = durable(live), durable(replayed)
    for part, value in ours.items():
        if theirs[part] != value:
            return f"{part}: live {value!r}, replayed {theirs[part]!r}"
    return None
