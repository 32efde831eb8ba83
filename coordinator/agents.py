"""The JobAgents service: the job as its host agents (``ifrt run``) see it, beside the Coordinator service.

An agent is no process of the job: it joins the job and watches it (``WatchJob``: the current attempt, then each
failure of a process of it, each new attempt and the end of the restarts, in the order the coordinator decided them)
and, after a failure, asks for the next attempt (``NextAttempt``, decided once by the state machine and journaled).
An agent proves who it is as a process does: a secret of its own in the call metadata, whose hash the job keeps
(see coordinator.core.attempts for who may decide what). Watches are bounded in number (``--max-agents``) and each in
unread bytes (``--max-session-backlog-bytes``), like sessions.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time

import grpc

from coordinator.calls import abort, caller_proof, internal_errors, metadata_value, parse, peer_host
from coordinator.core.effects import Effect
from coordinator.core.job_records import (
    UNKNOWN_PROCESS,
    Agent,
    AttemptFailure,
    AttemptProcessFailed,
    AttemptsExhausted,
    AttemptStarted,
    HostTakenOver,
    JobShrunk,
    JobView,
    NextAttempt,
    ProcessReplaced,
)
from coordinator.core.limits import FLAGS, Limits, shown
from coordinator.outbox import Outbox
from coordinator.service import CoordinatorService
from ifrt._generated import coordinator_pb2 as pb
from ifrt.agent_credential import AGENT_CREDENTIAL_METADATA, credential_holds
from ifrt.errors import CoordinatorUnavailable, IfrtError, InvalidArgument, PermissionDenied, ResourceExhausted

log = logging.getLogger("ifrt.coordinator")

AGENTS_SERVICE = pb.DESCRIPTOR.services_by_name["JobAgents"].full_name
WAIT_LOGGED_S = 5.0
"""How often the log says which lost host the job waits for."""
RECOVER_MODES = ("", "restart", "replace")


class _Closed:
    """Queued to end a watch with ``error``."""

    def __init__(self, error: IfrtError) -> None:
        self.error = error


class JobAgentsService:
    """Serves WatchJob and NextAttempt from ``service``'s state; hears its effects to feed every watch."""

    def __init__(self, service: CoordinatorService) -> None:
        self._service = service
        self._limits: Limits = service.replica.config.limits
        self._watches: set[Outbox] = set()
        self._watching: dict[str, int] = {}  # agent uid -> its watches open on this replica
        self._gone_since: dict[str, float] = {}  # agent uid -> when its last watch here ended
        self._epoch, self._since = -1, 0.0  # the state watched, and since when this replica serves it
        self._declared_at: dict[int, float] = {}  # process id -> when it was declared failed in this attempt
        service.effect_listeners.append(self._on_effects)
        service.step_down_listeners.append(self._on_step_down)
        service.agents_watching = lambda: frozenset(self._watching)

    @property
    def watching(self) -> int:
        """Job watches open now."""
        return len(self._watches)

    def handlers(self) -> grpc.GenericRpcHandler:
        """Raw-bytes handlers for WatchJob and NextAttempt."""
        return grpc.method_handlers_generic_handler(AGENTS_SERVICE, {
            "WatchJob": grpc.unary_stream_rpc_method_handler(internal_errors(self.watch_job)),
            "NextAttempt": grpc.unary_unary_rpc_method_handler(internal_errors(self.next_attempt)),
        })

    async def watch_job(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        """Sends the JobState, then every job event after it, until the agent goes or this replica steps down."""
        request = await parse(pb.WatchJobRequest, raw, context)
        what = f"job watch of the agent on {shown(request.host)}"
        service, limits = self._service, self._limits
        try:
            _check_watch(request, limits)
        except IfrtError as e:
            await abort(context, e, what)
        await service.serving(context, what)
        if (refused := self._check_room(len(self._watches))) is not None:  # before it joins: nothing changes
            await abort(context, refused, what)
        uid, proof = request.agent_uid, caller_proof(context)
        if request.workers and (refused := self._not_the_host(request.host, context)) is not None:
            await abort(context, refused, what)
        # Present from now (no newcomer takes its place), but only with the agent's own secret: naming an agent's id
        # is no proof of it (a newcomer's join checks its secret, or makes it the agent with this one).
        present = (request.workers > 0 and uid not in service.state.attempts.agents) or service.state.attempts.proves(
            uid, proof)
        if present:
            self._watching[uid] = self._watching.get(uid, 0) + 1
        try:
            if request.workers:  # an agent of the job: it joins (journaled) before it is told anything
                agent = Agent(uid, request.host, peer_host(context.peer()), proof, request.workers,
                              request.spare_host, max(0.0, request.replace_timeout_s), time.time())
                budget = request.max_restarts if request.HasField("max_restarts") else None
                bound = service.config.agent_key is not None  # a credential proved the host: one agent per host
                await service.command(context, what, lambda: (None, service.state.join_agent(
                    agent, budget, self._absent(), request.recover, frozenset(self._watching) - {uid}, bound)))
            await service.commit(context, what)  # only durable state is sent
            if (refused := self._check_room(len(self._watches))) is not None:  # no await from here until counted
                await abort(context, refused, what)
            outbox = Outbox(limits.session_backlog_bytes, lambda waiting: _Closed(InvalidArgument(
                f"this job watch left {waiting} bytes of events unread: expected at most "
                f"{limits.session_backlog_bytes} (the coordinator's {FLAGS['session_backlog_bytes']}); watch "
                "again")), service.sessions.backlogs, lambda waiting: _Closed(ResourceExhausted(
                    f"this job watch left {waiting} bytes of events unread while sessions and watches together left "
                    f"more than {limits.backlog_bytes} (the coordinator's {FLAGS['backlog_bytes']}); watch again")))
            outbox.put_nowait(pb.JobEvent(state=_job_state(service.state.attempts.view())).SerializeToString())
            self._watches.add(outbox)
            log.debug("the agent %s on %s watches the job", shown(uid), shown(request.host))
            try:
                while True:
                    item = await outbox.get()
                    if isinstance(item, _Closed):
                        await abort(context, item.error, what, level=logging.DEBUG)
                    await context.write(item)
            finally:
                self._watches.discard(outbox)
                service.sessions.backlogs.remove(outbox)
        finally:
            if present:
                self._watching[uid] -= 1
                if not self._watching[uid]:
                    del self._watching[uid]
                    if uid in service.state.attempts.agents:  # bounded: the job's agents only
                        self._gone_since[uid] = time.monotonic()

    def _not_the_host(self, host: str, context: grpc.aio.ServicerContext) -> PermissionDenied | None:
        """Why a caller may not join as the agent of ``host``: where the coordinator binds agents to hosts (an agent
        key), it must carry ``host``'s credential; with a token and no agent key, no caller may (the token says
        nothing about hosts). None: it may."""
        config = self._service.config
        if config.agent_key is None and config.token is None:
            return None  # an open coordinator: every caller is the job's
        if config.agent_key is not None and credential_holds(config.agent_key, host, metadata_value(
                context, AGENT_CREDENTIAL_METADATA)):
            return None
        holders = [f"agent {shown(a.uid)} ({a.address}, watching {'now' if a.uid in self._watching else 'no more'})"
                   for a in self._service.state.attempts.listed() if a.host == host]
        held = f"; the job's agent on {shown(host)} is {', '.join(holders)}" if holders else ""
        if config.agent_key is None:
            return PermissionDenied(f"this coordinator has a token but no agent key (--agent-key-file), so no caller "
                                    f"may join as the agent of {shown(host)}{held}: start it with --agent-key-file "
                                    "and give each host's `ifrt run` its credential")
        return PermissionDenied(f"this call claims host {shown(host)} without its credential (metadata "
                                f"{AGENT_CREDENTIAL_METADATA}){held}: an agent acts only for the host its credential "
                                "names (`ifrt run --agent-credential-file`, or --agent-key-file to derive it)")

    def _absent(self) -> frozenset[str]:
        """The job's agents that no watch on this replica has shown for longer than the heartbeat timeout (counted
        from when this replica began serving the state, for an agent it has not seen since)."""
        now, service = time.monotonic(), self._service
        if service.replica.epoch != self._epoch:
            self._epoch, self._since = service.replica.epoch, now
            self._gone_since.clear()
            self._declared_at.clear()
        agents, grace = service.state.attempts.agents, service.replica.config.heartbeat_timeout_s
        if self._gone_since:
            for uid in self._gone_since.keys() - agents:  # no longer an agent of the job
                del self._gone_since[uid]
        unwatched = agents.difference(self._watching)  # in C: most rounds find every agent watching
        return frozenset(uid for uid in unwatched if now - self._gone_since.get(uid, self._since) > grace)

    def _waited(self, process_id: int) -> float:
        """Seconds since the coordinator declared ``process_id`` failed in this attempt (counted from when this
        replica began serving, for a declaration it did not see)."""
        return time.monotonic() - self._declared_at.get(process_id, self._since)

    async def watch_hosts_every(self, interval_s: float) -> None:
        """Hands a lost host's process ids to a spare host once (coordinator.core.takeover); without one, says every
        ``WAIT_LOGGED_S`` which host the job waits for."""
        logged, service = -math.inf, self._service
        while True:
            await asyncio.sleep(interval_s)
            if not service.replica.serving:
                continue
            try:
                absent = self._absent()
                if not absent:
                    continue  # every agent watches: no host is lost, nothing to decide or to say
                await service.decide(functools.partial(service.state.take_over_host, absent))
                due = time.monotonic() - logged >= WAIT_LOGGED_S
                lost = service.state.lost_hosts(absent) if due and service.replica.serving else []
            except Exception:  # a bug here must not end the loop: the next round decides again
                log.exception("deciding about lost hosts failed")
                continue
            if lost:
                logged = time.monotonic()
                log.warning("waiting for %s: its agent is gone and no spare host (ifrt run --spare-host) can take "
                            "over; the agents give up after their --replace-timeout",
                            "; ".join(host.describe() for host in lost), extra={"event": "host_lost"})

    def _check_room(self, watching: int) -> ResourceExhausted | None:
        if watching < self._limits.agents:
            return None
        return ResourceExhausted(f"{watching} agents watch the job: expected at most {self._limits.agents} (the "
                                 f"coordinator's {FLAGS['agents']})")

    async def next_attempt(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Ends ``ended_attempt`` and starts the next (or ends the restarts), once; answers the job's state."""
        request = await parse(pb.NextAttemptRequest, raw, context)
        f = request.failure
        failure = AttemptFailure(request.ended_attempt, f.process_id if request.HasField("failure") else
                                 UNKNOWN_PROCESS, f.host, f.reason)
        budget = request.max_restarts if request.HasField("max_restarts") else None
        call = NextAttempt(request.ended_attempt, failure, budget, request.request_id, request.agent_uid,
                           request.replace, tuple(request.shrink))
        service, proof = self._service, caller_proof(context)
        if call.shrink:
            absent = self._absent()
            answer = await service.command(context, f"NextAttempt (shrink) in attempt {request.ended_attempt} from "
                                           f"agent {shown(request.agent_uid)}",
                                           lambda: service.state.shrink(call, proof, self._waited, absent))
            return pb.NextAttemptResponse(state=_job_state(answer.view), shrink_refused=answer.refused,
                                          shrink_wait_s=answer.wait_s).SerializeToString()
        view = await service.command(context, f"NextAttempt after attempt {request.ended_attempt} from agent "
                                     f"{shown(request.agent_uid)}", lambda: service.state.next_attempt(
                                         call, proof, bound=service.config.agent_key is not None))
        return pb.NextAttemptResponse(state=_job_state(view)).SerializeToString()

    def _on_effects(self, effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case AttemptProcessFailed(failure=failure, went_on=went_on) \
                        if failure.attempt == self._service.state.attempts.current:
                    self._declared_at.setdefault(failure.process_id, time.monotonic())
                    event = pb.JobEvent(went_on=_failure(failure)) if went_on \
                        else pb.JobEvent(process_failed=_failure(failure))
                case AttemptStarted(view=view):
                    self._declared_at.clear()
                    event = pb.JobEvent(attempt_started=_job_state(view))
                case ProcessReplaced(failure=failure, view=view):
                    self._declared_at.pop(failure.process_id, None)
                    log.warning("process %d is replaced by its agent (replacement %d of this run, restart budget %d): "
                                "%s", failure.process_id, view.replacements, view.max_restarts, shown(failure.reason),
                                extra={"event": "process_replaced", "process_id": failure.process_id})
                    event = pb.JobEvent(replaced=_failure(failure))
                case HostTakenOver(failure=failure, agent_uid=uid, host=host, process_ids=ids, explicit_ids=named):
                    if ids:
                        log.warning("%s (replacement %d of this run)", shown(failure.reason),
                                    self._service.state.attempts.view().replacements,
                                    extra={"event": "host_taken_over", "host": failure.host})
                    event = pb.JobEvent(taken_over=pb.HostTakeover(
                        attempt=failure.attempt, failure=_failure(failure), agent_uid=uid, host=host, process_ids=ids,
                        explicit_ids=named))
                case JobShrunk(process_ids=ids):
                    log.warning("the job shrinks to its survivors: processes %s dropped (neither replaced nor taken "
                                "over within the agents' --replace-timeout)", ", ".join(map(str, ids)),
                                extra={"event": "job_shrunk"})
                    continue
                case AttemptsExhausted(view=view):
                    log.error("the job's restarts are exhausted after attempt %d: no attempt starts", view.attempt,
                              extra={"event": "attempts_exhausted", "attempt": view.attempt})
                    event = pb.JobEvent(exhausted=_job_state(view))
                case _:
                    continue
            message = event.SerializeToString()
            for outbox in self._watches:
                outbox.put_nowait(message)

    def _on_step_down(self, why: str) -> None:
        for outbox in self._watches:
            outbox.put_nowait(_Closed(CoordinatorUnavailable(f"the coordinator stepped down ({why}): watch the job "
                                                             "on the replica that leads")))


def _check_watch(request: pb.WatchJobRequest, limits: Limits) -> None:
    if request.recover not in RECOVER_MODES:
        raise InvalidArgument(f"recover {shown(request.recover)} is not a mode: expected restart or replace (or "
                              "nothing)")
    if request.spare_host and not request.workers:
        raise InvalidArgument("a spare host states the workers it can run: expected workers >= 1")
    for what, text in (("host", request.host), ("agent_uid", request.agent_uid)):
        size = len(text.encode())
        if not size or size > limits.string_bytes:
            raise InvalidArgument(f"{what} {shown(text)} is {size} bytes long: expected 1 to {limits.string_bytes} "
                                  f"(the coordinator's {FLAGS['string_bytes']})")


def _failure(f: AttemptFailure) -> pb.AttemptFailure:
    return pb.AttemptFailure(attempt=f.attempt, process_id=f.process_id, host=f.host, reason=f.reason)


def _job_state(view: JobView) -> pb.JobState:
    return pb.JobState(attempt=view.attempt, failures=[_failure(f) for f in view.failures], exhausted=view.exhausted,
                       max_restarts=view.max_restarts, earlier_failures=view.earlier, replacements=view.replacements)
