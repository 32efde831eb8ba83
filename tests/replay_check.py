"""Live and replayed agree: every ``ClusterState`` a test drives is, when the test ends, compared with a fresh one that
replayed everything it journaled (as a coordinator taking over would), on what the journal promises to bring back:
the run and attempt, the topology and event numbers, each process's registration, phase and incarnation, the ids,
the job's attempts and agents, the key-values, the job's events and the barriers that ended. A decision applied one
way live and another on replay fails the test that made it, naming what differs.

Left out because the journal does not keep them: liveness (after a replay every process has a grace period to
re-attach), calls still waiting (a pending barrier, a live-set round, a preemption sync) and their clocks.
"""

from __future__ import annotations

from typing import Any

from coordinator.core import journal
from coordinator.core.state import ClusterState


def durable(state: ClusterState) -> dict[str, Any]:
    """What a replay of ``state``'s journal must give back, as plain values."""
    run, attempts = state.current, state.attempts
    admission = run.admission
    barriers = run.barriers._by_name
    return {
        "run": state.run, "attempt": attempts.current, "event position": state.event_position,
        "published at": state.published_at, "topology": admission.topology,
        "members": {uid: (m.registration, m.status, m.incarnation, m.reason, m.replaced)
                    for uid, m in admission.members.items()},
        "process ids": dict(admission.process_ids) if admission.topology is not None else None,
        "job": attempts.view(), "agents": attempts.listed(), "declared": attempts.declared,
        "replacing": sorted(attempts.replacing), "shrunk": sorted(attempts.shrunk),
        "key-values": dict(run.kv.store._values),
        "events": list(run._history._events),
        "barriers ended": {name: (b.participants, b.done, type(b.error).__name__, str(b.error or ""))
                           for name, b in barriers.items() if not b.pending},
    }


def difference(live: ClusterState, replayed: ClusterState) -> str | None:
    """The first part in which ``replayed`` differs from ``live`` (both values), or None."""
    ours, theirs = durable(live), durable(replayed)
    for part, value in ours.items():
        if theirs[part] != value:
            return f"{part}: live {value!r}, replayed {theirs[part]!r}"
    return None


class Recorder:
    """Every ClusterState made while it is installed, and every entry each one journaled (taken or not)."""

    def __init__(self) -> None:
        self.states: list[tuple[ClusterState, list[journal.Entry]]] = []
        self._originals = {name: vars(ClusterState)[name] for name in ("__init__", "take_journal", "replay")}

    def install(self) -> None:
        made, take, replay = self._originals["__init__"], self._originals["take_journal"], self._originals["replay"]
        recorder = self

        def init(state: ClusterState, *args, **kwargs) -> None:
            made(state, *args, **kwargs)
            recorder.states.append((state, []))

        def take_journal(state: ClusterState) -> list[journal.Entry]:
            entries = take(state)
            recorder.entries_of(state).extend(entries)
            return entries

        def replayed(state: ClusterState, entry: journal.Entry) -> None:
            recorder.states = [(s, e) for s, e in recorder.states if s is not state]  # replayed into: not live
            replay(state, entry)

        ClusterState.__init__, ClusterState.take_journal, ClusterState.replay = init, take_journal, replayed

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(ClusterState, name, original)

    def entries_of(self, state: ClusterState) -> list[journal.Entry]:
        """What ``state`` journaled so far (a list nobody reads for a state replayed into)."""
        return next((entries for s, entries in self.states if s is state), [])

    def differences(self) -> list[str]:
        """For each live state, where its replay differs from it."""
        found = []
        for state, taken in self.states:
            entries = [*taken, *self._originals["take_journal"](state)]
            if not entries:
                continue
            fresh = ClusterState(state.config)
            for entry in entries:
                fresh.replay(journal.decode(journal.encode(entry)))
            if (what := difference(state, fresh)) is not None:
                found.append(f"after {len(entries)} journal entries, {what}")
        return found
