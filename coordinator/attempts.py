"""The job's attempts as a pure sub-machine: which attempt runs, why each earlier one ended, and NextAttempt's
decision, made once per attempt however many agents ask and however often they retry. No I/O: the router
(``ClusterState``) journals what this decides and starts its other sub-machines afresh for a new attempt.

    attempt F ──(NextAttempt(F): restarts < max)──▶ attempt F+1 ──▶ ... ──▶ attempt N
    attempt N ──(NextAttempt(N): restarts >= max)──▶ exhausted (no attempt starts; every call is answered so)

F is the coordinator's ``--attempt`` (0 by default); the restarts made so far are N - F.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator import journal
from coordinator.limits import FLAGS, Limits, check_call_id, shown
from coordinator.registration import Registration
from ifrt.errors import ClusterMismatch, InvalidArgument

FAILURES_KEPT = 1024
"""Ended attempts whose failure a JobState lists (the oldest are dropped beyond it): a job that restarted more
often than this has a summary long enough already."""
REQUESTS_REMEMBERED = 1024
"""NextAttempt request ids remembered for their retries (one per agent and attempt; the oldest is forgotten)."""
UNKNOWN_PROCESS = -1
"""``AttemptFailure.process_id`` when the agent could not name the process."""


@dataclass(frozen=True)
class AttemptFailure:
    """Why an attempt ended: a process of it (``UNKNOWN_PROCESS``: not known) on ``host`` failed for ``reason``."""

    attempt: int
    process_id: int
    host: str
    reason: str


@dataclass(frozen=True)
class JobView:
    """What an agent needs: the current attempt, every ended attempt's failure (oldest first), and whether the
    restarts are exhausted (no attempt will start)."""

    attempt: int
    failures: tuple[AttemptFailure, ...]
    exhausted: bool


@dataclass(frozen=True)
class NextAttempt:
    """One NextAttempt call: the attempt its agent saw end, why, the job's restart budget, and its request id."""

    ended_attempt: int
    failure: AttemptFailure
    max_restarts: int
    request_id: str = ""


# Effects, for the shell: agents' watches hear of each, and a new attempt ends the old one's calls and sessions.
@dataclass(frozen=True)
class AttemptStarted:
    """Effect: attempt ``view.attempt`` started; every other sub-machine of the state starts empty."""

    view: JobView


@dataclass(frozen=True)
class AttemptsExhausted:
    """Effect: the job's restarts are exhausted; no attempt starts."""

    view: JobView


@dataclass(frozen=True)
class AttemptProcessFailed:
    """Effect: a process of the current attempt failed (liveness decided it); agents answer with NextAttempt."""

    failure: AttemptFailure


class Attempts:
    """The current attempt and the failures of the ended ones; ``decide`` answers NextAttempt."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.current = first
        self.exhausted = False
        self._failures: list[AttemptFailure] = []
        self._decided_by: dict[str, None] = {}  # request ids of the decisions, oldest first

    def view(self) -> JobView:
        """The job as agents see it now."""
        return JobView(self.current, tuple(self._failures), self.exhausted)

    def decide(self, call: NextAttempt, limits: Limits) -> journal.AttemptDecided | None:
        """The decision ``call`` makes, to journal and ``apply``; None when it changes nothing (a retry, an attempt
        that ended already, or restarts exhausted already): the caller is answered ``view()``. InvalidArgument,
        changing nothing, for an attempt ahead of the current one or strings over the limits."""
        _check(call, limits)
        if call.ended_attempt > self.current:
            raise InvalidArgument(f"ended_attempt {call.ended_attempt} is ahead of the job's current attempt "
                                  f"{self.current}: expected the attempt the agent's workers ran (at most "
                                  f"{self.current})")
        if call.request_id in self._decided_by or call.ended_attempt < self.current or self.exhausted:
            return None
        failure = call.failure
        return journal.AttemptDecided(
            ended=call.ended_attempt, process_id=failure.process_id, host=failure.host, reason=failure.reason,
            exhausted=self.current - self.first >= call.max_restarts, request_id=call.request_id)

    def apply(self, entry: journal.AttemptDecided) -> AttemptStarted | AttemptsExhausted:
        """Records a decision (made now, or replayed) and returns its effect."""
        self._failures.append(AttemptFailure(entry.ended, entry.process_id, entry.host, entry.reason))
        del self._failures[:-FAILURES_KEPT]
        if entry.request_id:
            self._decided_by[entry.request_id] = None
            if len(self._decided_by) > REQUESTS_REMEMBERED:
                del self._decided_by[next(iter(self._decided_by))]
        if entry.exhausted:
            self.exhausted = True
            return AttemptsExhausted(self.view())
        self.current = entry.ended + 1
        return AttemptStarted(self.view())

    def process_failed(self, process_id: int, host: str, reason: str) -> AttemptProcessFailed:
        """The effect that tells agents a process of the current attempt failed."""
        return AttemptProcessFailed(AttemptFailure(self.current, process_id, host, reason))


def check_attempt(r: Registration, current: int, cluster_id: str) -> None:
    """ClusterMismatch, naming both attempts, unless ``r`` belongs to the job's ``current`` attempt (or names none)."""
    if r.attempt is None or r.attempt == current:
        return
    if r.attempt < current:
        raise ClusterMismatch(f"{r.describe()} belongs to attempt {r.attempt} of the job; this coordinator serves "
                              f"attempt {current} of cluster {cluster_id!r}: a process of another attempt is refused "
                              "(start it with the job's current attempt, IFRT_ATTEMPT)")
    raise ClusterMismatch(f"{r.describe()} belongs to attempt {r.attempt} of the job; this coordinator serves "
                          f"attempt {current} of cluster {cluster_id!r}: the process was started for an attempt this "
                          "coordinator has not decided (yet): retry once the coordinator serves it (after a failover, "
                          "the new leader replays the decision)")


def _check(call: NextAttempt, limits: Limits) -> None:
    check_call_id("request_id", call.request_id, limits)
    failure = call.failure
    for what, text in (("failure.host", failure.host), ("failure.reason", failure.reason)):
        size = len(text.encode())
        if size > limits.string_bytes:
            raise InvalidArgument(f"{what} {shown(text)} is {size} bytes long: expected at most {limits.string_bytes} "
                                  f"(the coordinator's {FLAGS['string_bytes']})")
    if failure.process_id < UNKNOWN_PROCESS:
        raise InvalidArgument(f"failure.process_id {failure.process_id} is out of range: expected a process id >= 0, "
                              f"or {UNKNOWN_PROCESS} when the process is not known")
