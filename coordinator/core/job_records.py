"""The job's attempts as plain values: an agent, a failure that ended an attempt, the job's state as agents see it,
a NextAttempt call, and what the attempts' decisions hand the shell (``coordinator.core.attempts`` decides them)."""

from __future__ import annotations

from dataclasses import dataclass

UNKNOWN_PROCESS = -1
"""``AttemptFailure.process_id`` when the agent could not name the process."""

Host = tuple[str, str]
"""(hostname, address): where a process registered from, or an agent called from."""


@dataclass(frozen=True)
class AttemptFailure:
    """Why an attempt ended: a process of it (``UNKNOWN_PROCESS``: not known) on ``host`` failed for ``reason``."""

    attempt: int
    process_id: int
    host: str
    reason: str


@dataclass(frozen=True)
class JobView:
    """What an agent needs: the current attempt, the latest ended attempts' failures (oldest first; ``earlier``
    more are not listed), whether the restarts are exhausted (no attempt will start), and the job's budget."""

    attempt: int
    failures: tuple[AttemptFailure, ...]
    exhausted: bool
    max_restarts: int = 0
    earlier: int = 0
    replacements: int = 0


@dataclass(frozen=True)
class Agent:
    """One agent of the job, as it joined."""

    uid: str
    host: str
    address: str
    secret_hash: str
    workers: int
    spare: bool = False
    """A spare host (``ifrt run --spare-host``): it runs no worker until it takes over a lost host's ids."""
    replace_timeout_s: float = 0.0
    """Its ``--replace-timeout``: a shrink of its own workers waits as long after their failure."""
    joined_unix_s: float = 0.0
    """When it joined, by the leader's clock."""

    @property
    def where(self) -> Host:
        return (self.host, self.address)


@dataclass(frozen=True)
class NextAttempt:
    """One NextAttempt call: the attempt its agent saw end, why, the budget it expects (None: the job's), its
    request id, and the calling agent."""

    ended_attempt: int
    failure: AttemptFailure
    max_restarts: int | None = None
    request_id: str = ""
    agent_uid: str = ""
    replace: bool = False
    shrink: tuple[int, ...] = ()
    """Drop these failed processes instead (``coordinator.core.shrink``): the attempt goes on without them."""


# Effects, for the shell: agents' watches hear of each, and a new attempt ends the old one's calls and sessions.
@dataclass(frozen=True)
class AttemptStarted:
    """Effect: attempt ``view.attempt`` started; every other sub-machine of the state starts empty. Without failures
    in ``view``, a new run of the job started (the last one's restarts were exhausted)."""

    view: JobView


@dataclass(frozen=True)
class AttemptsExhausted:
    """Effect: the job's restarts are exhausted; no attempt starts."""

    view: JobView


@dataclass(frozen=True)
class ProcessReplaced:
    """Effect: ``failure.process_id`` is replaced by its agent in the current attempt; the others keep running."""

    failure: AttemptFailure
    view: JobView


@dataclass(frozen=True)
class HostTakenOver:
    """Effect: the agent ``agent_uid`` on ``host`` runs ``process_ids`` from now on: a spare host took over a lost
    host's ids (``failure`` names the lost host), or, with no ids, the lost host's own agent came back."""

    failure: AttemptFailure
    agent_uid: str
    host: str
    process_ids: tuple[int, ...]
    view: JobView
    explicit_ids: bool = False
    """The job names its process ids: the agent names these for its workers in later attempts too."""


@dataclass(frozen=True)
class JobShrunk:
    """Effect: ``process_ids`` are dropped from the job (``coordinator.core.shrink``); the survivors go on."""

    process_ids: tuple[int, ...]
    view: JobView


@dataclass(frozen=True)
class AttemptProcessFailed:
    """Effect: a process of the current attempt failed (liveness decided it); agents answer with NextAttempt, or, where
    the job ``went_on`` without it (``--on-failure elastic``: a new generation over the survivors), wait for
    nothing."""

    failure: AttemptFailure
    went_on: bool = False
