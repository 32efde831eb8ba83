"""Live and replayed agree: every ``ClusterState`` a test drives is, when the test ends, compared with a fresh one that
replayed everything it journaled (as a coordinator taking over would), on what the journal promises to bring back
(``coordinator.core.durable``). A decision applied one way live and another on replay fails the test that made it,
naming what differs. Daemons started by the suite check their own journals the same way when they stop
(``--check-replay``, ``tests/conftest.py``)."""

from __future__ import annotations

from coordinator.core import journal
from coordinator.core.durable import difference
from coordinator.core.state import ClusterState


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
