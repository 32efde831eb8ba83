"""The gRPC face of the state machine, a shell around it: every call is parsed, turned into a command (or a read),
journaled durably (``Replica.commit``), its effects carried out, and answered with pre-serialized bytes. The unary
RPCs are rows of ``coordinator.core.rpcs``; Register and Session have small handlers of their own on the same steps."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TypeVar

import grpc

from coordinator import operator_view
from coordinator.calls import abort, caller_proof, internal_errors, parse, peer_host
from coordinator.config import CoordinatorConfig
from coordinator.core import registration as reg
from coordinator.core.barriers import BarrierResolved
from coordinator.core.effects import (
    Effect,
    Evict,
    Forgotten,
    KeyChanged,
    Notify,
    Published,
    Republish,
    RunEnded,
    RunStarted,
    SuspectSelf,
    Waiting,
    WaitingForHolder,
    WaitingForNextRun,
)
from coordinator.core.history import Numbered
from coordinator.core.job_records import AttemptStarted, JobView
from coordinator.core.preemption import PreemptionResolved
from coordinator.core.replies import PendingReplies
from coordinator.core.rpcs import RPCS, Call, Rpc, Wait, answers
from coordinator.core.state import Admitted, ClusterState
from coordinator.core.waits import progress_stale, wait_s
from coordinator.decisions_log import log_admitted, log_event
from coordinator.host_register import HostRegister
from coordinator.host_sessions import HostSessions
from coordinator.messages import PublishedGeneration, event_message, next_run_answer, progress_answer, waiting_answer
from coordinator.replica import NotServing, Replica
from coordinator.sessions import Sessions
from coordinator.store import Store
from coordinator.transfer_keys import transfer_key_handler
from coordinator.waiters import PUBLISHED, WOKEN, Waiters, resolved_within
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import AttemptEnded, CoordinatorUnavailable, IfrtError, UnknownClient
from ifrt.protocol import attempt_ended

log = logging.getLogger("ifrt.coordinator")

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
NEXT_RUN = ("next-run",)
"""What a Register call waits for while its id waits for the job's next run (``coordinator.core.runs``)."""
NEXT_RUN_LOG_S = 3.0
HOLDER_POLL_S = 0.05
"""How often a registration waiting for its id's holder to attach or fail looks again (a holder attaches within
milliseconds of its answer, or is declared failed by the tick)."""
"""How often the log says which processes of a finishing run registrations for the next one wait for."""
_CALL_ATTEMPT: ContextVar[int | None] = ContextVar("call_attempt", default=None)
"""The job attempt the current call began in (set by its first ``serving``)."""
R = TypeVar("R")


