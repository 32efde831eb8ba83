"""``ifrt run``'s link to the coordinator: the job's watch (``WatchJob``), ``NextAttempt``, and the ids of this
host's workers, over the client's connections and retries (the next replica on UNAVAILABLE, backoff)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub, JobAgentsStub
from ifrt.agent_credential import AGENT_CREDENTIAL_METADATA, agent_credential
from ifrt.connection import Connection
from ifrt.errors import EXIT_COORDINATOR_LOST, HostHeld, IfrtError, from_rpc_error
from ifrt.local_address import local_address_toward
from ifrt.run.agent import EXIT_USAGE
from ifrt.run.messages import (
    Event,
    Failure,
    HostTakenOverSeen,
    IdsKnown,
    JobUpdate,
    JobView,
    LinkFailed,
    ProcessFailedSeen,
    ReplaceSeen,
)
from ifrt.security import new_process_secret
from ifrt.settings import DISCOVERY_TIMEOUT_ENV, discovery_timeout, resolve

log = logging.getLogger("ifrt.run")

IDS_POLL_S = 0.2
"""How often the agent asks the coordinator for its workers' ids while they register."""


def view_of(state: pb.JobState) -> JobView:
    return JobView(state.attempt, tuple(failure_of(f) for f in state.failures), state.exhausted, state.max_restarts,
                   state.earlier_failures, state.replacements)


def failure_of(f: pb.AttemptFailure) -> Failure:
    return Failure(f.attempt, f.process_id, f.host, f.reason)


def event_of(message: pb.JobEvent, agent_uid: str = "") -> Event | None:
    """The agent's event for a watch's message (``agent_uid``: this agent's, to know what is handed to it)."""
    kind = message.WhichOneof("kind")
    if kind == "taken_over":
        t = message.taken_over
        return HostTakenOverSeen(failure_of(t.failure), t.host, tuple(t.process_ids),
                                 bool(agent_uid) and t.agent_uid == agent_uid, t.explicit_ids)
    if kind in ("process_failed", "went_on"):
        return ProcessFailedSeen(failure_of(getattr(message, kind)), went_on=kind == "went_on")
    if kind == "replaced":
        return ReplaceSeen(failure_of(message.replaced))
    if kind in ("state", "attempt_started", "exhausted"):
        return JobUpdate(view_of(getattr(message, kind)))
    return None  # a kind this agent does not know yet


class _AgentConnection(Connection):
    """The connection's stubs carry the JobAgents service's methods too (same channel, same retries)."""

    def stub(self, target: str) -> CoordinatorStub:
        stub = super().stub(target)
        if not hasattr(stub, "NextAttempt"):
            jobs = JobAgentsStub(self.channel(target))
            stub.WatchJob, stub.NextAttempt = jobs.WatchJob, jobs.NextAttempt  # type: ignore[attr-defined]
        return stub


