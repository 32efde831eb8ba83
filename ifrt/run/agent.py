"""The decisions of ``ifrt run``'s agent: events in, actions out; no processes, clocks, network or signals here.

    WAITING --JobState--> RUNNING --worker failed / process_failed--> RESTARTING --next attempt--> RUNNING
       |                    |  \\--every worker exited 0--> DONE (exit 0)            \\--exhausted--> DONE (exit 1)
       \\--exhausted--> DONE  \\--SIGTERM/SIGINT--> DONE (the workers' status)

A worker that exits with the fail-fast code of a peer's failure (75) or of a lost coordinator (69) did not fail on
its own: the agent stops its workers and waits up to ``CAUSE_WAIT_S`` for the coordinator to name the process that
did, so the attempt's failure names the cause, not a survivor.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

from ifrt.errors import EXIT_COORDINATOR_LOST, EXIT_PEER_FAILED

EXIT_JOB_FAILED = 1
"""The agent's exit code when the job's restarts are exhausted (``--max-restarts``)."""
EXIT_USAGE = 2
"""The agent's exit code for bad flags or settings, or a coordinator that refuses the agent (token, TLS)."""
CAUSE_WAIT_S = 5.0
"""How long a worker's exit with 75/69 waits for the coordinator's report of the process that failed first."""
UNKNOWN_PROCESS = -1


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
    not listed), whether it is over, and its restart budget."""

    attempt: int
    failures: tuple[Failure, ...] = ()
    exhausted: bool = False
    max_restarts: int = 0
    earlier: int = 0


# Events.
@dataclass(frozen=True)
class JobUpdate:
    """A JobState from the watch (first event, attempt_started, exhausted) or NextAttempt's answer."""

    view: JobView


@dataclass(frozen=True)
class ProcessFailedSeen:
    """The coordinator reports a process of the job failed."""

    failure: Failure


@dataclass(frozen=True)
class WorkerExited:
    attempt: int
    local_rank: int
    returncode: int
    """As ``Popen.returncode``: negative for a death by signal."""


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


Event = JobUpdate | ProcessFailedSeen | WorkerExited | IdsKnown | Interrupted | LinkFailed | AskRefused | Tick


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
class Exit:
    """End the agent with ``code`` (None: the workers' own status, see ``workers_status``)."""

    code: int | None


Action = Say | Start | Stop | AskNextAttempt | Exit


class Phase(enum.Enum):
    WAITING = "waiting for the job's state"
    RUNNING = "running"
    RESTARTING = "restarting"
    DONE = "done"


