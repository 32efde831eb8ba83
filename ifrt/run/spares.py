"""The warm spares of ``ifrt run --spare N`` as the agent decides about them: pure, no processes or clocks here.

The agent keeps N spares, started after the first attempt's workers: a decided replacement goes to an idle spare
(``HandOff``: the spare, imported already, registers as the next incarnation of the process id), else it starts
cold. A spare is started again ``SPARE_START_DELAY_S`` after one was used or died idle (never a failure of the job),
so that its start does not compete for the host's CPUs with the recovery::

    spare IDLE --decided replacement--> the rank's worker (and a new spare, later)
       \\--exited--> a new spare, later (up to ``SPARE_DEATHS_MOST`` times N in all)
"""

from __future__ import annotations

from dataclasses import dataclass, field

SPARE_START_DELAY_S = 2.0
"""How long after a spare was used (or died idle) the next one starts: a spare's start and imports would compete for
the host's CPUs with the newcomer and the survivors re-forming their groups."""
SPARE_DEATHS_MOST = 5
"""Times N that spares may die idle before no more are started (a program that cannot start as a spare)."""


# Events.
@dataclass(frozen=True)
class SpareExited:
    """Warm spare ``serial`` exited (while idle, unless the agent handed it a process since)."""

    serial: int
    returncode: int


@dataclass(frozen=True)
class HandOffFailed:
    """Spare ``serial`` could not take the replacement of ``local_rank`` (it had exited): no process was started."""

    serial: int
    attempt: int
    local_rank: int
    incarnation: int
    reason: str


# Actions.
@dataclass(frozen=True)
class StartSpare:
    """Start warm spare ``serial``: the workers' command and environment less the rank's variables; it waits."""

    serial: int


@dataclass(frozen=True)
class HandOff:
    """Make spare ``serial`` the worker of ``local_rank`` (a replacement), as ``StartWorker`` would start one."""

    serial: int
    attempt: int
    local_rank: int
    incarnation: int


@dataclass
class SparePool:
    """Which spares run idle, and when the next ones are due; ``size``: the N of ``--spare N``."""

    size: int = 0
    idle: list[int] = field(default_factory=list)
    """The serials of the spares started and not handed a process, oldest first."""
    _serial: int = 0  # the next spare's
    _due: list[float | None] = field(default_factory=list)  # when each spare to start is due (None: not set yet)
    _deaths: int = 0

    def first(self, now: float) -> list[StartSpare]:
        """All N spares, once (when the first attempt's workers have started)."""
        if not self.size or self._serial or self._due:
            return []
        self._due = [now] * self.size
        return self.due(now)

    def ready(self, now: float) -> bool:
        """Whether a spare is due to start now (a due time not set yet is set from ``now``)."""
        self._due = [now + SPARE_START_DELAY_S if t is None else t for t in self._due]
        return any(t is not None and t <= now for t in self._due)

    def due(self, now: float) -> list[StartSpare]:
        """The spares to start now, each counted idle."""
        starts = []
        for _ in [t for t in self._due if t is not None and t <= now]:
            starts.append(StartSpare(self._serial))
            self.idle.append(self._serial)
            self._serial += 1
        self._due = [t for t in self._due if t is None or t > now]
        return starts

    def take(self) -> int | None:
        """The oldest idle spare, handed a process now (another is due ``SPARE_START_DELAY_S`` after the next
        Tick); None when none is idle."""
        if not self.idle:
            return None
        self._due.append(None)
        return self.idle.pop(0)

    def exited(self, serial: int, reason: str, now: float) -> str | None:
        """What to say of spare ``serial``'s exit (``reason``); None if it was no idle spare (handed a process since,
        its exit is that worker's). Another is due later, unless spares died too often."""
        if serial not in self.idle:
            return None
        self.idle.remove(serial)
        self._deaths += 1
        if self._deaths > SPARE_DEATHS_MOST * self.size:
            return (f"spare {serial} exited while idle ({reason}); spares died {self._deaths} times: no more are "
                    "started, replacements start cold")
        self._due.append(now + SPARE_START_DELAY_S)
        return f"spare {serial} exited while idle ({reason}); another starts in {SPARE_START_DELAY_S:g} s"