class JobLink:
    """The job's agent on one host, running ``workers`` workers: no process of the job (no registration or session),
    but an agent of it, which proves who it is as a process does (a random secret of its own on every call, whose
    hash the coordinator keeps when the agent joins). ``max_restarts``: the restart budget it expects (None: the
    job's)."""

    def __init__(self, coordinator: str | None, failover_window_s: float, *, workers: int,
                 max_restarts: int | None = None, recover: str = "", spare_host: bool = False,
                 replace_timeout_s: float = 0.0, credential_file: str | None = None, key_file: str | None = None,
                 **kwargs: Any) -> None:
        self.settings = resolve(coordinator, **kwargs)
        credential = agent_credential(self.settings.hostname, credential_file=credential_file, key_file=key_file)
        self.connection = _AgentConnection(self.settings, new_process_secret(), extra_metadata=(
            ((AGENT_CREDENTIAL_METADATA, credential),) if credential else ()))
        self.replace_timeout_s = replace_timeout_s
        self.agent_uid = uuid.uuid4().hex
        self.workers, self.max_restarts = workers, max_restarts
        self.recover, self.spare_host = recover, spare_host
        self.failover_window_s = failover_window_s
        first = discovery_timeout(kwargs.get("environ"), default=0.0)
        self.first_contact = ((first, DISCOVERY_TIMEOUT_ENV) if first else
                              (failover_window_s, "the failover window"))
        """How long the agent waits for a coordinator it never reached (pods started before it), and what set that:
        ``IFRT_DISCOVERY_TIMEOUT`` where it is set, else the failover window."""
        self._stop = threading.Event()

    def follow(self, emit: Callable[[Event], None]) -> threading.Thread:
        """Follows the job in a thread: every event to ``emit``, reconnecting (the next replica) until closed;
        LinkFailed when no replica answers within the failover window, or one refuses the agent."""
        thread = threading.Thread(target=self._follow, args=(emit,), name="ifrt-run-watch", daemon=True)
        thread.start()
        return thread

    def _follow(self, emit: Callable[[Event], None]) -> None:
        request = pb.WatchJobRequest(host=self.settings.hostname, agent_uid=self.agent_uid, workers=self.workers,
                                     max_restarts=self.max_restarts, recover=self.recover,
                                     spare_host=self.spare_host, replace_timeout_s=self.replace_timeout_s)
        lost_since: float | None = None
        watched = False
        while not self._stop.is_set():
            target = self.connection.current()
            try:
                for message in self.connection.stub(target).WatchJob(request):  # type: ignore[attr-defined]
                    if lost_since is not None:
                        log.warning("watching the job again through %s", target)
                    lost_since, watched = None, True
                    self.connection.answered(target)
                    if (event := event_of(message, self.agent_uid)) is not None:
                        emit(event)
                error: IfrtError = from_rpc_error(_Ended(), target)
            except grpc.RpcError as e:
                error = from_rpc_error(e, target)
            except IfrtError as e:  # refused before the call (TLS on one side only)
                error = e
            if self._stop.is_set():
                return
            if error.retryable:
                try:  # TLS on one side only, or a web server on the port: no retry heals it
                    self.connection.check_transport(target)
                except IfrtError as e:
                    error = e
            held = isinstance(error, HostHeld)  # its host's other agent may be gone without the coordinator knowing yet
            if not error.retryable and not held:
                emit(LinkFailed(f"the coordinator refuses this agent: {type(error).__name__}: {error}", EXIT_USAGE))
                return
            now = time.monotonic()
            window, why = (self.failover_window_s, "the failover window") if watched else self.first_contact
            if lost_since is None:
                lost_since = now
                if held:
                    log.warning("%s: waiting up to %gs (%s) for that agent's watch to end: one cut off from the "
                                "coordinator is dropped within its heartbeat timeout", error, window, why)
                elif watched:
                    log.warning("lost the job's watch (%s); reconnecting", error)
                else:
                    log.warning("cannot reach the coordinator yet (%s); trying every replica for up to %gs (%s; "
                                "%s or IFRT_FAILOVER_WINDOW sets it)", error, window, why, DISCOVERY_TIMEOUT_ENV)
            elif now - lost_since > window and held:
                emit(LinkFailed(f"the coordinator refuses this agent for {now - lost_since:.0f}s ({why}): {error}",
                                EXIT_USAGE))
                return
            elif now - lost_since > window:
                emit(LinkFailed(f"no coordinator replica ({', '.join(self.settings.coordinators)}) answered for "
                                f"{now - lost_since:.0f}s ({why}): {error}", EXIT_COORDINATOR_LOST))
                return
            self.connection.rotate(target)
            self._stop.wait(self.connection.backoff.next())

    def next_attempt(self, ended: int, failure: Failure, replace: bool = False) -> JobView:
        """The coordinator's decision on the end of attempt ``ended`` (retried across replicas within the failover
        window, the same request id each time: decided once), under the job's restart budget; with ``replace``, on
        replacing the failed process (one of this agent's workers) while the attempt goes on."""
        request = pb.NextAttemptRequest(
            ended_attempt=ended, agent_uid=self.agent_uid, request_id=uuid.uuid4().hex, replace=replace,
            failure=pb.AttemptFailure(attempt=failure.attempt, process_id=failure.process_id, host=failure.host,
                                      reason=failure.reason))
        answer = self.connection.call("NextAttempt", lambda _: request, time.monotonic() + self.failover_window_s)
        return view_of(answer.state)

    def shrink(self, attempt: int, failure: Failure, process_ids: tuple[int, ...]) -> tuple[JobView, str]:
        """The coordinator's decision on dropping ``process_ids`` (failed, neither replaced nor taken over) while
        attempt ``attempt`` goes on (decided once, retried as ``next_attempt``): the job's state, and why it refused
        ("": shrunk). While a process's own agent may still replace it, the coordinator says how long to wait: this
        waits and asks again."""
        request = pb.NextAttemptRequest(
            ended_attempt=attempt, agent_uid=self.agent_uid, request_id=uuid.uuid4().hex, shrink=process_ids,
            failure=pb.AttemptFailure(attempt=failure.attempt, process_id=failure.process_id, host=failure.host,
                                      reason=failure.reason))
        while True:
            answer = self.connection.call("NextAttempt", lambda _: request, time.monotonic() + self.failover_window_s)
            if answer.shrink_wait_s <= 0 or self._stop.is_set():
                return view_of(answer.state), answer.shrink_refused
            log.info("the coordinator waits %.1fs more before it decides the shrink: a failed process's own agent may "
                     "still replace it", answer.shrink_wait_s)
            self._stop.wait(min(answer.shrink_wait_s, 60.0))

    def learn_ids(self, local_ranks: int, attempt: int, emit: Callable[[Event], None],
                  until: Callable[[], bool], timeout: float) -> None:
        """Asks the coordinator, until it knows them (or ``until()``), the ids of this host's ``local_ranks``
        workers: processes of this hostname and address by local rank. Emits IdsKnown once."""
        address = local_address_toward(self.settings.coordinators)
        deadline = time.monotonic() + timeout
        while not until() and not self._stop.is_set() and time.monotonic() < deadline:
            try:
                status = self.connection.call("Status", lambda _: pb.StatusRequest(), time.monotonic() + 5.0)
            except IfrtError as e:
                log.info("cannot ask for the workers' ids yet: %s", e)
            else:
                ids = {p.local_rank: p.process_id for p in status.processes
                       if p.HasField("process_id") and p.hostname == self.settings.hostname
                       and p.host_address == address and 0 <= p.local_rank < local_ranks}
                if len(ids) == local_ranks:
                    log.info("attempt %d: this host's workers are processes %s", attempt,
                             ", ".join(str(ids[r]) for r in sorted(ids)))
                    emit(IdsKnown(ids))
                    return
            self._stop.wait(IDS_POLL_S)

    def close(self) -> None:
        self._stop.set()
        self.connection.close()

    def __enter__(self) -> JobLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Ended(grpc.RpcError):
    """A watch the coordinator ended without an error (it stops serving): reconnect as after UNAVAILABLE."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the coordinator ended the job's watch"

    def trailing_metadata(self) -> tuple:
        return ()
