"""``ifrt run``'s shell: flags, signals, the event loop, and the actions of the agent's decisions carried out."""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time

from ifrt import clusters, failfast
from ifrt.agent_credential import (
    AGENT_CREDENTIAL_FILE_ENV,
    AGENT_KEY_FILE_ENV,
    UnixUser,
    hide_this_process,
    reach_warnings,
)
from ifrt.errors import EXIT_COORDINATOR_LOST, IfrtError, PermissionDenied
from ifrt.local_address import local_address_toward
from ifrt.run.agent import DEFAULT_REPLACE_TIMEOUT_S, EXIT_USAGE, Agent, Recover, exit_reason, workers_status
from ifrt.run.flags import check, chosen_worker_user
from ifrt.run.job import JobLink
from ifrt.run.messages import (
    AskNextAttempt,
    AskRefused,
    AskReplace,
    AskShrink,
    Event,
    Exit,
    IdsKnown,
    Interrupted,
    JobUpdate,
    JobView,
    Kill,
    LearnIds,
    LinkFailed,
    ReplaceAnswered,
    Say,
    ShrinkAnswered,
    Start,
    StartIds,
    StartWorker,
    Stop,
    Tick,
    WorkerExited,
)
from ifrt.run.spares import HandOff, HandOffFailed, SpareExited, SparePool, StartSpare
from ifrt.run.worker_link import AGENT, AgentLink
from ifrt.run.workers import Worker, WorkerUser, stop_all, transfer_binds, worker_env
from ifrt.safe_text import SafeFormatter, safe
from ifrt.settings import AGENT_SOCKET_ENV, PROCESS_ID_ENV
from ifrt.spare import HANDED, SPARE_ENV, hand_off_line

log = logging.getLogger("ifrt.run")

TICK_S = 0.1
IDS_TIMEOUT_S = 600.0
"""How long the agent asks for its workers' ids in one attempt (they register within their own timeout)."""


