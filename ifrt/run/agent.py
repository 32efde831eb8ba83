"""The decisions of ``ifrt run``'s agent: events in, actions out; no processes, clocks, network or signals here.

    WAITING --JobState--> RUNNING --worker failed / process_failed--> RESTARTING --next attempt--> RUNNING
       |                    |  \\--every worker exited 0--> DONE (exit 0)            \\--exhausted--> DONE (exit 1)
       \\--exhausted--> DONE  \\--SIGTERM/SIGINT--> DONE (the workers' status)

With ``Recover.REPLACE`` (``ifrt run --recover replace``) a failed worker is replaced, not the job restarted: its agent
asks the coordinator (``AskReplace``, decided once and counted against the restart budget), then starts a new worker
for the same local rank and process id; every other worker keeps running. A worker the coordinator declares failed
while it still runs (it stopped answering: hung) is killed first, so its peers' sockets close::

    worker RUNNING --exit != 0--> ASKED --the coordinator's `replaced` event--> RUNNING (the next incarnation)
       \\--declared failed (hung)--> killed --exit--> ASKED

A lost host (its agent and workers gone) is taken over by a spare host (``spare``: ``ifrt run --spare-host``), which
runs no worker until the coordinator hands it the lost host's ids (``HostTakenOverSeen``), then one worker per id.
Survivors wait for another host's failed processes (``ifrt.run.waits``) up to ``replace_timeout``, then ask the
coordinator to shrink the job to them (``AskShrink``: it drops those processes where it runs with --min-processes,
see coordinator.core.shrink), and where it refuses, ask for the next attempt as without replace::

    RUNNING --replace-timeout--> asked to shrink --shrunk--> RUNNING (the workers go on, fewer processes)
                                                 \\--refused--> RESTARTING (stop, ask for the next attempt)

Where the coordinator runs ``--on-failure elastic``, the job goes on without a failed process at once
(``ProcessFailedSeen.went_on``): no agent waits for another host's, and its replacement, a spare host or its agent's
return brings it back into a later generation.

With ``spares`` (``ifrt run --spare N``, ``ifrt.run.spares``) a decided replacement goes to an idle warm spare.

A worker that exits with the fail-fast code of a peer's failure (75) or of a lost coordinator (69) did not fail on
its own: the agent stops its workers and waits up to ``CAUSE_WAIT_S`` for the coordinator to name the process that
did, so the attempt's failure names the cause, not a survivor.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

from ifrt.errors import EXIT_COORDINATOR_LOST, EXIT_PEER_FAILED
from ifrt.run.messages import (
    UNKNOWN_PROCESS,
    Action,
    AskNextAttempt,
    AskRefused,
    AskReplace,
    AskShrink,
    Event,
    Exit,
    Failure,
    HostTakenOverSeen,
    IdsKnown,
    Interrupted,
    JobUpdate,
    JobView,
    Kill,
    LearnIds,
    LinkFailed,
    ProcessFailedSeen,
    ReplaceAnswered,
    ReplaceSeen,
    Say,
    ShrinkAnswered,
    Start,
    StartIds,
    StartWorker,
    Stop,
    Tick,
    WorkerExited,
)
from ifrt.run.spares import HandOff, HandOffFailed, SpareExited, SparePool
from ifrt.run.waits import HostWaits

EXIT_JOB_FAILED = 1
"""The agent's exit code when the job's restarts are exhausted (``--max-restarts``)."""
EXIT_USAGE = 2
"""The agent's exit code for bad flags or settings, or a coordinator that refuses the agent (token, TLS)."""
CAUSE_WAIT_S = 5.0
"""How long a worker's exit with 75/69 waits for the coordinator's report of the process that failed first."""
DEFAULT_REPLACE_TIMEOUT_S = 60.0
"""How long the survivors wait for another host's failed processes to be replaced or taken over."""


class Recover(enum.Enum):
    """What a failed worker costs (``ifrt run --recover``)."""

    RESTART = "restart"
    """The whole job restarts in place: every worker stops, the next attempt starts them all."""
    REPLACE = "replace"
    """Only the failed worker is started anew, with its process id; the others keep running."""