class CoordinatorService:
    """Serves the Coordinator service. Each generation's topology is serialized once and sent as the same bytes.

    Every state change is journaled (``Replica.commit``) before it is acknowledged; a replica that does not
    lead answers UNAVAILABLE, so clients move on to another.
    """

    def __init__(self, config: CoordinatorConfig, store: Store, *, advertise: str,
                 clock: Callable[[], float] = time.monotonic,
                 report: Callable[[bool], Awaitable[None]] | None = None):
        self.replica = Replica(config.cluster, store, advertise, clock, self._on_serving, self._on_step_down,
                               **({"report": report} if report else {}), tunables=config)
        self.clock = clock
        self._config = config
        self.advertise = advertise
        self.time_to_publish_s: float | None = None
        """From the first registration to generation 1, when this replica published it (not replayed it)."""
        self.generation = PublishedGeneration()
        self._announced = 0  # the latest generation sent to the sessions
        self._progress_cache: tuple[float, int, bytes] = (-math.inf, -1, b"")
        self.waiters = Waiters()
        self.host_register = HostRegister(self)
        self._next_run_logged = -math.inf  # when the log last said who a registration for the next run waits for
        self.sessions = Sessions(self, self.replica.config.limits)
        self.host_sessions = HostSessions(self.sessions)
        self._replies = PendingReplies(self.replica.config.limits.pending_reply_bytes)
        self.effect_listeners: list[Callable[[list[Effect]], None]] = []
        """Called with the effects of every command once durable (after this service carried them out)."""
        self.step_down_listeners: list[Callable[[str], None]] = []
        """Called with the reason when this replica steps down."""
        self.agents_watching: Callable[[], frozenset[str]] = frozenset
        """The ids of the job's agents whose watch is open here (set by the JobAgents service)."""

    @property
    def config(self) -> CoordinatorConfig:
        """How this coordinator was started (its token and agent key among it)."""
        return self._config

    @property
    def state(self) -> ClusterState:
        return self.replica.state

    def current_generation(self) -> PublishedGeneration:
        """The current generation's bytes (serialized once, when the state holds a new one)."""
        state = self.state
        self.generation.sync(state.topology, state.published_at, state.attempts.current, state.run)
        return self.generation

    def _on_serving(self) -> None:
        self._progress_cache = (-math.inf, -1, b"")  # another state: nothing of the old one is answered
        self.generation = PublishedGeneration()  # serialize the replayed generation anew
        self.time_to_publish_s = None
        self._announced = self.current_generation().generation  # sessions attach to it and catch up themselves

    def _on_step_down(self, why: str) -> None:
        # Wake every waiting call at once: each finds the replica not serving and answers UNAVAILABLE, so its
        # client moves on to the new leader instead of waiting out its own timeout here.
        self.waiters.wake_all()
        self.sessions.close(f"the coordinator stepped down ({why})")
        for listener in self.step_down_listeners:
            listener(why)

    def _attempt_started(self, view: JobView) -> None:
        """A new job attempt: the ended attempt's waiting calls answer AttemptEnded (see ``serving``), its sessions
        are shut down, and the new attempt's first topology is serialized afresh."""
        if not view.failures:  # a new agent joined a job whose restarts were exhausted, or whose agents are gone
            log.warning("a new run of the job starts as attempt %d (the last run's restarts were exhausted, or its "
                        "agents are gone)", view.attempt, extra={"event": "attempt_started", "attempt": view.attempt})
        else:
            ended = view.failures[-1]
            log.warning("attempt %d of the job ended (process %d on %s: %s); attempt %d starts", ended.attempt,
                        ended.process_id, ended.host or "an unknown host", ended.reason, view.attempt,
                        extra={"event": "attempt_started", "attempt": view.attempt, "process_id": ended.process_id,
                               "host": ended.host, "reason": ended.reason})
        self.waiters.wake_all()
        self.sessions.close(attempt_ended(view.attempt - 1, view.attempt), ended_attempt=view.attempt - 1,
                            next_attempt=view.attempt)
        self._on_serving()

    def _run_started(self, ended: int, run: int) -> None:
        """A new run of the job on this coordinator (``coordinator.core.runs``): what waited in the ended run looks
        again, and the new run's first topology is serialized afresh."""
        log.warning("run %d of the job is over (every process of it left or failed); run %d starts with the processes "
                    "that register now", ended, run, extra={"event": "run_started", "run": run})
        self.waiters.wake_all()
        self.sessions.close(f"run {ended} of the job is over; run {run} starts (its processes register anew)",
                            ended_run=ended, next_run=run)
        self._on_serving()

    # The pipeline's steps.
    async def serving(self, context: grpc.aio.ServicerContext, what: str, epoch: int | None = None) -> None:
        """Aborts with UNAVAILABLE unless this replica serves (and, given ``epoch``, still from the same state), and
        with AttemptEnded when the job's attempt changed while the call waited."""
        try:
            self.replica.check()
        except NotServing as e:
            await abort(context, CoordinatorUnavailable(str(e)), what, level=logging.DEBUG)
        if epoch is not None and epoch != self.replica.epoch:
            await abort(context, CoordinatorUnavailable(f"the coordinator rebuilt its state while {what} waited: "
                                                        "call again"), what, level=logging.DEBUG)
        attempt = self.state.attempts.current
        if epoch is None:  # a call starts (each runs in a task of its own): it belongs to the attempt running now
            _CALL_ATTEMPT.set(attempt)
        elif (began := _CALL_ATTEMPT.get()) is not None and began != attempt:
            await abort(context, AttemptEnded(f"attempt {began} of the job ended while {what} waited: attempt "
                                              f"{attempt} runs now, and this process's agent restarts it"), what,
                        level=logging.DEBUG)

    async def commit(self, context: grpc.aio.ServicerContext, what: str) -> None:
        """Returns once every journal entry made so far is durable; UNAVAILABLE if the store failed meanwhile."""
        try:
            await self.replica.commit()
        except NotServing as e:
            await abort(context, CoordinatorUnavailable(str(e)), what)

    async def command(self, context: grpc.aio.ServicerContext, what: str,
                      command: Callable[[], tuple[R, list[Effect]]],
                      before_commit: Callable[[R], object] | None = None) -> R:
        """Runs a state-changing command: UNAVAILABLE unless this replica serves, its typed error as the answer;
        else its journal entries are made durable, its effects carried out, and its result returned.
        ``before_commit`` sees the result before any await (where a call that will wait for its answer registers)."""
        await self.serving(context, what)
        try:
            with wire.gc_paused():  # a command may build a topology: none of its objects is garbage yet
                result, effects = command()
        except IfrtError as e:
            await abort(context, e, what)
        if before_commit is not None:
            before_commit(result)
        await self.commit(context, what)
        self.carry_out(effects)
        return result

    async def read(self, context: grpc.aio.ServicerContext, what: str, query: Callable[[], R]) -> R:
        """Answers ``query`` from durable state only: every journal entry made before the read is durable first."""
        await self.commit(context, what)
        try:
            return query()  # no await since the commit: nothing newer than what is durable can be read
        except IfrtError as e:
            await abort(context, e, what)

    def handlers(self) -> grpc.GenericRpcHandler:
        """Method handlers taking and returning raw bytes: answers are pre-serialized."""
        def unary(handler: Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]], name: str):
            return grpc.unary_unary_rpc_method_handler(internal_errors(handler, name))

        methods = {name: unary(self._unary_of(rpc), name) for name, rpc in RPCS.items()}
        methods["Register"] = unary(self.register, "Register")
        methods["RegisterHost"] = unary(self.host_register.register_host, "RegisterHost")
        methods["Status"] = unary(functools.partial(operator_view.status_rpc, self), "Status")
        methods["TransferKey"] = unary(transfer_key_handler(self), "TransferKey")
        methods["Session"] = grpc.stream_stream_rpc_method_handler(internal_errors(self.sessions.serve, "Session"))
        methods["HostSession"] = grpc.stream_stream_rpc_method_handler(
            internal_errors(self.host_sessions.serve, "HostSession"))
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def _unary_of(self, rpc: Rpc) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await self.unary(rpc, raw, context)
        return handle

    async def unary(self, rpc: Rpc, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """One call of a table row: parse, command (or read), commit, apply, wait while undecided, answer."""
        request = await parse(rpc.request, raw, context)
        what, wait = rpc.what(request), rpc.wait
        call = Call(self.clock(), caller_proof(context))
        future: asyncio.Future | None = None
        epoch = self.replica.epoch

        def expect(result: object) -> None:  # before any await: nothing that answers the call can be missed
            nonlocal future, epoch
            if result is None and wait is not None:
                future, epoch = self.waiters.expect(wait.on(request)), self.replica.epoch

        try:
            if (query := rpc.query) is not None:
                await self.serving(context, what)
                result = await self.read(context, what, lambda: query(self.state, request, call))
                expect(result)
            else:
                command = rpc.command
                assert command is not None
                result = await self.command(context, what, lambda: command(self.state, request, call), expect)
            if wait is not None and future is not None:
                result = await self._wait(context, wait, request, call, future, what, epoch)
        finally:
            if wait is not None and future is not None:
                self.waiters.drop(wait.on(request), future)
        if isinstance(result, IfrtError):
            await abort(context, result, what, level=logging.DEBUG)
        try:
            return self._replies.hold(rpc.encode(result), context, what)
        except IfrtError as e:
            await abort(context, e, what)

    async def _wait(self, context: grpc.aio.ServicerContext, wait: Wait, request: object, call: Call,
                    future: asyncio.Future, what: str, epoch: int) -> object:
        """Waits as the row says (how long is the core's rule); the answer comes with what woke the call (for a
        caller that may still have it); the row's error when none came in time."""
        state = self.state
        seconds = wait.seconds(state.config, request)
        log.debug("%s%s up to %.1fs", what, wait.logged, seconds)
        woke = await resolved_within(future, seconds)
        await self.serving(context, what, epoch)
        answer = None if woke is None or woke is WOKEN else wait.answer(woke, request)
        if answer is not None and wait.recheck is not None:
            recheck = wait.recheck
            await self.read(context, what, lambda: recheck(state, request, call))
        if answer is None:
            await abort(context, wait.expired(request, what, seconds), what,
                        level=logging.DEBUG if wait.quiet else logging.WARNING)
        return answer

    # Register: admitted, then held until the topology is complete (or its wait is over).
    async def register(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await parse(pb.RegisterRequest, raw, context)
        what = f"registration from {context.peer()}"
        await self.serving(context, "registration")
        state, epoch = self.state, self.replica.epoch
        began = self.clock()
        until = began + wait_s(state.config, request.wait_ms / 1000)  # the call's whole wait
        try:
            registration = reg.from_request(request, peer_host(context.peer()), state.config.limits,
                                            caller_proof(context), raw)
            with wire.gc_paused():
                outcome, effects = state.register(registration, self.clock())
        except IfrtError as e:
            await abort(context, e, what)
        if isinstance(outcome, WaitingForHolder):
            outcome, effects = await self._wait_for_holder(registration, outcome, until, context, what, epoch)
            if isinstance(outcome, WaitingForHolder):
                return waiting_answer(outcome, state.config.num_processes, self.clock() - began)
        if isinstance(outcome, WaitingForNextRun):
            outcome, effects = await self.wait_for_next_run(registration, outcome, until, context, what, epoch)
            if isinstance(outcome, WaitingForNextRun):
                return next_run_answer(outcome, self.clock() - began)
        uid = registration.client_uid
        state.call_started(uid, self.clock())  # alive while its call is held, by the journal too (under load)
        published = self.waiters.expect(PUBLISHED) if isinstance(outcome, Waiting) else None
        try:
            await self.commit(context, "registration")
            self.announce(outcome)
            self.carry_out(effects)
            if published is None:
                return self.current_generation().answer(outcome.process_id)  # type: ignore[union-attr]
            woke = await resolved_within(published, max(0.0, until - self.clock()))
        finally:
            if published is not None:
                self.waiters.drop(PUBLISHED, published)
            state.call_ended(uid, self.clock())
        await self.serving(context, "registration", epoch)
        try:
            outcome = state.answer(uid, self.clock())
        except UnknownClient:  # forgotten while it waited: its next call registers it again
            outcome = None
        except IfrtError as e:  # failed or replaced while it waited
            await abort(context, e, what)
        if woke is None or woke is WOKEN or not isinstance(outcome, Published):
            await self.commit(context, "registration")  # read off the state, not carried by the publication
        if isinstance(outcome, Published):
            return self.current_generation().answer(outcome.process_id)
        return self.progress_answer()

    async def wait_for_next_run(self, r: reg.Registration, outcome: WaitingForNextRun, until: float,
                                 context: grpc.aio.ServicerContext, what: str,
                                 epoch: int) -> tuple[Waiting | Published | WaitingForNextRun, list[Effect]]:
        """Holds a registration whose id waits for the next run until that run can start (then registers it
        again: the first such registration starts it) or the call's wait is over; says in the log, every few
        seconds, which processes of the finishing run are still live."""
        state = self.state
        self._log_next_run(outcome)
        while (remaining := until - self.clock()) > 0:
            future = self.waiters.expect(NEXT_RUN)
            try:
                woke = await resolved_within(future, remaining)
            finally:
                self.waiters.drop(NEXT_RUN, future)
            await self.serving(context, "registration", epoch)
            if woke is None:
                break
            try:
                with wire.gc_paused():
                    outcome, effects = state.register(r, self.clock())  # type: ignore[assignment]
            except IfrtError as e:
                await abort(context, e, what)
            if not isinstance(outcome, WaitingForNextRun):
                return outcome, effects
        self._log_next_run(outcome)
        return outcome, []

    async def _wait_for_holder(self, r: reg.Registration, outcome: WaitingForHolder, until: float,
                               context: grpc.aio.ServicerContext, what: str,
                               epoch: int) -> tuple[Admitted, list[Effect]]:
        """Holds a registration whose id's holder was answered and has not attached yet, looking again until it is
        refused (the holder attached: ProcessIdTaken), admitted (the holder was declared failed: a restart), or the
        call's wait is over (its client asks again)."""
        log.info("a registration from %s %s", r.describe(), outcome.describe(),
                 extra={"event": "waiting_for_holder", "holder": outcome.process})
        while isinstance(outcome, WaitingForHolder) and (remaining := until - self.clock()) > 0:
            await asyncio.sleep(min(HOLDER_POLL_S, remaining))
            await self.serving(context, "registration", epoch)
            try:
                with wire.gc_paused():
                    outcome, effects = self.state.register(r, self.clock())
            except IfrtError as e:
                await abort(context, e, what)
        return (outcome, effects) if not isinstance(outcome, WaitingForHolder) else (outcome, [])

    def _log_next_run(self, outcome: WaitingForNextRun) -> None:
        now = self.clock()
        if now - self._next_run_logged >= NEXT_RUN_LOG_S:
            self._next_run_logged = now
            log.info("a registration waits for the next run: %s", outcome.describe(),
                     extra={"event": "waiting_for_next_run", "run": outcome.run})

    def announce(self, outcome: Waiting | Published) -> None:
        """Logs an admission; a first publication is serialized and wakes every waiting Register call, as does a
        restart that made the generation whole (restarted processes waiting for it look again)."""
        if outcome.admitted is not None:
            log_admitted(outcome.admitted)
        if isinstance(outcome, Published) and outcome.first is not None:
            self.time_to_publish_s = outcome.first.waited_s
            self.current_generation()
            self.waiters.resolve(PUBLISHED, outcome.first)
        elif isinstance(outcome, Published):
            self.waiters.resolve(PUBLISHED, WOKEN)

    def progress_answer(self) -> bytes:
        """Who is still missing, made again only when the core's rule says the last answer is stale."""
        now, state = self.clock(), self.state
        at, registered, answer = self._progress_cache
        if progress_stale(state.config, now, at, registered, state.registered):
            p = state.progress(now)
            answer = progress_answer(p, self._config.progress_hosts)
            self._progress_cache = (now, p.registered, answer)
        return answer

    async def shutdown_sessions(self, reason: str, timeout_s: float) -> None:
        """Tells every session the coordinator is going away, so clients need not wait for a timeout."""
        await self.sessions.shutdown(reason, timeout_s)

    # Time and effects.
    async def tick_every(self, interval_s: float) -> None:
        """Lets the state machine expire silent processes and overdue barriers; steps aside when it suspects this
        replica's own partition (SuspectSelf: most of the job went silent at once)."""
        while True:
            await asyncio.sleep(interval_s)
            if not self.replica.serving:
                continue
            with wire.gc_paused():
                effects = self.state.tick(self.clock())
            try:
                await self.replica.commit()
            except NotServing:
                continue
            self.carry_out(effects)
            for effect in effects:
                if isinstance(effect, SuspectSelf):
                    await self.replica.step_aside(effect.why, effect.for_s)

    async def decide(self, decision: Callable[[], list[Effect]]) -> bool:
        """Runs a decision of the coordinator's own (no caller waits on it) while this replica serves: its journal
        entries made durable, then its effects carried out. False when this replica does not serve, or stepped down
        before the entries were durable (nothing of it may be acknowledged)."""
        if not self.replica.serving:
            return False
        with wire.gc_paused():
            effects = decision()
        if not effects:
            return True
        try:
            await self.replica.commit()
        except NotServing:
            return False
        self.carry_out(effects)
        return True

    def carry_out(self, effects: list[Effect]) -> None:
        """Carries out durable effects: logs, session events, and the answers of waiting calls."""
        for effect in effects:
            match effect:
                case AttemptStarted(view=view):
                    self._attempt_started(view)
                case RunStarted(ended=ended, run=run):
                    self._run_started(ended, run)
                case RunEnded(run=run):
                    log.info("every process of run %d of the job left or failed: the next registration starts run "
                             "%d", run, run + 1, extra={"event": "run_ended", "run": run})
                    self.waiters.resolve(NEXT_RUN, WOKEN)
                    self.waiters.resolve(PUBLISHED, WOKEN)  # restarts still waiting in it look again
                case Notify(event=event, number=number):
                    log_event(event, self.state)
                    self.sessions.broadcast(*event_message(Numbered(number, event)))
                case Republish():
                    self.waiters.resolve(PUBLISHED, WOKEN)  # restarts waiting for a whole generation look again
                    generation = self.current_generation()
                    if generation.generation > self._announced:  # once, however many calls synced it meanwhile
                        self._announced = generation.generation
                        self.sessions.broadcast(generation.position, generation.event)
                case Evict(client_uid=uid, reason=reason):
                    self.sessions.evict(uid, reason)
                case Forgotten(who=who, reason=reason):
                    log.warning("forgot the registration of %s: it %s", who, reason,
                                extra={"event": "registration_forgotten", "reason": reason})
                case BarrierResolved(error=error) if error is not None:
                    log.info("%s", error)
                case KeyChanged(key=key, value=value):
                    self.sessions.send_change(key, value)
                case PreemptionResolved(step=step, error=error):
                    if step is not None:
                        log.warning("preemption sync point: every process checkpoints at step %d", step,
                                    extra={"event": "preemption_sync", "step": step})
                    elif error is not None:
                        log.info("%s", error)
            for key, answer in answers(effect):
                self.waiters.resolve(key, answer)
        for listener in self.effect_listeners:
            listener(effects)
