"""What ``ifrt run``'s agent hears and does: the events fed to its decisions (``ifrt.run.agent``), the actions they
call for, and the records both carry. Plain data, no behaviour."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ifrt.run.spares import HandOff, HandOffFailed, SpareExited, StartSpare

UNKNOWN_PROCESS = -1
"""A failure's ``process_id`` when the process is not known (a worker that failed before it registered)."""


@dataclass(frozen=True)
class Failure:
    """Why an attempt ended: which process (``UNKNOWN_PROCESS`` if not known), on which host, and why."""

    attempt: int
    process_id: int
    host: str
    reason: str

    def describe(self) -> str:
        who = "a process" if self.process_id == UNKNOWN_PROCESS else f"process {self.process_id}"
        return f"attempt {self.attempt}: {who} on {self.host or 'an unknown host'} failed: {self.reason}"


@dataclass(frozen=True)
class JobView:
    """The job as the coordinator decided it: its current attempt, the latest attempts' failures (``earlier`` more
    not listed), whether it is over, its restart budget, and the processes replaced in this run."""

    attempt: int
    failures: tuple[Failure, ...] = ()
    exhausted: bool = False
    max_restarts: int = 0
    earlier: int = 0
    replacements: int = 0


# Events.
@dataclass(frozen=True)
class JobUpdate:
    """A JobState from the watch (first event, attempt_started, exhausted) or NextAttempt's answer."""

    view: JobView


@dataclass(frozen=True)
class ProcessFailedSeen:
    """The coordinator reports a process of the job failed; ``went_on``: the job went on without it (a new
    generation over the survivors, ``--on-failure elastic``), so nobody waits for it."""

    failure: Failure
    went_on: bool = False


@dataclass(frozen=True)
class WorkerExited:
    attempt: int
    local_rank: int
    returncode: int
    """As ``Popen.returncode``: negative for a death by signal."""
    incarnation: int = 0
    """Which of the rank's workers in this attempt (0: the first; each replacement adds 1)."""
    reason: str = ""
    """Why, where the exit code does not say it (a worker that could not start)."""


@dataclass(frozen=True)
class ReplaceAnswered:
    """The coordinator's answer to ``AskReplace`` (``refused``: why it refused, PERMISSION_DENIED)."""

    attempt: int
    local_rank: int
    view: JobView
    refused: str = ""


@dataclass(frozen=True)
class ShrinkAnswered:
    """The coordinator's answer to ``AskShrink`` in ``attempt`` (``refused``: why it did not shrink the job)."""

    attempt: int
    view: JobView
    refused: str = ""


@dataclass(frozen=True)
class ReplaceSeen:
    """The coordinator decided to replace ``failure.process_id`` (the watch's ``replaced``, ordered after the old
    process's failure)."""

    failure: Failure


@dataclass(frozen=True)
class HostTakenOverSeen:
    """Every process id of a lost host (``failure.host``) goes to the agent on ``host`` (``mine``: this agent), or,
    with no ids, the lost host's own agent came back."""

    failure: Failure
    host: str
    process_ids: tuple[int, ...]
    mine: bool
    explicit: bool = False
    """The job names its process ids: these stay this agent's in later attempts too."""


@dataclass(frozen=True)
class IdsKnown:
    """The process ids the coordinator gave this host's workers, by local rank."""

    ids: dict[int, int]


@dataclass(frozen=True)
class Interrupted:
    signum: int


@dataclass(frozen=True)
class LinkFailed:
    """The coordinator cannot be used: out of reach beyond the failover window, or it refuses the agent."""

    message: str
    exit_code: int


@dataclass(frozen=True)
class AskRefused:
    """The coordinator refused this agent's NextAttempt after ``attempt`` (PERMISSION_DENIED: a cause it may not give,
    such as a worker it took for its own); the coordinator's own report of the failure will do."""

    attempt: int
    message: str


@dataclass(frozen=True)
class Tick:
    """Time passes (the shell sends it a few times a second)."""


Event = (JobUpdate | ProcessFailedSeen | WorkerExited | IdsKnown | Interrupted | LinkFailed | AskRefused | Tick
         | ReplaceAnswered | ReplaceSeen | HostTakenOverSeen | SpareExited | HandOffFailed | ShrinkAnswered)


# Actions.
@dataclass(frozen=True)
class Say:
    line: str


@dataclass(frozen=True)
class Start:
    attempt: int


@dataclass(frozen=True)
class Stop:
    """Stop every local worker: ``signum``, ``--grace-seconds``, then SIGKILL (a stopped one: SIGKILL at once)."""

    signum: int = signal.SIGTERM


@dataclass(frozen=True)
class AskNextAttempt:
    ended_attempt: int
    failure: Failure


@dataclass(frozen=True)
class StartWorker:
    """Start a new worker for ``local_rank`` alone (a replacement), with the environment of the attempt's first."""

    attempt: int
    local_rank: int
    incarnation: int


@dataclass(frozen=True)
class Kill:
    """SIGKILL one worker's process group (a worker declared failed while it runs: hung)."""

    local_rank: int


@dataclass(frozen=True)
class AskReplace:
    attempt: int
    local_rank: int
    failure: Failure


@dataclass(frozen=True)
class AskShrink:
    """Ask the coordinator to drop ``process_ids`` (other hosts' failed processes, neither replaced nor taken over
    within ``--replace-timeout``) and let the survivors go on; ``failure``: the first of them."""

    attempt: int
    failure: Failure
    process_ids: tuple[int, ...]


@dataclass(frozen=True)
class LearnIds:
    """Ask the coordinator again for this host's workers' process ids (``IdsKnown`` once it knows them all)."""

    attempt: int


@dataclass(frozen=True)
class StartIds:
    """Start one worker per process id, by local rank (a spare host taking over a lost host's ids)."""

    attempt: int
    ids: dict[int, int]


@dataclass(frozen=True)
class Exit:
    """End the agent with ``code`` (None: the workers' own status, see ``workers_status``)."""

    code: int | None


Action = (Say | Start | Stop | AskNextAttempt | StartWorker | Kill | AskReplace | LearnIds | StartIds | StartSpare
          | HandOff | AskShrink | Exit)
