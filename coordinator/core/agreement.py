"""Agreement on who is alive (``client.live_processes``): every live process calls, and every caller gets the same
answer, decided once: the callers that are still alive, with their incarnations. No I/O.

    (none) ──(first call)──▶ pending ──(every live process called)──▶ decided: {process id: incarnation}
                                │
                                └──(a caller's timeout passed)──▶ failed: BarrierTimeout naming who did not call

A caller that fails, leaves or restarts while the others wait is left out and no longer awaited; the effect that
leaves it out (``LeftOut``) carries its answer, the error that says why. Each decided answer is kept per caller with
its call id, so a retried call (same call id) gets the same answer, also after a replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ifrt.errors import BarrierTimeout, IfrtError

Members = tuple[tuple[int, int], ...]
"""(process id, incarnation) pairs, sorted by process id."""


@dataclass
class _Round:
    started_at: float
    deadline: float
    callers: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # pid -> (uid, call id, incarnation)


@dataclass(frozen=True)
class LiveSetResolved:
    """Effect: the pending agreement ended; ``callers`` (client uid, call id) get ``members`` or ``error``."""

    callers: tuple[tuple[str, str], ...]
    members: Members
    error: IfrtError | None


@dataclass(frozen=True)
class LeftOut:
    """Effect: a caller (client uid, call id) of the pending agreement failed, left or was replaced while it waited;
    ``error`` (why) is its answer."""

    client_uid: str
    call_id: str
    error: IfrtError


class LiveSets:
    """The pending agreement (at most one) and every caller's last answer."""

    def __init__(self) -> None:
        self._round: _Round | None = None
        self._answers: dict[str, tuple[str, Members | IfrtError]] = {}  # uid -> (call id, answer)

    @property
    def pending(self) -> bool:
        """Whether an agreement waits for callers."""
        return self._round is not None

    def answer(self, client_uid: str, call_id: str) -> Members | IfrtError | None:
        """The answer to this call, None while it is pending (or unknown)."""
        found = self._answers.get(client_uid)
        return found[1] if found is not None and found[0] == call_id else None

    def call(self, process_id: int, client_uid: str, call_id: str, incarnation: int, timeout_s: float,
             now: float) -> None:
        """Joins the pending agreement, or starts one; the earliest caller's deadline bounds it."""
        if self._round is None:
            self._round = _Round(now, now + timeout_s)
        self._round.deadline = min(self._round.deadline, now + timeout_s)
        self._round.callers[process_id] = (client_uid, call_id, incarnation)

    def settle(self, alive: Mapping[int, tuple[str, int]], now: float, describe: Callable[[int], str],
               why_left_out: Callable[[str], IfrtError]) -> tuple[LiveSetResolved | None, list[LeftOut]]:
        """Decides the pending agreement if every process in ``alive`` (process id -> (client uid, incarnation))
        has called, or fails it once its deadline passed (None while it still waits); leaves out the callers no
        longer in ``alive``, each with the error ``why_left_out`` gives for its client uid."""
        current = self._round
        if current is None:
            return None, []
        left_out = []
        for pid, (uid, call_id, _) in list(current.callers.items()):
            if pid not in alive or alive[pid][0] != uid:  # failed, left or replaced by a restart
                del current.callers[pid]
                left_out.append(LeftOut(uid, call_id, why_left_out(uid)))
        missing = sorted(alive.keys() - current.callers.keys())
        error: IfrtError | None = None
        if missing and now < current.deadline:
            return None, left_out
        if missing:
            error = BarrierTimeout(
                f"live_processes found no agreement after {now - current.started_at:.1f}s: {len(missing)} of "
                f"{len(alive)} live processes did not call it: {', '.join(describe(p) for p in missing[:16])}"
                f"{' ...' if len(missing) > 16 else ''}")
        members = () if error else tuple(sorted((pid, inc) for pid, (_, _, inc) in current.callers.items()))
        callers = tuple(sorted((uid, call_id) for uid, call_id, _ in current.callers.values()))
        self._round = None
        self.restore(callers, members, error)
        return LiveSetResolved(callers, members, error), left_out

    def restore(self, callers: tuple[tuple[str, str], ...], members: Members, error: IfrtError | None) -> None:
        """Records a decided agreement (also from the journal): each caller's answer."""
        for uid, call_id in callers:
            self._answers[uid] = (call_id, error if error is not None else members)
