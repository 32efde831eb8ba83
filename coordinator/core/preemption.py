"""The preemption sync point: after a notice, every live process reports the step it is at, and the sync step is
the largest reported (the first step every process can still reach), decided once. No I/O.

    (none) ──(notice)──▶ noticed ──(every live process reported its step)──▶ decided: sync step

A process blocks on its report until the step is decided, so none runs past it: the slowest reports at its next
step, the others wait there, and every process checkpoints at the same step. Reports are not journaled (a retry
reports again); the notice and the decided step are.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ifrt.errors import BarrierTimeout, IfrtError


@dataclass(frozen=True)
class PreemptionResolved:
    """Effect: the sync step was decided (``error`` None), or the waiting reports timed out."""

    step: int | None
    error: IfrtError | None


@dataclass
class Preemption:
    """One notice and the reports since."""

    noticed_by: int
    reports: dict[int, int] = field(default_factory=dict)  # process id -> the step it reported
    started_at: float = 0.0
    deadline: float | None = None
    sync_step: int | None = None
    expired: IfrtError | None = None  # the last wait that timed out, until the next report

    @property
    def waiting(self) -> bool:
        """Whether reports wait for the sync step."""
        return self.sync_step is None and self.deadline is not None

    def report(self, process_id: int, step: int, timeout_s: float, now: float) -> None:
        """Records ``process_id``'s step (its first report counts: a retry repeats it)."""
        if self.deadline is None:
            self.started_at, self.deadline = now, now + timeout_s
        self.deadline = min(self.deadline, now + timeout_s)
        self.reports.setdefault(process_id, step)
        self.expired = None

    def settle(self, alive: Collection[int], now: float, describe: Callable[[int], str]) -> PreemptionResolved | None:
        """Decides the sync step once every process in ``alive`` reported, or ends the waits whose deadline
        passed; None while it waits (or nobody does)."""
        if self.sync_step is not None or self.deadline is None:
            return None
        missing = sorted(set(alive) - self.reports.keys())
        if not missing:
            steps = [self.reports[p] for p in alive]
            if not steps:
                return None
            self.sync_step = max(steps)
            return PreemptionResolved(self.sync_step, None)
        if now < self.deadline:
            return None
        self.expired = BarrierTimeout(
            f"preemption sync point: {len(missing)} of {len(alive)} live processes did not report their step "
            f"within {now - self.started_at:.1f}s of the first report: "
            f"{', '.join(describe(p) for p in missing[:16])}{' ...' if len(missing) > 16 else ''}")
        self.deadline = None
        return PreemptionResolved(None, self.expired)