def main(args: argparse.Namespace) -> int:
    """Runs the agent until the job ends here; its exit code (see docs/failures.md)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter("ifrt run: %(message)s"))  # hosts and reasons from the wire, escaped
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    for name in ("ifrt.client", "ifrt.settings"):  # the agent's own lines only; their warnings still show
        logging.getLogger(name).setLevel(logging.WARNING)
    command = args.worker_command[1:] if args.worker_command[:1] == ["--"] else args.worker_command
    problem = check(args, command)
    if problem is not None:
        print(f"ifrt run: {safe(problem)}", file=sys.stderr)
        return EXIT_USAGE
    user = chosen_worker_user(args)
    if isinstance(user, str):
        print(f"ifrt run: {safe(user)}", file=sys.stderr)
        return EXIT_USAGE
    hidden = hide_this_process()  # before any secret is read: nothing of it shows in /proc to the workers' user
    sources = {"the agent credential file": args.agent_credential_file or os.environ.get(AGENT_CREDENTIAL_FILE_ENV),
               "the agent key file": args.agent_key_file or os.environ.get(AGENT_KEY_FILE_ENV)}
    if hidden is not None and any(sources.values()):
        log.warning("this agent stays dumpable (%s): processes of its user may read its memory and the credential "
                    "in it", hidden)
    for line in reach_warnings(sources, UnixUser.current() if user is None else user.ids):
        log.warning("%s", line)
    try:
        link = JobLink(args.coordinator, failfast.failover_window_from_env(), workers=args.nproc_per_host,
                       max_restarts=args.max_restarts, token_file=args.token_file, recover=args.recover,
                       spare_host=args.spare_host, replace_timeout_s=args.replace_timeout,
                       credential_file=args.agent_credential_file, key_file=args.agent_key_file)
    except IfrtError as e:
        print(f"ifrt run: {type(e).__name__}: {safe(e)}", file=sys.stderr)
        return EXIT_USAGE
    with link:
        return Shell(args, command, link, user).run()


class Shell:
    """The agent's I/O: one queue of events (the watch, the workers' exits, signals, answers, ticks) fed to the
    decisions one at a time, and their actions carried out."""

    def __init__(self, args: argparse.Namespace, command: list[str], link: JobLink,
                 user: WorkerUser | None = None) -> None:
        self.args, self.command, self.link, self.user = args, command, link, user
        settings = link.settings
        self.host_rank = args.host_rank if args.host_rank is not None else settings.process_id
        self.num_hosts = args.num_hosts if args.num_hosts is not None else settings.num_processes
        nproc = args.nproc_per_host
        explicit = {} if self.host_rank is None else {r: self.host_rank * nproc + r for r in range(nproc)}
        spare = getattr(args, "spare_host", False)  # flags built by hand (tests) may predate these
        timeout = getattr(args, "replace_timeout", DEFAULT_REPLACE_TIMEOUT_S)
        self.agent = Agent(nproc, settings.hostname, ids={} if spare else explicit, recover=Recover(args.recover),
                           spare=spare, replace_timeout=timeout, spares=SparePool(getattr(args, "spare", 0)))
        launcher = clusters.detect(os.environ)
        self.launcher_variables = () if launcher is None else launcher.variables
        self.binds = transfer_binds(local_address_toward(settings.coordinators), nproc)
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.workers: dict[int, Worker] = {}
        """The current worker of each local rank."""
        self.envs: dict[int, dict[str, str]] = {}
        """Each local rank's environment in the current attempt (a replacement gets the same)."""
        self._learner: threading.Thread | None = None
        self.spares: dict[int, Worker] = {}
        """The idle warm spares, by serial."""
        self.worker_link: AgentLink | None = None
        """With ``--worker-link agent``: the workers' local server, started with the first workers."""
        self._serials: dict[Worker, int] = {}
        """Each running worker's serial for its rank (``--worker-link agent``: its exit is reported by it)."""

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, _frame: self.events.put(Interrupted(s)))
        self.link.follow(self.events.put)
        try:
            while True:
                try:
                    event = self.events.get(timeout=TICK_S)
                except queue.Empty:
                    event = Tick()
                for action in self.agent.handle(event, time.monotonic()):
                    if isinstance(action, Exit):
                        return self._exit(action)
                    self._do(action)
        finally:  # an exception here (a bug) must not leave the workers running without their agent
            stop_all([*self.workers.values(), *self.spares.values()], self.args.grace_seconds)
            if self.worker_link is not None:
                self.worker_link.close()

    def _link_workers(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the agent's socket (``--worker-link agent``), its local server started on first use."""
        if getattr(self.args, "worker_link", AGENT) != AGENT:  # not an outer agent's either
            return {k: v for k, v in env.items() if k != AGENT_SOCKET_ENV}
        if self.worker_link is None:
            try:
                self.worker_link = AgentLink(self.link, self.args.nproc_per_host + getattr(self.args, "spare", 0),
                                             self._running, lambda ids: self.events.put(IdsKnown(ids)),
                                             lambda rank: None if (w := self.workers.get(rank)) is None else w.pid)
            except (OSError, IfrtError) as e:
                log.warning("cannot serve the workers on a local socket (%s: %s): they reach the coordinator "
                            "directly, as with --worker-link direct", type(e).__name__, e)
                self.args.worker_link = "direct"
                return {k: v for k, v in env.items() if k != AGENT_SOCKET_ENV}
            if self.user is not None:  # the workers' user enters the directory and connects; nobody else
                server = self.worker_link.server
                for path in (server.directory, server.path):
                    os.chown(path, self.user.ids.uid, self.user.ids.gid)
        return {**env, AGENT_SOCKET_ENV: self.worker_link.socket}

    def _running(self) -> int:
        """How many of this host's workers run now (not reaped yet: no wait of its own, from any thread)."""
        return sum(w.process.returncode is None for w in list(self.workers.values()))

    def _do(self, action: Say | Start | Stop | AskNextAttempt | StartWorker | Kill | AskReplace | LearnIds
            | StartIds | StartSpare | HandOff | AskShrink) -> None:
        if isinstance(action, StartSpare | HandOff):
            self._spare(action)
        elif isinstance(action, Say):
            log.info("%s", action.line)
        elif isinstance(action, StartIds):
            self._start_ids(action.attempt, action.ids)
        elif isinstance(action, Start):
            self._start(action.attempt)
        elif isinstance(action, StartWorker):
            self._spawn(action.attempt, action.local_rank, action.incarnation)
        elif isinstance(action, Kill) and (worker := self.workers.get(action.local_rank)) is not None:
            worker.signal(signal.SIGKILL)
        elif isinstance(action, Stop):
            stop_all(list(self.workers.values()), self.args.grace_seconds, action.signum)
        elif isinstance(action, AskNextAttempt):
            threading.Thread(target=self._ask, args=(action,), name="ifrt-run-next-attempt", daemon=True).start()
        elif isinstance(action, AskReplace):
            threading.Thread(target=self._ask_replace, args=(action,), name="ifrt-run-replace", daemon=True).start()
        elif isinstance(action, AskShrink):
            threading.Thread(target=self._ask_shrink, args=(action,), name="ifrt-run-shrink", daemon=True).start()
        elif isinstance(action, LearnIds):
            self._learn_ids(action.attempt)

    def _start(self, attempt: int) -> None:
        nproc = self.agent.nproc  # --nproc-per-host, or the ids a spare host took over
        self.workers = {}
        self.envs = {rank: worker_env(os.environ, self.link.settings, attempt=attempt, local_rank=rank, nproc=nproc,
                                      host_rank=self.host_rank, num_hosts=self.num_hosts,
                                      token_file=self.args.token_file, launcher_variables=self.launcher_variables,
                                      transfer_bind=self.binds[rank], user=self.user)
                     for rank in range(nproc)}
        self.envs = {rank: self._link_workers(env) for rank, env in self.envs.items()}
        if self.worker_link is not None:
            self.worker_link.new_attempt(attempt)
        for rank, process_id in self.agent.named_ids.items():
            self.envs[rank][PROCESS_ID_ENV] = str(process_id)
        for rank in range(nproc):
            self._spawn(attempt, rank, 0)
        if len(self.agent.ids) < nproc and self.worker_link is None:  # the host's registration answers name them
            self._learn_ids(attempt)

    def _learn_ids(self, attempt: int) -> None:
        """Asks for this host's workers' ids in a thread (one per attempt at a time): IdsKnown once the coordinator
        knows them all."""
        if self._learner is not None and self._learner.name == f"ifrt-run-ids-{attempt}" and self._learner.is_alive():
            return
        nproc = self.args.nproc_per_host
        self._learner = threading.Thread(
            target=self.link.learn_ids, name=f"ifrt-run-ids-{attempt}", daemon=True,
            kwargs=dict(local_ranks=nproc, attempt=attempt, emit=self.events.put, timeout=IDS_TIMEOUT_S,
                        until=lambda: self.agent.attempt != attempt or len(self.agent.ids) == nproc))
        self._learner.start()

    def _start_ids(self, attempt: int, ids: dict[int, int]) -> None:
        """A spare host's workers for the ids it took over: each named explicitly, as the coordinator expects."""
        self.workers = {}
        for rank, process_id in ids.items():
            env = worker_env(os.environ, self.link.settings, attempt=attempt, local_rank=rank, nproc=len(ids),
                             host_rank=None, num_hosts=None, token_file=self.args.token_file,
                             launcher_variables=self.launcher_variables, transfer_bind=self.binds[rank], user=self.user)
            self.envs[rank] = self._link_workers({**env, PROCESS_ID_ENV: str(process_id)})
            self._spawn(attempt, rank, 0)

    def _spawn(self, attempt: int, rank: int, incarnation: int) -> None:
        """Starts local rank ``rank``'s worker; one that cannot start is reported as a worker that failed (127)."""
        label = None if self.args.no_prefix else self._label(rank)
        serial = self._started(rank)  # before it can register
        try:
            worker = Worker(self.command, self.envs[rank], attempt=attempt, local_rank=rank, label=label,
                            incarnation=incarnation, user=None if self.user is None else self.user.ids)
        except OSError as e:
            self.events.put(WorkerExited(attempt, rank, 127, incarnation, f"could not start: {e}"))
            return
        self._serials[worker] = serial
        self.workers[rank] = worker
        threading.Thread(target=self._await, args=(worker,), name="ifrt-run-wait", daemon=True).start()

    def _spare(self, action: StartSpare | HandOff) -> None:
        """Starts a warm spare, or hands one the replacement of a local rank (``ifrt.spare``)."""
        if isinstance(action, HandOff):
            spare = self.spares.pop(action.serial, None)
            variables = {k: self.envs[action.local_rank][k] for k in HANDED if k in self.envs[action.local_rank]}
            if spare is not None:
                self._serials[spare] = self._started(action.local_rank)
            why = "it did not start" if spare is None else spare.hand_off(
                hand_off_line(variables), attempt=action.attempt, local_rank=action.local_rank,
                incarnation=action.incarnation)
            if why is None and spare is not None:
                self.workers[action.local_rank] = spare
            else:
                self.events.put(HandOffFailed(action.serial, action.attempt, action.local_rank, action.incarnation,
                                              why))
            return
        env = {k: v for k, v in self.envs[0].items() if k not in HANDED}
        env[SPARE_ENV] = "1"
        serial, cell = action.serial, []

        def label() -> str:
            return f"spare {serial}" if not cell or cell[0].local_rank < 0 else self._label(cell[0].local_rank)()

        try:
            spare = Worker(self.command, env, attempt=-1, local_rank=-1, spare=True,
                           label=None if self.args.no_prefix else label,
                           user=None if self.user is None else self.user.ids)
        except OSError as e:
            self.events.put(SpareExited(serial, 127))
            log.info("spare %d could not start: %s", serial, e)
            return
        cell.append(spare)
        self.spares[serial] = spare
        log.info("spare %d started (pid %d)", serial, spare.pid)
        threading.Thread(target=self._await_spare, args=(serial, spare), name="ifrt-run-wait", daemon=True).start()

    def _await_spare(self, serial: int, spare: Worker) -> None:
        spare.process.wait()
        with spare.lock:
            if spare.local_rank >= 0:
                self._exited(spare, spare.process.returncode)
        code = spare.wait()
        with spare.lock:  # handed a process (its exit is that worker's), or not
            handed = spare.local_rank >= 0
        self.events.put(WorkerExited(spare.attempt, spare.local_rank, code, spare.incarnation) if handed
                        else SpareExited(serial, code))

    def _label(self, rank: int):
        def label() -> str:
            process_id = self.agent.ids.get(rank)
            return f"local {rank}" if process_id is None else str(process_id)
        return label

    def _await(self, worker: Worker) -> None:
        self._exited(worker, worker.process.wait())  # before its last output lines are copied
        code = worker.wait()
        clash = None if self.worker_link is None else self.worker_link.registrar.clashes.get(worker.local_rank)
        self.events.put(WorkerExited(worker.attempt, worker.local_rank, code, worker.incarnation,
                                     f"{exit_reason(code)}: {clash}" if code and clash else ""))

    def _started(self, rank: int) -> int:
        """The serial of a worker that starts for ``rank`` (0 without the agent link)."""
        return 0 if self.worker_link is None else self.worker_link.worker_started(rank)

    def _exited(self, worker: Worker, code: int) -> None:
        """The coordinator hears of a worker's exit through this agent at once, before the agent reacts."""
        serial = self._serials.pop(worker, None)
        if self.worker_link is not None and serial is not None:
            try:
                self.worker_link.worker_exited(worker.local_rank, serial, code)
            except Exception:  # the exit is still the agent's to act on
                log.exception("could not report local rank %d's exit to the coordinator", worker.local_rank)

    def _ask(self, action: AskNextAttempt) -> None:
        try:
            view = self.link.next_attempt(action.ended_attempt, action.failure)
        except PermissionDenied as e:
            self.events.put(AskRefused(action.ended_attempt, f"the coordinator refused this report: {e}"))
            return
        except IfrtError as e:
            code = EXIT_COORDINATOR_LOST if e.retryable else EXIT_USAGE
            self.events.put(LinkFailed(f"the coordinator did not decide the next attempt: {type(e).__name__}: {e}",
                                       code))
            return
        self.events.put(JobUpdate(view))

    def _ask_replace(self, action: AskReplace) -> None:
        try:
            view = self.link.next_attempt(action.attempt, action.failure, replace=True)
        except PermissionDenied as e:
            self.events.put(ReplaceAnswered(action.attempt, action.local_rank, self._view(),
                                            f"the coordinator refused to replace process {action.failure.process_id}: "
                                            f"{e}"))
            return
        except IfrtError as e:
            code = EXIT_COORDINATOR_LOST if e.retryable else EXIT_USAGE
            self.events.put(LinkFailed(f"the coordinator did not decide the replacement of process "
                                       f"{action.failure.process_id}: {type(e).__name__}: {e}", code))
            return
        self.events.put(ReplaceAnswered(action.attempt, action.local_rank, view))

    def _ask_shrink(self, action: AskShrink) -> None:
        try:
            view, refused = self.link.shrink(action.attempt, action.failure, action.process_ids)
        except PermissionDenied as e:
            view, refused = self._view(), f"it refused: {e}"
        except IfrtError as e:
            code = EXIT_COORDINATOR_LOST if e.retryable else EXIT_USAGE
            self.events.put(LinkFailed(f"the coordinator did not decide the shrink: {type(e).__name__}: {e}", code))
            return
        self.events.put(ShrinkAnswered(action.attempt, view, refused))

    def _view(self) -> JobView:
        """The job as this agent last saw it (for an answer that carries none)."""
        return JobView(self.agent.attempt or 0, self.agent.failures)

    def _exit(self, action: Exit) -> int:
        # every worker has ended already, or ends now; the idle spares with them (their codes are no worker's)
        workers = list(self.workers.values())
        codes = stop_all([*workers, *self.spares.values()], self.args.grace_seconds)[:len(workers)]
        code = workers_status(codes) if action.code is None else action.code
        log.info("exiting with %d", code)
        return code