@dataclass
class WorkerState:
    """The current worker of one local rank in this attempt."""

    incarnation: int = 0
    running: bool = True
    declared: Failure | None = None
    """The coordinator declared it failed while it ran (hung): it was killed, and this is reported once it exits."""
    asked: bool = False
    """Its replacement was asked for and has not started yet."""
    decided_at: float | None = None
    """When the coordinator answered that it decided the replacement (the watch's event starts it, or a timeout)."""


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
    recover: Recover = Recover.RESTART
    workers: dict[int, WorkerState] = field(default_factory=dict)
    """By local rank, in the current attempt."""
    phase: Phase = Phase.WAITING
    attempt: int | None = None
    failures: tuple[Failure, ...] = ()
    _finished: set[int] = field(default_factory=set)
    _asked: int | None = None  # the attempt whose end this agent asked the coordinator for
    _pending: Failure | None = None  # a survivor's exit, reported if the coordinator names no cause in time
    _cause_deadline: float | None = None
    _unplaced: dict[int, Failure] = field(default_factory=dict)  # failures of this host's processes, ids unknown
    spare: bool = False
    """A spare host (``ifrt run --spare-host``) that has taken over nothing yet: it runs no worker."""
    replace_timeout: float = DEFAULT_REPLACE_TIMEOUT_S
    named_ids: dict[int, int] = field(default_factory=dict)
    """The ids this agent names for its workers by local rank (a spare host that took over explicit ids)."""
    _took_over: bool = False
    _shrinking: Failure | None = None  # the failure a refused shrink ends the attempt with
    _waits: HostWaits[Failure] = field(init=False)

    def __post_init__(self) -> None:
        self._waits = HostWaits(self.replace_timeout)
    spares: SparePool = field(default_factory=SparePool)
    """The warm spares (``--spare N``; only with ``Recover.REPLACE``)."""

    def handle(self, event: Event, now: float) -> list[Action]:
        """The actions ``event`` calls for, in order; ``now`` is a monotonic time in seconds."""
        if self.phase is Phase.DONE:
            return []
        if self.spare and not isinstance(event, Interrupted | LinkFailed):
            return self._as_spare(event)
        if isinstance(event, JobUpdate):
            if self._took_over and not self.named_ids and event.view.attempt > (self.attempt or 0):
                self.ids = {}  # ids assigned by host: this host's are learned again in the new attempt
            actions = self._job(event.view)
            return [*actions, *self.spares.first(now)] if any(isinstance(a, Start) for a in actions) else actions
        if isinstance(event, SpareExited | HandOffFailed) or (isinstance(event, Tick) and self.spares.ready(now)):
            return self._spare_event(event, now)
        if isinstance(event, ProcessFailedSeen):
            if event.went_on:
                return self._went_on(event.failure)
            return self._process_failed(event.failure) + self._await_host(event.failure, now)
        if isinstance(event, HostTakenOverSeen):
            return self._host_back(event)
        if isinstance(event, WorkerExited):
            return self._worker_exited(event, now)
        if isinstance(event, IdsKnown):
            self.ids.update(event.ids)
            unplaced, self._unplaced = self._unplaced, {}
            return [a for f in unplaced.values() if f.attempt == self.attempt and self.phase is Phase.RUNNING
                    for a in self._failed_elsewhere(f)]
        if isinstance(event, Interrupted):
            return self._interrupted(event.signum)
        if isinstance(event, AskRefused):
            if event.attempt != self.attempt or self._asked != self.attempt:
                return []
            self._asked = None  # the next process_failed of this attempt is asked about again
            return [Say(f"{event.message}; waiting for the coordinator to declare the failure")]
        if isinstance(event, LinkFailed):
            return self._end(event.exit_code, [event.message, *(summary(self.failures) if self.failures else ())])
        if isinstance(event, ReplaceAnswered):
            return self._replace_answered(event, now)
        if isinstance(event, ReplaceSeen):
            return self._replace_seen(event.failure)
        if isinstance(event, ShrinkAnswered):
            return self._shrink_answered(event)
        if isinstance(event, Tick) and self._pending is not None and self._cause_deadline is not None \
                and now >= self._cause_deadline:
            return self._ask(self._pending)
        if isinstance(event, Tick) and self.phase is Phase.RUNNING:
            waited = self._waited(now)
            if self.phase is not Phase.RUNNING:  # it gave up waiting: the job ends as without replace
                return waited
            late = [r for r, w in self.workers.items() if w.asked and w.decided_at is not None
                    and now >= w.decided_at + CAUSE_WAIT_S]
            return waited + [a for r in late for a in self._start_replacement(r)]
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
        self._shrinking = None
        self.workers = {rank: WorkerState() for rank in range(self.nproc)}
        self._finished.clear()
        self._pending = self._cause_deadline = None
        self._unplaced.clear()
        return [*actions, Start(view.attempt), Say(f"attempt {view.attempt} started with {self.nproc} workers")]

    def _process_failed(self, failure: Failure) -> list[Action]:
        if self.recover is Recover.REPLACE and self.phase is Phase.RUNNING:
            return self._failed_elsewhere(failure) if failure.attempt == self.attempt else []
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
        state = self.workers.get(rank)
        if state is None or state.incarnation != event.incarnation:
            return []  # not the rank's current worker
        state.running = False
        who = f"worker {rank}" if rank not in self.ids else f"worker {rank} (process {self.ids[rank]})"
        if code == 0:
            self._finished.add(rank)
            if len(self._finished) < self.nproc:
                return [Say(f"{who} finished")]
            return self._end(0, [f"{who} finished; all {self.nproc} workers finished"])
        why = event.reason or exit_reason(code)
        if self.recover is Recover.REPLACE and rank in self.ids and code not in (EXIT_PEER_FAILED,
                                                                                 EXIT_COORDINATOR_LOST):
            failure = state.declared or Failure(event.attempt, self.ids[rank], self.host, why)
            state.asked = True
            return [Say(f"{who} failed: {why}; asking the coordinator to replace it (the other workers keep "
                        "running)"), AskReplace(event.attempt, rank, failure)]
        self.phase = Phase.RESTARTING
        reason = why if rank in self.ids else f"local rank {rank}: {why}"
        failure = Failure(event.attempt, self.process_id(rank), self.host, reason)
        if code in (EXIT_PEER_FAILED, EXIT_COORDINATOR_LOST):
            self._pending, self._cause_deadline = failure, now + CAUSE_WAIT_S
            return [Say(f"{who} exited with {code} (a failure elsewhere); stopping {self.nproc} workers"), Stop()]
        return [Say(f"{who} failed: {why}; stopping {self.nproc} workers"), Stop(), *self._ask(failure)]

    # Replacements (Recover.REPLACE).
    def _failed_elsewhere(self, failure: Failure) -> list[Action]:
        """The coordinator declared a process failed: this host's worker is killed if it still runs (hung), so that
        it can be replaced; another host's is its own agent's to replace. A process of this hostname whose id this
        agent does not know yet (it hung before the ids were learned) waits for the ids, asked for again."""
        rank = next((r for r, pid in self.ids.items() if pid == failure.process_id), None)
        if rank is None and failure.host == self.host and len(self.ids) < self.nproc:
            assert self.attempt is not None
            self._unplaced[failure.process_id] = failure
            return [Say(f"{failure.describe()}; learning this host's process ids to find out whether it is one of "
                        "its workers"), LearnIds(self.attempt)]
        if rank is None:
            return [Say(f"{failure.describe()}; another host's process: the workers here keep running")]
        state = self.workers[rank]
        if not state.running:
            return []  # it exited: its replacement is asked for already
        state.declared = failure
        return [Say(f"{failure.describe()}; killing its worker (local rank {rank}) so that it can be replaced"),
                Kill(rank)]

    def _replace_answered(self, event: ReplaceAnswered, now: float) -> list[Action]:
        state = self.workers.get(event.local_rank)
        if event.attempt != self.attempt or self.phase is not Phase.RUNNING or state is None or not state.asked:
            return self._job(event.view)
        if event.refused:  # the job ends as without --recover replace: the whole job restarts, or its budget ends it
            assert self.attempt is not None
            self.phase = Phase.RESTARTING
            failure = state.declared or Failure(self.attempt, self.process_id(event.local_rank), self.host,
                                                "its replacement was refused")
            return [Say(f"{event.refused}; stopping {self.nproc} workers"), Stop(), *self._ask(failure)]
        if event.view.exhausted or event.view.attempt != self.attempt:
            return self._job(event.view)
        state.decided_at = now
        return []

    def _replace_seen(self, failure: Failure) -> list[Action]:
        self._waits.done({failure.process_id})
        if self.phase is not Phase.RUNNING or failure.attempt != self.attempt:
            return []
        rank = next((r for r, pid in self.ids.items() if pid == failure.process_id), None)
        if rank is None or not self.workers[rank].asked:
            return [Say(f"process {failure.process_id} is replaced by its agent")]
        return self._start_replacement(rank)

    def _start_replacement(self, rank: int) -> list[Action]:
        assert self.attempt is not None
        state = self.workers[rank]
        state.incarnation += 1
        state.running, state.asked, state.declared, state.decided_at = True, False, None, None
        if (serial := self.spares.take()) is not None:
            return [Say(f"handing process {self.process_id(rank)} (local rank {rank}) to spare {serial}; the others "
                        "keep running"), HandOff(serial, self.attempt, rank, state.incarnation)]
        return [Say(f"starting a new worker for process {self.process_id(rank)} (local rank {rank}); the others keep "
                    "running"), StartWorker(self.attempt, rank, state.incarnation)]

    # Lost hosts.
    def _as_spare(self, event: Event) -> list[Action]:
        """A spare host: it follows the job's attempts and starts workers only for the ids handed to it."""
        if isinstance(event, JobUpdate):
            if event.view.exhausted:
                return self._job(event.view)
            said = [] if self.attempt is not None else [Say(f"spare host: running no worker until a lost host's "
                                                            f"processes are handed to it (up to {self.nproc})")]
            self.attempt = event.view.attempt if self.attempt is None else max(self.attempt, event.view.attempt)
            return said
        if not isinstance(event, HostTakenOverSeen) or not event.mine or not event.process_ids:
            return []
        ids = dict(enumerate(event.process_ids))
        self.spare, self.nproc, self.ids, self.attempt = False, len(ids), ids, event.failure.attempt
        self._took_over, self.named_ids = True, dict(ids) if event.explicit else {}
        self.phase, self.workers = Phase.RUNNING, {rank: WorkerState() for rank in ids}
        self._finished.clear()
        return [Say(f"taking over processes {', '.join(map(str, event.process_ids))} of the lost host "
                    f"{event.failure.host}: {event.failure.reason}"), StartIds(self.attempt, ids)]

    def _went_on(self, failure: Failure) -> list[Action]:
        """The job went on without a failed process (``--on-failure elastic``): with replace, this host's worker is
        killed if it still runs (hung) and replaced, and nobody waits for another host's; without, as any failure."""
        if self.recover is not Recover.REPLACE or self.phase is not Phase.RUNNING:
            return self._process_failed(failure)
        if failure.attempt != self.attempt or failure.process_id in self.ids.values():
            return self._process_failed(failure)
        return [Say(f"{failure.describe()}; the job goes on without it (the coordinator runs --on-failure elastic), "
                    "and takes it back when it is replaced, a spare host takes it over or its agent comes back")]

    def _await_host(self, failure: Failure, now: float) -> list[Action]:
        """Another host's process failed (with replace): its replacement, a spare host or its agent's return is
        awaited for up to ``replace_timeout``."""
        if (self.recover is Recover.REPLACE and self.phase is Phase.RUNNING and failure.attempt == self.attempt
                and failure.process_id != UNKNOWN_PROCESS and failure.process_id not in self.ids.values()):
            self._waits.add(failure, now)
        return []

    def _host_back(self, event: HostTakenOverSeen) -> list[Action]:
        if event.process_ids:
            self._waits.done(set(event.process_ids))
            return [Say(f"{event.failure.reason}; the workers here keep running")]
        if self._waits.back(event.failure.host):
            return [Say(f"the agent on {event.failure.host} came back; the workers here keep running")]
        return []

    def _waited(self, now: float) -> list[Action]:
        line, given_up = self._waits.check(self.attempt, now)
        if not given_up:
            return [] if line is None else [Say(line)]
        assert self.attempt is not None
        self._shrinking = given_up[0]
        ids = tuple(f.process_id for f in given_up)
        return [Say(f"{line}; asking the coordinator to go on without processes {', '.join(map(str, ids))} (a "
                    "shrink, where it runs with --min-processes)"), AskShrink(self.attempt, given_up[0], ids)]

    def _shrink_answered(self, event: ShrinkAnswered) -> list[Action]:
        failure = self._shrinking
        if event.attempt != self.attempt or self.phase is not Phase.RUNNING or failure is None:
            return self._job(event.view)
        self._shrinking = None
        if event.refused:  # the job ends as without a shrink: the whole job restarts, or its budget ends it
            self.phase = Phase.RESTARTING
            return [Say(f"the coordinator did not shrink the job: {event.refused}; stopping {self.nproc} workers"),
                    Stop(), *self._ask(failure)]
        if event.view.exhausted or event.view.attempt != self.attempt:
            return self._job(event.view)
        return [Say("the job shrank to its survivors: the workers here go on without the failed processes")]

    def _spare_event(self, event: SpareExited | HandOffFailed | Tick, now: float) -> list[Action]:
        """A spare's exit, a hand-off that found its spare gone (the replacement starts cold), or spares due."""
        if isinstance(event, SpareExited):
            line = self.spares.exited(event.serial, exit_reason(event.returncode), now)
            return [] if line is None else [Say(line)]
        if isinstance(event, HandOffFailed):
            state = self.workers.get(event.local_rank)
            if event.attempt != self.attempt or self.phase is not Phase.RUNNING or state is None \
                    or state.incarnation != event.incarnation:
                return []
            return [Say(f"spare {event.serial} could not take process {self.process_id(event.local_rank)} "
                        f"({event.reason}); starting a new worker instead"),
                    StartWorker(event.attempt, event.local_rank, event.incarnation)]
        return list(self.spares.due(now))

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
