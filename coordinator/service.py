"""The gRPC face of the state machine: decode, apply, carry out the effects, answer with pre-serialized bytes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc._cython import cygrpc

from coordinator import registration as reg
from coordinator import status as status_view
from coordinator.agreement import LiveSetResolved
from coordinator.barriers import BarrierResolved
from coordinator.history import GenerationPublished, Numbered, Snapshot
from coordinator.limits import FLAGS
from coordinator.noise import noisy
from coordinator.outbox import Outbox
from coordinator.preemption import PreemptionResolved
from coordinator.replica import NotServing, Replica
from coordinator.state import (
    FIRST_GENERATION,
    ClusterConfig,
    ClusterState,
    Effect,
    Evict,
    Forgotten,
    KeyChanged,
    Notify,
    Published,
    Republish,
)
from coordinator.store import Store
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import (
    ERROR_TRAILER,
    BarrierTimeout,
    CoordinatorUnavailable,
    IfrtError,
    InvalidArgument,
    KeyValueTimeout,
    ProcessDeclaredFailed,
    UnknownClient,
)
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.security import SECRET_METADATA, proof_of

log = logging.getLogger("ifrt.coordinator")

MAX_HOSTS_IN_PROGRESS = 32
"""Registered hosts listed in one progress answer (the count is always exact)."""
PROGRESS_CACHE_S = 1.0
"""A progress answer is reused this long while nobody new registers (thousands may ask at once)."""
PROGRESS_REFRESH_S = 0.1
"""...and this long while registrations still arrive, so its count lags by at most this much."""
MAX_MESSAGE_BYTES = 2048
"""Longest status message sent (and logged): the facts an operator needs fit; a caller's long input does not."""
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
STALL_SLACK_S = 5.0
"""How much longer than its own timeout a call waits for the tick to resolve it: only a stall needs it."""
_END = object()
_HEARTBEAT = pb.SessionRequest(heartbeat=pb.Heartbeat()).SerializeToString()
HEARTBEAT_INTERVAL_MS = 3_600_000
"""How often ``attached`` asks a session for a Heartbeat message: liveness rides on the connection's keepalive
pings, so none is needed; an hour rather than 0, which clients that predate this read as "send without pause"."""


def peer_host(peer: str) -> str:
    """The IP of a gRPC peer string: ``ipv4:10.0.0.2:5000`` -> ``10.0.0.2``, ``ipv6:[::1]:5000`` -> ``::1``."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return rest or peer


class _Number:
    """Queued just before a job event's bytes: its number, so a session that caught up skips what it has."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number


class _Evicted:
    def __init__(self, error: IfrtError) -> None:
        self.error = error