def exit_reason(returncode: int) -> str:
    """``3`` -> "exit code 3", ``-9`` -> "killed by SIGKILL"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def workers_status(returncodes: list[int]) -> int:
    """The agent's exit code from its workers' (as a shell reports them: 128 + N for a death by signal N): the first
    non-zero one, else 0."""
    for code in returncodes:
        if code != 0:
            return 128 - code if code < 0 else code
    return 0


def summary(failures: tuple[Failure, ...], earlier: int = 0) -> list[str]:
    """One line per failed attempt, oldest first (``earlier`` ones the coordinator no longer lists are counted)."""
    lines = [f"{earlier} earlier attempts failed too (not listed)"] if earlier else []
    return lines + [f.describe() for f in failures] or ["no failure was recorded"]


@dataclass
class Agent:
    """One host's agent: ``nproc`` workers per attempt; ``host`` names this host in failures."""

    nproc: int
    host: str
    ids: dict[int, int] = field(default_factory=dict)
    """Process id by local rank, where known (explicit from the host rank, or learned from the coordinator)."""
    phase: Phase = Phase.WAITING
    attempt: int | None = None
    failures: tuple[Failure, ...] = ()
    _finished: set[int] = field(default_factory=set)
    _asked: int | None = None  # the attempt whose end this agent asked the coordinator for
    _pending: Failure | None = None  # a survivor's exit, reported if the coordinator names no cause in time
    _cause_deadline: float | None = None

    def handle(self, event: Event, now: float) -> list[Action]:
        """The actions ``event`` calls for, in order; ``now`` is a monotonic time in seconds."""
        if self.phase is Phase.DONE:
            return []
        if isinstance(event, JobUpdate):
            return self._job(event.view)
        if isinstance(event, ProcessFailedSeen):
            return self._process_failed(event.failure)
        if isinstance(event, WorkerExited):
            return self._worker_exited(event, now)
        if isinstance(event, IdsKnown):
            self.ids.update(event.ids)
            return []
        if isinstance(event, Interrupted):
            return self._interrupted(event.signum)
        if isinstance(event, AskRefused):
            if event.attempt != self.attempt or self._asked != self.attempt:
                return []
            self._asked = None  # the next process_failed of this attempt is asked about again
            return [Say(f"{event.message}; waiting for the coordinator to declare the failure")]
        if isinstance(event, LinkFailed):
            return self._end(event.exit_code, [event.message, *(summary(self.failures) if self.failures else ())])
        if isinstance(event, Tick) and self._pending is not None and self._cause_deadline is not None \
                and now >= self._cause_deadline:
            return self._ask(self._pending)
        return []

    def process_id(self, local_rank: int) -> int:
        return self.ids.get(local_rank, UNKNOWN_PROCESS)

    def _job(self, view: JobView) -> list[Action]:
        self.failures = view.failures
        if view.exhausted:
            lines = [f"the job's restarts are exhausted ({view.max_restarts} allowed); failures:",
                     *summary(view.failures, view.earlier)]
            return self._end(EXIT_JOB_FAILED, lines)
        if self.attempt is not None and view.attempt <= self.attempt:
            return []  # the attempt running (or a stale answer): nothing to do
        actions: list[Action] = []
        if self.phase is Phase.RUNNING:
            actions += [Say(f"attempt {view.attempt} started elsewhere; stopping the workers of attempt "
                            f"{self.attempt}"), Stop()]
        self.phase, self.attempt = Phase.RUNNING, view.attempt
        self._finished.clear()
        self._pending = self._cause_deadline = None
        return [*actions, Start(view.attempt), Say(f"attempt {view.attempt} started with {self.nproc} workers")]

    def _process_failed(self, failure: Failure) -> list[Action]:
        if failure.attempt != self.attempt or self._asked == self.attempt:
            return []
        if self.phase is Phase.RUNNING:
            self.phase = Phase.RESTARTING
            return [Say(f"{failure.describe()}; stopping {self.nproc} workers"), Stop(), *self._ask(failure)]
        if self.phase is Phase.RESTARTING:  # stopped already, waiting for this cause
            return [Say(failure.describe()), *self._ask(failure)]
        return []

    def _worker_exited(self, event: WorkerExited, now: float) -> list[Action]:
        if event.attempt != self.attempt or self.phase is not Phase.RUNNING:
            return []  # a worker of an attempt that ended: its end is no news
        rank, code = event.local_rank, event.returncode
        who = f"worker {rank}" if rank not in self.ids else f"worker {rank} (process {self.ids[rank]})"
        if code == 0:
            self._finished.add(rank)
            if len(self._finished) < self.nproc:
                return [Say(f"{who} finished")]
            return self._end(0, [f"{who} finished; all {self.nproc} workers finished"])
        self.phase = Phase.RESTARTING
        reason = exit_reason(code) if rank in self.ids else f"local rank {rank}: {exit_reason(code)}"
        failure = Failure(event.attempt, self.process_id(rank), self.host, reason)
        if code in (EXIT_PEER_FAILED, EXIT_COORDINATOR_LOST):
            self._pending, self._cause_deadline = failure, now + CAUSE_WAIT_S
            return [Say(f"{who} exited with {code} (a failure elsewhere); stopping {self.nproc} workers"), Stop()]
        return [Say(f"{who} failed: {exit_reason(code)}; stopping {self.nproc} workers"), Stop(), *self._ask(failure)]

    def _ask(self, failure: Failure) -> list[Action]:
        assert self.attempt is not None
        self._asked = self.attempt
        self._pending = self._cause_deadline = None
        return [Say(f"asking the coordinator for attempt {self.attempt + 1}"), AskNextAttempt(self.attempt, failure)]

    def _interrupted(self, signum: int) -> list[Action]:
        name = signal.Signals(signum).name
        running = self.phase is Phase.RUNNING
        self.phase = Phase.DONE
        if not running:
            return [Say(f"received {name}; no worker runs"), Exit(128 + signum)]
        return [Say(f"received {name}: passing it on to {self.nproc} workers"), Stop(signum), Exit(None)]

    def _end(self, code: int, lines: list[str]) -> list[Action]:
        running = self.phase is Phase.RUNNING
        self.phase = Phase.DONE
        stop: list[Action] = [Stop()] if running and code != 0 else []
        return [*stop, *(Say(line) for line in lines), Exit(code)]
