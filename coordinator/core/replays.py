"""How each of a run's journaled decisions applies again on replay: the same event the live path ran
(``coordinator.core.run.Run``), whose new entries the router drops. The router's own decisions apply through
``coordinator.core.state.APPLY``; every entry type has exactly one of the two."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coordinator.core import journal
from coordinator.core.run import Run


def _replay_kv(run: Run, entry: Any) -> None:
    run.kv.replay(entry, agent=run.is_agent(getattr(entry, "client_uid", "")))


def _replay_barrier(run: Run, e: journal.BarrierFinished) -> None:
    run.barriers.restore(e.name, frozenset(e.participants), journal.error_of(e.error_type, e.error), e.forgot,
                         e.canceller, held_by=e.held_by)


REPLAYS: dict[type, Callable[[Run, Any], object]] = {
    journal.Registered: lambda run, e: run.register(e.registration, e.now, restoring=True),
    journal.Failed: lambda run, e: run.fail(run.admission.members[e.client_uid], e.why),
    journal.Left: lambda run, e: run.left(run.admission.members[e.client_uid]),
    journal.Forgot: lambda run, e: run.forget(run.admission.members[e.client_uid], e.why),
    journal.KeySet: _replay_kv,
    journal.KeyIncremented: _replay_kv,
    journal.KeySwapped: _replay_kv,
    journal.KeysDeleted: _replay_kv,
    journal.AnswersForgotten: _replay_kv,
    journal.BarrierFinished: _replay_barrier,
    journal.BarrierJoined: lambda run, e: run.barriers.restore_joined(e.name),
    journal.LiveSetDecided: lambda run, e: run.restore_live_set(e.callers, e.members,
                                                                journal.error_of(e.error_type, e.error)),
    journal.PreemptionNoticed: lambda run, e: run.noticed(e.process_id),
    journal.PreemptionSyncDecided: lambda run, e: run.restore_sync(e.step),
}
"""A run's journaled decision, applied again (``restoring``: a registration is not refused for what only the live
path checks)."""