class CoordinatorService:
    """Serves the Coordinator service. Each generation's topology is serialized once and sent as the same bytes.

    Every state change is journaled (``Replica.commit``) before it is acknowledged; a replica that does not
    lead answers UNAVAILABLE, so clients move on to another.
    """

    def __init__(self, config: ClusterConfig, store: Store, *, advertise: str, max_wait_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 report: Callable[[bool], Awaitable[None]] | None = None):
        self.replica = Replica(config, store, advertise, clock, self._on_serving, self._on_step_down,
                               **({"report": report} if report else {}))
        self._clock = clock
        self._max_wait_s = max_wait_s
        self._advertise = advertise
        self._fingerprint = ""  # of the current generation
        self.time_to_publish_s: float | None = None
        """From the first registration to generation 1, when this replica published it (not replayed it)."""
        self._published = asyncio.Event()
        self._generation = 0
        self._answer_tail = b""  # Register answer minus process_id, for the current generation
        self._topology_event = b""  # SessionEvent(topology_changed) for the current generation
        self._published_at = 0  # the job event number of its publication
        self._progress_cache: tuple[float, int, bytes] = (-1e9, -1, b"")
        self._limits = config.limits
        self._sessions: dict[str, set[Outbox]] = {}
        self._barrier_done: dict[str, asyncio.Event] = {}
        self._kv_set: dict[str, asyncio.Event] = {}  # key -> set when it is set; only while a get waits for it
        self._kv_waiters: dict[str, int] = {}  # key -> gets waiting for it
        self._watches: dict[Outbox, set[str]] = {}  # session outbox -> the key prefixes it watches
        self._live_decided = asyncio.Event()  # replaced by a new one each time an agreement ends
        self._preemption_decided = asyncio.Event()  # likewise, each time the sync point is decided or times out

    @property
    def state(self) -> ClusterState:
        return self.replica.state

    def _on_serving(self) -> None:
        self._progress_cache = (-1e9, -1, b"")  # another state: nothing of the old one is answered
        self._generation = 0  # serialize the replayed generation anew
        self._published = asyncio.Event()
        self.time_to_publish_s = None
        self._sync_generation(replayed=True)

    def _on_step_down(self, why: str) -> None:
        # Wake every waiting call at once: each finds the replica not serving and answers UNAVAILABLE, so its
        # client moves on to the new leader instead of waiting out its own timeout here.
        self._published.set()
        for events in (self._barrier_done, self._kv_set):
            for event in events.values():
                event.set()
            events.clear()
        self._live_decided = _set_and_renew(self._live_decided)
        self._preemption_decided = _set_and_renew(self._preemption_decided)
        self._close_sessions(f"the coordinator stepped down ({why})")

    async def _serving(self, context: grpc.aio.ServicerContext, what: str, epoch: int | None = None) -> None:
        """Aborts with UNAVAILABLE unless this replica serves (and, given ``epoch``, still from the same state)."""
        try:
            self.replica.check()
        except NotServing as e:
            await _abort(context, CoordinatorUnavailable(str(e)), what, level=logging.DEBUG)
        if epoch is not None and epoch != self.replica.epoch:
            await _abort(context, CoordinatorUnavailable(f"the coordinator rebuilt its state while {what} waited: "
                                                         "call again"), what, level=logging.DEBUG)

    async def _commit(self, context: grpc.aio.ServicerContext, what: str) -> None:
        try:
            await self.replica.commit()
        except NotServing as e:
            await _abort(context, CoordinatorUnavailable(str(e)), what)

    def handlers(self) -> grpc.GenericRpcHandler:
        """Method handlers taking and returning raw bytes: answers are pre-serialized."""
        def unary(method):
            return grpc.unary_unary_rpc_method_handler(_internal_errors(method))

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Register": unary(self.register),
            "Session": grpc.stream_stream_rpc_method_handler(_internal_errors(self.session)),
            "Leave": unary(self.leave),
            "Barrier": unary(self.barrier),
            "KeyValueSet": unary(self.kv_set),
            "KeyValueGet": unary(self.kv_get),
            "KeyValueDir": unary(self.kv_dir),
            "KeyValueTryGet": unary(self.kv_try_get),
            "KeyValueIncrement": unary(self.kv_increment),
            "KeyValueCompareSet": unary(self.kv_compare_set),
            "KeyValueDelete": unary(self.kv_delete),
            "CancelBarrier": unary(self.cancel_barrier),
            "LiveProcesses": unary(self.live_processes),
            "PreemptionNotice": unary(self.preemption_notice),
            "PreemptionSync": unary(self.preemption_sync),
            "Status": unary(self.status_rpc),
        })

    # Register.
    async def register(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.RegisterRequest, raw, context)
        await self._serving(context, "registration")
        state = self.state
        try:
            registration = reg.from_request(request, peer_host(context.peer()), state.config.limits, _proof(context),
                                            raw)
            before = state.registered
            outcome, effects = state.register(registration, self._clock())
        except IfrtError as e:
            await _abort(context, e, f"registration from {context.peer()}")
        epoch = self.replica.epoch
        uid = registration.client_uid
        state.call_started(uid, self._clock())  # alive while its call is held, by the journal too (under load)
        try:
            await self._commit(context, "registration")
            if state.registered > before:  # the last one too: every admitted process is logged once
                self._log_admitted(registration)
            self._apply(effects)
            if isinstance(outcome, Published):
                return self._answer(outcome.process_id)
            try:  # a timeout scope, not wait_for: no task per waiting call
                async with asyncio.timeout(min(request.wait_ms / 1000, self._max_wait_s)):
                    await self._published.wait()
            except TimeoutError:
                pass
        finally:
            state.call_ended(uid, self._clock())
        await self._serving(context, "registration", epoch)
        try:
            outcome = state.answer(uid, self._clock())
        except UnknownClient:  # forgotten while it waited: its next call registers it again
            outcome = None
        except IfrtError as e:  # failed or replaced while it waited
            await _abort(context, e, f"registration from {context.peer()}")
        await self._commit(context, "registration")
        if isinstance(outcome, Published):
            return self._answer(outcome.process_id)
        return self._progress_answer()

    def _answer(self, process_id: int) -> bytes:
        self._sync_generation()
        # Concatenated protobuf messages parse as one: the per-process field, then the shared bytes.
        return pb.RegisterResponse(process_id=process_id).SerializeToString() + self._answer_tail

    def _sync_generation(self, replayed: bool = False) -> bool:
        """Serializes the current generation once, when it is new; returns whether it was."""
        topology = self.state.topology
        if topology is None or topology.generation == self._generation:
            return False
        canonical = wire.encode(topology)
        fingerprint = wire.fingerprint(canonical)
        encoding, payload = wire.compress(canonical)
        position = self.state.published_at
        shared = pb.RegisterResponse(topology=payload, encoding=encoding, fingerprint=fingerprint,
                                     generation=topology.generation, event_position=position)
        self._answer_tail = shared.SerializeToString()
        self._topology_event = pb.SessionEvent(topology_changed=shared, event_number=position).SerializeToString()
        self._published_at = position
        self._generation = topology.generation
        self._fingerprint = fingerprint
        self._published.set()
        if topology.generation == FIRST_GENERATION and not replayed:
            self.time_to_publish_s = self.state.progress(self._clock()).waited_seconds
        log.info("published generation %d: %d processes, %d devices, %d bytes (%d sent), fingerprint %s",
                 topology.generation, len(topology.processes), len(topology.devices), len(canonical), len(payload),
                 fingerprint[:16], extra={"event": "published", "generation": topology.generation,
                                          "fingerprint": fingerprint})
        return True

    def _progress_answer(self) -> bytes:
        now = self._clock()
        at, registered, answer = self._progress_cache
        age = now - at
        if age < PROGRESS_REFRESH_S or (registered == self.state.registered and age < PROGRESS_CACHE_S):
            return answer  # building one costs O(N log N): at most a few a second, however many processes ask
        p = self.state.progress(now)
        answer = pb.RegisterResponse(progress=pb.Progress(
            registered=p.registered, expected=p.expected, missing_process_ids=p.missing_process_ids,
            registered_hosts=p.registered_hosts[:MAX_HOSTS_IN_PROGRESS], waited_seconds=p.waited_seconds,
        )).SerializeToString()
        self._progress_cache = (now, p.registered, answer)
        return answer

    def _log_admitted(self, r: reg.Registration) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        state = self.state
        who = f"process {r.process_id}" if r.process_id is not None else "a process"
        missing = state.config.num_processes - state.registered
        if not missing:
            waiting = "complete"
        elif ids := state.missing_ids_if_few():
            waiting = f"waiting for process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
        else:
            waiting = f"waiting for {missing} more"
        log.info("registered %s on %s with %d devices: %d/%d registered, %s", who, r.describe(), len(r.devices),
                 state.registered, state.config.num_processes, waiting,
                 extra={"event": "registered", "process_id": r.process_id, "host": r.hostname,
                        "host_address": r.host_address})

    # Session.
    async def session(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """A process's live session: cluster events out. Costs nothing while nothing happens: the server's keepalive
        pings watch the connection in gRPC's core, and dropping a silent one ends this call (detaching the process)."""
        limits = self._limits
        try:  # a stream that never opens holds nothing for long
            async with asyncio.timeout(limits.first_message_seconds):
                first = await anext(aiter(requests), None)
        except TimeoutError:
            await _abort(context, InvalidArgument(
                f"no SessionOpen within {limits.first_message_seconds}s of the session's start: expected it as the "
                f"first message (the coordinator's {FLAGS['first_message_seconds']})"), "session")
        if first is None:
            return
        opening = await _parse(pb.SessionRequest, first, context)
        if opening.WhichOneof("kind") != "open":
            await _abort(context, InvalidArgument("the first session message must be SessionOpen"), "session")
        uid = opening.open.client_uid
        await self._serving(context, f"session of client {uid}")
        state = self.state
        try:
            process_id = state.attach(uid, self._clock(), proof=_proof(context))
        except IfrtError as e:
            await _abort(context, e, f"session of client {uid}")
        queue = Outbox(limits.session_backlog_bytes, lambda waiting: _Evicted(InvalidArgument(
            f"this session left {waiting} bytes of events unread: expected at most {limits.session_backlog_bytes} "
            f"(the coordinator's {FLAGS['session_backlog_bytes']}); attach again and re-read watched keys")))
        self._sessions.setdefault(uid, set()).add(queue)
        reader = asyncio.create_task(self._read_heartbeats(state, uid, requests, queue))
        log.debug("session of process %d attached", process_id)
        try:
            await context.write(pb.SessionEvent(attached=pb.Attached(
                heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS, generation=self._generation)).SerializeToString())
            sent = 0  # the number of the last job event this session has
            if opening.open.since_event:
                sent = await self._catch_up(context, state, process_id, opening.open)
            else:  # a client that predates numbering: from now on
                if opening.open.generation != self._generation:
                    await context.write(self._topology_event)
                for notice in state.notices():  # a notice given while this session was away
                    await context.write(pb.SessionEvent(preemption_notice=pb.ProcessEvent(
                        process_id=notice.process_id)).SerializeToString())
            skip = False
            while (item := await queue.get()) is not _END:
                if isinstance(item, _Evicted):
                    await _abort(context, item.error, f"session of process {process_id}")
                if isinstance(item, _Number):
                    skip = item.number <= sent  # queued while the session caught up, and sent then
                elif skip:
                    skip = False
                else:
                    await context.write(item)
        finally:
            reader.cancel()
            self._watches.pop(queue, None)
            self._sessions[uid].discard(queue)
            if not self._sessions[uid]:
                del self._sessions[uid]
            state.detach(uid, self._clock())

    async def _catch_up(self, context: grpc.aio.ServicerContext, state: ClusterState, process_id: int,
                        opening: pb.SessionOpen) -> int:
        """Sends a session that opens from a job event every durable event after it, in order (a snapshot where the
        history no longer reaches back); returns the number of the last one it now has."""
        what = f"session of process {process_id}"
        await self._commit(context, what)  # only durable events are sent
        try:  # no await since the commit: nothing newer than what is durable is read
            catch_up = state.catch_up(process_id, opening.since_event, opening.generation)
        except IfrtError as e:
            await _abort(context, e, what)
        self._sync_generation()
        messages = [self._topology_event if isinstance(n.event, GenerationPublished) else _event_message(n)[1]
                    for n in catch_up.events]
        if catch_up.snapshot is not None:
            log.info("session of process %d opened from job event %d, which the history (%s %d) no longer holds: "
                     "sent each process's state as of event %d", process_id, opening.since_event,
                     FLAGS["event_history"], self._limits.event_history, catch_up.head)
            messages.append(_snapshot_message(catch_up.snapshot))
        for message in messages:
            await context.write(message)
        return catch_up.head

    async def _read_heartbeats(self, state: ClusterState, uid: str, requests: AsyncIterator[bytes],
                               queue: Outbox) -> None:
        try:
            async for raw in requests:
                if raw == _HEARTBEAT:
                    state.heartbeat(uid, self._clock())
                else:
                    self._session_request(raw, queue)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait(_END)

    def _session_request(self, raw: bytes, queue: Outbox) -> None:
        """A session message besides a heartbeat: a watch of a key prefix, acknowledged once changes flow. A watch
        over a limit is not acknowledged (the session has no way to refuse one message) and is logged."""
        try:
            request = pb.SessionRequest.FromString(raw)
        except DecodeError:
            noisy.warning("session:malformed", "ignored a malformed session message of %d bytes", len(raw))
            return
        if request.WhichOneof("kind") == "watch":
            prefix, limits = request.watch.prefix, self._limits
            watched = self._watches.setdefault(queue, set())
            if len(prefix.encode()) > limits.kv_key_bytes:
                noisy.warning("session:watch-length", "ignored a watch of a prefix of %d bytes: expected at most %d "
                              "(the coordinator's %s)", len(prefix.encode()), limits.kv_key_bytes,
                              FLAGS["kv_key_bytes"])
                return
            if prefix not in watched and len(watched) >= limits.watches_per_session:
                noisy.warning("session:watch-count", "ignored a watch of a session that watches %d prefixes: expected "
                              "at most %d (the coordinator's %s)", len(watched), limits.watches_per_session,
                              FLAGS["watches_per_session"])
                return
            watched.add(prefix)
            queue.put_nowait(pb.SessionEvent(watching=request.watch).SerializeToString())

    def _broadcast(self, number: int, message: bytes) -> None:
        """Queues ``message`` (job event ``number``; 0: not a job event) for every session."""
        marker = _Number(number) if number else None
        for queues in self._sessions.values():
            for queue in queues:
                if marker is not None:
                    queue.put_nowait(marker)
                queue.put_nowait(message)

    def _close_sessions(self, reason: str) -> None:
        self._broadcast(0, pb.SessionEvent(shutdown=pb.Shutdown(reason=reason)).SerializeToString())
        for queues in self._sessions.values():
            for queue in queues:
                queue.put_nowait(_END)

    async def shutdown_sessions(self, reason: str, timeout_s: float) -> None:
        """Tells every session the coordinator is going away, so clients need not wait for a timeout."""
        self._close_sessions(reason)
        deadline = self._clock() + timeout_s
        while self._sessions and self._clock() < deadline:  # each session ends once its last write is out
            await asyncio.sleep(0.01)

    # Leave, barriers, key-values.
    async def leave(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.LeaveRequest, raw, context)
        await self._command(context, "leave", lambda: (None, self.state.leave(
            request.client_uid, self._clock(), proof=_proof(context))))
        return b""

    async def barrier(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.BarrierRequest, raw, context)
        await self._serving(context, f"barrier {request.name!r}")
        what = f"barrier {request.name!r}"
        timeout_s = request.timeout_ms / 1000
        state, epoch = self.state, self.replica.epoch
        try:
            outcome, effects = state.arrive(request.client_uid, request.name, frozenset(request.process_ids),
                                            timeout_s, self._clock(), proof=_proof(context))
        except IfrtError as e:
            await _abort(context, e, what)
        await self._commit(context, what)
        self._apply(effects)
        if outcome is None:
            log.debug("%s: a process arrived and waits for the others", what)
            done = self._barrier_done.setdefault(request.name, asyncio.Event())
            # The state machine's tick fails the barrier at its deadline; the slack only guards against a stall.
            try:
                await asyncio.wait_for(done.wait(), timeout_s + 5)
            except TimeoutError:
                await _abort(context, BarrierTimeout(f"{what} did not resolve within {timeout_s + 5:.1f}s"), what)
            await self._serving(context, what, epoch)
            outcome = state.barrier_outcome(request.name)
            await self._commit(context, what)
        if outcome is None:  # woken without a result: only a stall of the tick gets here
            await _abort(context, BarrierTimeout(f"{what} is still pending after {timeout_s:.1f}s"), what)
        if outcome.error is not None:
            await _abort(context, outcome.error, what, level=logging.DEBUG)
        return b""

    async def kv_set(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.KeyValueSetRequest, raw, context)
        await self._command(context, f"key-value set of {request.key!r}", lambda: (None, self.state.kv_set(
            request.client_uid, request.key, request.value, request.allow_overwrite, proof=_proof(context))))
        return b""

    async def kv_get(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.KeyValueGetRequest, raw, context)
        what = f"key-value get of {request.key!r}"
        await self._serving(context, what)
        state, epoch = self.state, self.replica.epoch
        proof = _proof(context)
        value = await self._read(context, what, lambda: state.kv_get(request.client_uid, request.key, proof=proof))
        if value is None:
            wait_s = min(request.wait_ms / 1000, self._max_wait_s)
            log.debug("%s waits up to %.1fs for the key to be set", what, wait_s)
            key = request.key
            event = self._kv_set.setdefault(key, asyncio.Event())
            self._kv_waiters[key] = self._kv_waiters.get(key, 0) + 1
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except TimeoutError:
                await _abort(context, KeyValueTimeout(f"key {request.key!r} was not set within {wait_s:.1f}s"),
                             what, level=logging.DEBUG)
            finally:  # the last get to stop waiting takes the key's event with it
                self._kv_waiters[key] -= 1
                if not self._kv_waiters[key]:
                    del self._kv_waiters[key]
                    if self._kv_set.get(key) is event:
                        del self._kv_set[key]
            await self._serving(context, what, epoch)
            value = await self._read(context, what, lambda: state.kv_get(request.client_uid, request.key,
                                                                         proof=proof))
            if value is None:
                await _abort(context, CoordinatorUnavailable(f"{what} was woken without a value: call again"), what)
        return pb.KeyValueGetResponse(value=value).SerializeToString()

    async def kv_dir(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.KeyValueDirRequest, raw, context)
        what = f"key-value dir of {request.prefix!r}"
        await self._serving(context, what)
        state = self.state
        proof = _proof(context)
        found = await self._read(context, what, lambda: state.kv_dir(request.client_uid, request.prefix, proof=proof))
        entries = [pb.KeyValueEntry(key=k, value=v) for k, v in found]
        return pb.KeyValueDirResponse(entries=entries).SerializeToString()

    async def kv_try_get(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.KeyValueTryGetRequest, raw, context)
        what = f"key-value try-get of {request.key!r}"
        await self._serving(context, what)
        state, proof = self.state, _proof(context)
        value = await self._read(context, what, lambda: state.kv_get(request.client_uid, request.key, proof=proof))
        return pb.KeyValueTryGetResponse(found=value is not None, value=value or b"").SerializeToString()

    async def kv_increment(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.KeyValueIncrementRequest, raw, context)
        total = await self._command(context, f"key-value increment of {request.key!r}", lambda: self.state.kv_increment(
            request.client_uid, request.key, request.amount, request.request_id, proof=_proof(context)))
        return pb.KeyValueIncrementResponse(value=total).SerializeToString()

    async def kv_compare_set(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.KeyValueCompareSetRequest, raw, context)
        value = await self._command(context, f"key-value compare-set of {request.key!r}", lambda: (
            self.state.kv_compare_set(request.client_uid, request.key, request.expected, request.desired,
                                      request.request_id, proof=_proof(context))))
        return pb.KeyValueCompareSetResponse(value=value or b"", found=value is not None).SerializeToString()

    async def kv_delete(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.KeyValueDeleteRequest, raw, context)
        what = f"key-value delete of {request.key!r}{' (prefix)' if request.prefix else ''}"
        deleted = await self._command(context, what, lambda: self.state.kv_delete(
            request.client_uid, request.key, request.prefix, proof=_proof(context)))
        return pb.KeyValueDeleteResponse(deleted=deleted).SerializeToString()

    async def cancel_barrier(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.CancelBarrierRequest, raw, context)
        what = f"cancel of barrier {request.name!r}"
        cancelled = await self._command(context, what, lambda: self.state.cancel_barrier(
            request.client_uid, request.name, self._clock(), proof=_proof(context)))
        return pb.CancelBarrierResponse(cancelled=cancelled).SerializeToString()

    async def live_processes(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.LiveProcessesRequest, raw, context)
        what = "live_processes"
        await self._serving(context, what)
        timeout_s, proof = request.timeout_ms / 1000, _proof(context)
        state, epoch = self.state, self.replica.epoch
        try:
            answer, effects = state.live_processes(request.client_uid, request.call_id, timeout_s, self._clock(),
                                                   proof=proof)
        except IfrtError as e:
            await _abort(context, e, what)
        decided = self._live_decided  # taken before any await: an agreement that ends meanwhile sets it
        await self._commit(context, what)
        self._apply(effects)
        if answer is None:
            await self._wait(context, decided, timeout_s, what, epoch)
            answer = state.live_answer(request.client_uid, request.call_id)
            await self._commit(context, what)
        if answer is None:  # left out of the agreement: it failed or was replaced while it waited
            try:
                state.process_id_of(request.client_uid, proof=proof)
            except IfrtError as e:
                await _abort(context, e, what)
            await _abort(context, BarrierTimeout(f"{what} is still pending after {timeout_s:.1f}s"), what)
        if isinstance(answer, IfrtError):
            await _abort(context, answer, what, level=logging.DEBUG)
        return pb.LiveProcessesResponse(processes=[pb.LiveProcess(process_id=pid, incarnation=incarnation)
                                                   for pid, incarnation in answer]).SerializeToString()

    async def preemption_notice(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.PreemptionNoticeRequest, raw, context)
        await self._command(context, "preemption notice", lambda: (None, self.state.preemption_notice(
            request.client_uid, self._clock(), proof=_proof(context))))
        return b""

    async def preemption_sync(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(pb.PreemptionSyncRequest, raw, context)
        what = f"preemption sync at step {request.step}"
        await self._serving(context, what)
        timeout_s = request.timeout_ms / 1000
        state, epoch = self.state, self.replica.epoch
        try:
            outcome, effects = state.preemption_sync(request.client_uid, request.step, timeout_s, self._clock(),
                                                     proof=_proof(context))
        except IfrtError as e:
            await _abort(context, e, what)
        decided = self._preemption_decided  # taken before any await, as in live_processes
        await self._commit(context, what)
        self._apply(effects)
        if outcome is None:
            await self._wait(context, decided, timeout_s, what, epoch)
            outcome = state.preemption_outcome()
            await self._commit(context, what)
        if outcome is None:
            await _abort(context, BarrierTimeout(f"{what} is still pending after {timeout_s:.1f}s"), what)
        if isinstance(outcome, IfrtError):
            await _abort(context, outcome, what, level=logging.DEBUG)
        return pb.PreemptionSyncResponse(sync_step=outcome).SerializeToString()

    async def _wait(self, context: grpc.aio.ServicerContext, event: asyncio.Event, timeout_s: float, what: str,
                    epoch: int) -> None:
        """Waits for ``event`` (the state machine's tick ends the wait at its deadline; the slack only guards
        against a stall), then aborts with UNAVAILABLE if the replica rebuilt its state meanwhile."""
        try:
            await asyncio.wait_for(event.wait(), timeout_s + STALL_SLACK_S)
        except TimeoutError:
            await _abort(context, BarrierTimeout(f"{what} did not resolve within {timeout_s + STALL_SLACK_S:.1f}s"),
                         what)
        await self._serving(context, what, epoch)

    async def _command(self, context: grpc.aio.ServicerContext, what: str,
                       command: Callable[[], tuple[R, list[Effect]]]) -> R:
        """Runs a state-changing command: UNAVAILABLE unless this replica serves, its typed error as the answer;
        else its journal entries are made durable, its effects carried out, and its result returned."""
        await self._serving(context, what)
        try:
            result, effects = command()
        except IfrtError as e:
            await _abort(context, e, what)
        await self._commit(context, what)
        self._apply(effects)
        return result

    async def _read(self, context: grpc.aio.ServicerContext, what: str, query: Callable[[], R]) -> R:
        """Answers ``query`` from durable state only: every journal entry made before the read is durable first."""
        await self._commit(context, what)
        try:
            return query()  # no await since the commit: nothing newer than what is durable can be read
        except IfrtError as e:
            await _abort(context, e, what)

    # Time and effects.
    async def tick_every(self, interval_s: float) -> None:
        """Lets the state machine expire silent processes and overdue barriers."""
        while True:
            await asyncio.sleep(interval_s)
            if not self.replica.serving:
                continue
            effects = self.state.tick(self._clock())
            try:
                await self.replica.commit()
            except NotServing:
                continue
            self._apply(effects)

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case Notify(event=ProcessFailed(process_id=pid, reason=reason)):
                    log.warning("process %s failed: %s", self.state.describe_process(pid), reason,
                                extra=self._about(pid, "process_failed", reason=reason))
                    self._broadcast(*_event_message(Numbered(effect.number, effect.event)))
                case Notify(event=ProcessRestarted(process_id=pid, incarnation=incarnation)):
                    log.info("process %s restarted (incarnation %d)", self.state.describe_process(pid), incarnation,
                             extra=self._about(pid, "process_restarted", incarnation=incarnation))
                    self._broadcast(*_event_message(Numbered(effect.number, effect.event)))
                case Notify(event=PreemptionNotice(process_id=pid)):
                    log.warning("process %s will be preempted: every process is told", self.state.describe_process(pid),
                                extra=self._about(pid, "preemption_notice"))
                    self._broadcast(*_event_message(Numbered(effect.number, effect.event)))
                case Notify(event=ProcessLeft(process_id=pid)):
                    log.info("process %s left", self.state.describe_process(pid),
                             extra=self._about(pid, "process_left"))
                    self._broadcast(*_event_message(Numbered(effect.number, effect.event)))
                case Republish():
                    if self._sync_generation():
                        self._broadcast(self._published_at, self._topology_event)
                case Evict(client_uid=uid, reason=reason):
                    for queue in self._sessions.get(uid, ()):
                        queue.put_nowait(_Evicted(ProcessDeclaredFailed(f"this process was {reason}; restart it "
                                                                        "to rejoin")))
                case Forgotten(who=who, reason=reason):
                    log.warning("forgot the registration of %s: it %s", who, reason,
                                extra={"event": "registration_forgotten", "reason": reason})
                case BarrierResolved(name=name, error=error):
                    if error is not None:
                        log.info("%s", error)
                    if (event := self._barrier_done.pop(name, None)) is not None:
                        event.set()
                case KeyChanged(key=key, value=value):
                    if value is not None and (event := self._kv_set.pop(key, None)) is not None:
                        event.set()
                    self._send_change(key, value)
                case LiveSetResolved():
                    self._live_decided = _set_and_renew(self._live_decided)
                case PreemptionResolved(step=step, error=error):
                    if step is not None:
                        log.warning("preemption sync point: every process checkpoints at step %d", step,
                                    extra={"event": "preemption_sync", "step": step})
                    elif error is not None:
                        log.info("%s", error)
                    self._preemption_decided = _set_and_renew(self._preemption_decided)

    def _send_change(self, key: str, value: bytes | None) -> None:
        """Sends a key's change to every session watching a prefix of it, serialized once."""
        message = b""
        for queue, prefixes in self._watches.items():
            if any(key.startswith(prefix) for prefix in prefixes):
                message = message or pb.SessionEvent(key_changed=pb.KeyValueChange(
                    key=key, value=value or b"", deleted=value is None)).SerializeToString()
                queue.put_nowait(message)

    def _about(self, process_id: int, event: str, **fields: object) -> dict[str, object]:
        """``extra`` for a log line about one process: the event, its id and host (for --log-format json)."""
        r = self.state.registration_of(process_id)
        where = {"host": r.hostname, "host_address": r.host_address} if r is not None else {}
        return {"event": event, "process_id": process_id, **where, **fields}

    async def status_rpc(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The operator's view (``ifrt status``); a standby answers it too, naming the leader."""
        await _parse(pb.StatusRequest, raw, context)
        return (await self.status_answer()).SerializeToString()

    async def status_answer(self) -> pb.StatusResponse:
        """What ``Status`` answers now (also the status page's source): only what is durable."""
        if self.replica.serving:
            with contextlib.suppress(NotServing):  # then this replica answers as a standby
                await self.replica.commit()  # report only what is durable
        replica, config = self.replica, self.replica.config
        if not replica.serving:
            answer = status_view.standby_answer(cluster_id=config.cluster_id, expected=config.num_processes,
                                                replica=self._advertise, leader=replica.store.leader,
                                                store=replica.store.description, reason=replica.not_serving_reason(),
                                                attempt=config.attempt)
            return answer
        self._sync_generation()  # no await since the commit: the report and the fingerprint are of one state
        return status_view.leader_answer(self.state.report(self._clock()), fingerprint=self._fingerprint,
                                         replica=self._advertise, leader=replica.store.leader or self._advertise,
                                         store=replica.store.description, time_to_publish_s=self.time_to_publish_s,
                                         attempt=config.attempt)

    def report(self) -> status_view.StatusReport | None:
        """The state machine's report as of now (for metrics); None while this replica does not serve."""
        return self.state.report(self._clock()) if self.replica.serving else None

    def status(self) -> str:
        """One line for operators: the published generation, or who is still missing."""
        if not self.replica.serving:
            return self.replica.reason
        topology = self.state.topology
        if topology is not None:
            return f"generation {topology.generation} published with {len(topology.processes)} processes"
        return self.state.progress(self._clock()).describe()

    async def log_progress_every(self, interval_s: float) -> None:
        """Logs who is missing every ``interval_s`` while some, but not all, processes have registered."""
        while True:
            await asyncio.sleep(interval_s)
            if self.replica.serving and self.state.registered and self.state.topology is None:
                log.info("waiting: %s", self.status())


M = TypeVar("M", bound=Message)
R = TypeVar("R")


async def _parse(cls: type[M], raw: bytes, context: grpc.aio.ServicerContext) -> M:
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        await _abort(context, InvalidArgument(f"request is not a valid {cls.DESCRIPTOR.full_name}: {e}"), "request")


def _event_message(numbered: Numbered) -> tuple[int, bytes]:
    """A job event's number and the SessionEvent every session is sent for it (the same bytes for each)."""
    match numbered.event:
        case ProcessFailed(process_id=pid, reason=reason):
            message = pb.SessionEvent(process_failed=pb.ProcessEvent(process_id=pid, reason=reason))
        case ProcessRestarted(process_id=pid, incarnation=incarnation):
            message = pb.SessionEvent(process_restarted=pb.ProcessEvent(process_id=pid, incarnation=incarnation))
        case ProcessLeft(process_id=pid):
            message = pb.SessionEvent(process_left=pb.ProcessEvent(process_id=pid))
        case PreemptionNotice(process_id=pid):
            message = pb.SessionEvent(preemption_notice=pb.ProcessEvent(process_id=pid))
        case _:
            raise AssertionError(f"not a process event: {numbered.event!r}")
    message.event_number = numbered.number
    return numbered.number, message.SerializeToString()


def _snapshot_message(snapshot: Snapshot) -> bytes:
    """The SessionEvent that stands for the events up to ``snapshot.position`` a session can no longer be sent."""
    message = pb.EventSnapshot(
        failed=[pb.ProcessEvent(process_id=e.process_id, reason=e.reason) for e in snapshot.failed],
        left=[pb.ProcessEvent(process_id=e.process_id) for e in snapshot.left],
        restarted=[pb.ProcessEvent(process_id=e.process_id, incarnation=e.incarnation) for e in snapshot.restarted])
    if snapshot.preemption is not None:
        message.preemption_notice.process_id = snapshot.preemption.process_id
    return pb.SessionEvent(snapshot=message, event_number=snapshot.position).SerializeToString()


def _set_and_renew(event: asyncio.Event) -> asyncio.Event:
    """Wakes everyone waiting on ``event``; later waiters wait on the new event returned."""
    event.set()
    return asyncio.Event()


def _proof(context: grpc.aio.ServicerContext) -> str:
    """The hash of the process secret the call carries ("" without one): what the state machine compares."""
    secret = next((v for k, v in context.invocation_metadata() or () if k == SECRET_METADATA), "")
    return proof_of(secret if isinstance(secret, str) else secret.decode(errors="replace"))


_CALL_GONE = getattr(cygrpc, "ExecuteBatchError", ())
"""What grpc.aio raises when a write meets a call its caller has cancelled or whose connection is gone."""


def _internal_errors(handler):
    """Turns an unexpected exception into INTERNAL (logged with its traceback) instead of gRPC's bare UNKNOWN."""
    @wraps(handler)
    async def guarded(request, context: grpc.aio.ServicerContext):
        try:
            return await handler(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            if isinstance(e, _CALL_GONE) or context.cancelled():  # the caller went away mid-write: nothing to tell
                log.debug("%s from %s ended by its caller: %s: %s", handler.__name__, context.peer(),
                          type(e).__name__, e)
                return None
            log.exception("internal error in %s from %s", handler.__name__, context.peer())
            await context.abort(grpc.StatusCode.INTERNAL, _capped(
                f"internal coordinator error in {handler.__name__}: {type(e).__name__}: {e}", MAX_MESSAGE_BYTES))
    return guarded


async def _abort(context: grpc.aio.ServicerContext, error: IfrtError, what: str,
                 level: int = logging.WARNING) -> NoReturn:
    message = _capped(str(error), MAX_MESSAGE_BYTES)
    if level >= logging.WARNING:  # a caller's doing: rate-limited per kind of error
        noisy.log(level, f"rejected:{type(error).__name__}", "rejected %s: %s", _capped(what, MAX_MESSAGE_BYTES // 8),
                  message)
    else:
        log.log(level, "rejected %s: %s", _capped(what, MAX_MESSAGE_BYTES // 8), message)
    await context.abort(error.code, message, trailing_metadata=((ERROR_TRAILER, type(error).__name__),))
    raise AssertionError("context.abort returned")


def _capped(text: str, most_bytes: int) -> str:
    """``text`` cut to ``most_bytes`` of UTF-8: status messages travel as metadata, which clients refuse past
    8 KiB (the caller would lose the typed error), and a log line should not carry a whole request."""
    raw = text.encode()
    if len(raw) <= most_bytes:
        return text
    return raw[:most_bytes].decode(errors="ignore") + " ... (cut)"
