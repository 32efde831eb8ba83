"""The Session stream of every process: attach, catch up from a job event, then cluster events out and key watches
in, until the connection drops (which detaches the process) or the coordinator ends it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError

from coordinator.calls import MAX_MESSAGE_BYTES, abort, caller_proof, capped, parse
from coordinator.core.history import GenerationPublished
from coordinator.core.limits import FLAGS, WATCH_OVERHEAD_BYTES, Limits
from coordinator.core.state import ClusterState
from coordinator.messages import PublishedGeneration, event_message, snapshot_message
from coordinator.noise import noisy
from coordinator.outbox import Backlogs, Outbox
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError, InvalidArgument, ProcessDeclaredFailed, ResourceExhausted

log = logging.getLogger("ifrt.coordinator")
M = TypeVar("M", pb.SessionRequest, pb.HostSessionRequest)

END = object()
"""Queued last: the session ends once it has written what came before."""
_HEARTBEAT = pb.SessionRequest(heartbeat=pb.Heartbeat()).SerializeToString()
"""A Heartbeat message: the connection's keepalive pings carry liveness, but a session that sends none for a while
shows its process as slow, and one that stops for ``--hung-timeouts`` with its connection up fails it (hung)."""
UINT32_MAX = (1 << 32) - 1
"""The most an Attached field in milliseconds can say (a heartbeat timeout of 49 days or more is said as that)."""


class _Number:
    """Queued just before a job event's bytes: its number, so a session that caught up skips what it has."""

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number


class _Evicted:
    def __init__(self, error: IfrtError) -> None:
        self.error = error


class SessionHost(Protocol):
    """What sessions need of the service that holds them: the state, its clock, commits and the published generation."""

    clock: Callable[[], float]

    @property
    def state(self) -> ClusterState: ...

    def current_generation(self) -> PublishedGeneration: ...

    async def serving(self, context: grpc.aio.ServicerContext, what: str, epoch: int | None = None) -> None: ...

    async def commit(self, context: grpc.aio.ServicerContext, what: str) -> None: ...

    async def decide(self, decision: Callable[[], list]) -> bool: ...


class Sessions:
    """Every open session of this replica, by client uid, and the key prefixes each watches."""

    def __init__(self, service: SessionHost, limits: Limits) -> None:
        self.service = service
        self._limits = limits
        self._open: dict[Hashable, dict[Outbox, None]] = {}  # client uid (or host) -> its open sessions, oldest first
        self._watches: dict[Outbox, set[str]] = {}  # session outbox -> the key prefixes it watches
        self.backlogs = Backlogs(limits.backlog_bytes)
        """What every session and job watch leaves unread, bounded together (``--max-backlog-bytes``)."""
        self._watch_bytes = 0  # of every prefix watched, as --max-watch-bytes counts them
        self.carried: dict[str, Outbox] = {}
        """Client uid -> the host session (``coordinator.host_sessions``) its agent carries it on."""
        self.hosts: dict[Outbox, dict[str, None]] = {}
        """Host session -> the workers attached on it."""

    async def serve(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """A process's live session: cluster events out. Costs nothing while nothing happens: the server's keepalive
        pings watch the connection in gRPC's core, and dropping a silent one ends this call (detaching the process)."""
        service = self.service
        opening = await self.first(requests, context, pb.SessionRequest, "SessionOpen")
        if opening is None:
            return
        uid = opening.open.client_uid
        await service.serving(context, f"session of client {uid}")
        state = service.state
        try:
            state.check_current(opening.open.run, opening.open.attempt)
            process_id = state.attach(uid, service.clock(), proof=caller_proof(context))
        except IfrtError as e:
            await abort(context, e, f"session of client {uid}")
        queue = self.outbox()
        self.hold(uid, queue)
        reader = asyncio.create_task(self._read(requests, queue, uid))
        log.debug("session of process %d attached", process_id)
        try:
            await context.write(self.attached(service.current_generation().generation))
            sent = await self.catch_up(context, process_id, opening.open)
            await self.pump(context, queue, sent, f"session of process {process_id}")
        finally:
            reader.cancel()
            self.release(uid, queue)
            state.detach(uid, service.clock())

    async def first(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext, cls: type[M],
                    name: str) -> M | None:
        """A stream's first message, which must open it (``name``: the oneof field "open"); None if it ended
        before one. A stream that never opens holds nothing for long."""
        limits = self._limits
        try:
            async with asyncio.timeout(limits.first_message_seconds):
                first = await anext(aiter(requests), None)
        except TimeoutError:
            await abort(context, InvalidArgument(
                f"no {name} within {limits.first_message_seconds}s of the session's start: expected it as the "
                f"first message (the coordinator's {FLAGS['first_message_seconds']})"), "session")
        if first is None:
            return None
        opening = await parse(cls, first, context)
        if opening.WhichOneof("kind") != "open":
            await abort(context, InvalidArgument(f"the first session message must be {name}"), "session")
        return opening

    def attached(self, generation: int, **worker: object) -> bytes:
        """The ``attached`` event: what a session (or a worker carried on a host's) needs of the coordinator."""
        state = self.service.state
        config = state.config
        return pb.SessionEvent(attached=pb.Attached(
            attempt=state.attempts.current, run=state.run,
            heartbeat_interval_ms=round(config.heartbeat_interval_s * 1000),
            generation=generation,
            heartbeat_timeout_ms=min(round(config.heartbeat_timeout_s * 1000), UINT32_MAX),
            hung_after_ms=min(round(config.hung_after_s * 1000), UINT32_MAX),
            **worker,  # type: ignore[arg-type]
        )).SerializeToString()

    async def catch_up(self, context: grpc.aio.ServicerContext, process_id: int, opening: pb.SessionOpen) -> int:
        """What a session is sent before the queued events: every event after its ``since_event`` (see
        ``_catch_up``), or for a client that predates numbering the current generation and a notice; returns the
        number of the last job event it has then."""
        if opening.since_event:
            return await self._catch_up(context, self.service.state, process_id, opening)
        generation = self.service.current_generation()
        if opening.generation != generation.generation:
            await context.write(generation.event)
        for notice in self.service.state.notices():  # a notice given while this session was away
            await context.write(pb.SessionEvent(preemption_notice=pb.ProcessEvent(
                process_id=notice.process_id)).SerializeToString())
        return 0

    def release(self, key: Hashable, queue: Outbox) -> None:
        """Forgets a session that ended: its queue, its watches."""
        self.backlogs.remove(queue)
        self._unwatch(queue)
        held = self._open.get(key, {})
        held.pop(queue, None)
        if not held:
            self._open.pop(key, None)

    def outbox(self) -> Outbox:
        """A new session's queue of events, bounded alone and with every other session's."""
        limits = self._limits
        return Outbox(limits.session_backlog_bytes, lambda waiting: _Evicted(InvalidArgument(
            f"this session left {waiting} bytes of events unread: expected at most {limits.session_backlog_bytes} "
            f"(the coordinator's {FLAGS['session_backlog_bytes']}); attach again and re-read watched keys")),
            self.backlogs, lambda waiting: _Evicted(ResourceExhausted(
                f"this session left {waiting} bytes of events unread, the most of any session, while all sessions "
                f"together passed the coordinator's {FLAGS['backlog_bytes']} of {limits.backlog_bytes} bytes; attach "
                "again and re-read watched keys")))

    async def pump(self, context: grpc.aio.ServicerContext, queue: Outbox, sent: int, what: str) -> None:
        """Writes the session's queued events until it ends (``sent``: the last job event it has already)."""
        skip = False
        while (item := await queue.get()) is not END:
            if isinstance(item, _Evicted):
                await abort(context, item.error, what)
            if isinstance(item, _Number):
                skip = item.number <= sent  # queued while the session caught up, and sent then
            elif skip:
                skip = False
            else:
                await context.write(item)

    def hold(self, uid: Hashable, queue: Outbox) -> None:
        """Keeps a process's new session; past ``--max-sessions-per-process`` its oldest one ends (a client that
        reconnects holds two briefly)."""
        held = self._open.setdefault(uid, {})
        held[queue] = None
        while len(held) > self._limits.sessions_per_process:
            oldest = next(iter(held))
            del held[oldest]
            self._unwatch(oldest)
            most = self._limits.sessions_per_process
            oldest.put_nowait(_Evicted(ResourceExhausted(
                f"this process opened a newer session: it may hold at most {most} at once (the coordinator's "
                f"{FLAGS['sessions_per_process']}); this one, its oldest, ends")))

    async def _catch_up(self, context: grpc.aio.ServicerContext, state: ClusterState, process_id: int,
                        opening: pb.SessionOpen) -> int:
        """Sends a session that opens from a job event every durable event after it, in order (a snapshot where the
        history no longer reaches back); returns the number of the last one it now has."""
        what = f"session of process {process_id}"
        service = self.service
        await service.commit(context, what)  # only durable events are sent
        try:  # no await since the commit: nothing newer than what is durable is read
            state.check_current(opening.run, opening.attempt)  # the run may have ended since the session attached
            catch_up = state.catch_up(process_id, opening.since_event, opening.generation)
        except IfrtError as e:
            await abort(context, e, what)
        topology_event = service.current_generation().event
        for n in catch_up.events:  # one at a time: each write waits for the caller to read (flow control)
            await context.write(topology_event if isinstance(n.event, GenerationPublished) else event_message(n)[1])
        if catch_up.snapshot is not None:
            log.info("session of process %d opened from job event %d, which the history (%s %d) no longer holds: "
                     "sent each process's state as of event %d", process_id, opening.since_event,
                     FLAGS["event_history"], self._limits.event_history, catch_up.head)
            await context.write(snapshot_message(catch_up.snapshot))
        return catch_up.head

    async def _read(self, requests: AsyncIterator[bytes], queue: Outbox, uid: str) -> None:
        """Reads the session's messages after SessionOpen until the stream ends: Heartbeats (the process answers)
        and key watches."""
        service = self.service
        try:
            async for raw in requests:
                if raw == _HEARTBEAT:
                    service.state.heard(uid, service.clock())
                else:
                    self._request(raw, queue)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait(END)

    def _request(self, raw: bytes, queue: Outbox) -> None:
        """A watch of a key prefix, acknowledged once changes flow. A watch over a limit is not acknowledged (the
        session has no way to refuse one message) and is logged."""
        try:
            request = pb.SessionRequest.FromString(raw)
        except DecodeError:
            noisy.warning("session:malformed", "ignored a malformed session message of %d bytes", len(raw))
            return
        if request.WhichOneof("kind") == "watch":
            self.watch(request.watch, queue)
        elif request.WhichOneof("kind") == "unwatch":
            self.unwatch(request.unwatch, queue)

    def watch(self, watch: pb.WatchKeys, queue: Outbox) -> None:
        """Every later change of a key under the prefix goes to the session ``queue``, acknowledged by a
        ``watching`` event; a watch over a limit is logged, not acknowledged."""
        prefix, limits = watch.prefix, self._limits
        watched = self._watches.setdefault(queue, set())
        if len(prefix.encode()) > limits.kv_key_bytes:
            noisy.warning("session:watch-length", "ignored a watch of a prefix of %d bytes: expected at most %d "
                          "(the coordinator's %s)", len(prefix.encode()), limits.kv_key_bytes, FLAGS["kv_key_bytes"])
            return
        if prefix not in watched and len(watched) >= limits.watches_per_session:
            noisy.warning("session:watch-count", "ignored a watch of a session that watches %d prefixes: expected "
                          "at most %d (the coordinator's %s)", len(watched), limits.watches_per_session,
                          FLAGS["watches_per_session"])
            return
        spent = len(prefix.encode()) + WATCH_OVERHEAD_BYTES
        if prefix not in watched and self._watch_bytes + spent > limits.watch_bytes:
            noisy.warning("session:watch-bytes", "ignored a watch of %d bytes while sessions watch prefixes of %d "
                          "bytes: expected at most %d (the coordinator's %s)", spent, self._watch_bytes,
                          limits.watch_bytes, FLAGS["watch_bytes"])
            return
        if prefix not in watched:
            self._watch_bytes += spent
        watched.add(prefix)
        queue.put_nowait(pb.SessionEvent(watching=watch).SerializeToString())

    def unwatch(self, watch: pb.WatchKeys, queue: Outbox) -> None:
        """The session ``queue`` no longer watches the prefix (nothing if it did not): its slot and bytes are free."""
        watched = self._watches.get(queue)
        if watched is not None and watch.prefix in watched:
            watched.discard(watch.prefix)
            self._watch_bytes -= len(watch.prefix.encode()) + WATCH_OVERHEAD_BYTES

    def _unwatch(self, queue: Outbox) -> None:
        """Forgets what a session that ended (or was ended) watched."""
        for prefix in self._watches.pop(queue, ()):
            self._watch_bytes -= len(prefix.encode()) + WATCH_OVERHEAD_BYTES

    def broadcast(self, number: int, message: bytes) -> None:
        """Queues ``message`` (job event ``number``; 0: not a job event) for every session."""
        marker = _Number(number) if number else None
        for queues in self._open.values():
            for queue in queues:
                if marker is not None:
                    queue.put_nowait(marker)
                queue.put_nowait(message)

    def send_change(self, key: str, value: bytes | None) -> None:
        """Sends a key's change to every session watching a prefix of it, serialized once."""
        message = b""
        for queue, prefixes in self._watches.items():
            if any(key.startswith(prefix) for prefix in prefixes):
                message = message or pb.SessionEvent(key_changed=pb.KeyValueChange(
                    key=key, value=value or b"", deleted=value is None)).SerializeToString()
                queue.put_nowait(message)

    def evict(self, client_uid: str, reason: str) -> None:
        """Ends the sessions of a process declared failed, telling it why (its host's agent, where one carries
        it)."""
        error = ProcessDeclaredFailed(f"this process was {reason}; restart it to rejoin")
        for queue in self._open.get(client_uid, ()):
            queue.put_nowait(_Evicted(error))
        if (carrier := self.carried.pop(client_uid, None)) is not None:
            self.hosts.get(carrier, {}).pop(client_uid, None)  # no longer one of the workers its host carries
            carrier.put_nowait(worker_ended(client_uid, error))

    def close(self, reason: str, *, ended_attempt: int = 0, next_attempt: int = 0, ended_run: int = 0,
              next_run: int = 0) -> None:
        """Tells every session why it ends (with the attempts or runs, when the job's attempt or run ended), then
        ends it."""
        shutdown = pb.Shutdown(reason=reason, ended_attempt=ended_attempt, next_attempt=next_attempt,
                               ended_run=ended_run, next_run=next_run)
        self.broadcast(0, pb.SessionEvent(shutdown=shutdown).SerializeToString())
        for queues in self._open.values():
            for queue in queues:
                queue.put_nowait(END)

    async def shutdown(self, reason: str, timeout_s: float) -> None:
        """Tells every session the coordinator is going away, so clients need not wait for a timeout."""
        self.close(reason)
        clock = self.service.clock
        deadline = clock() + timeout_s
        while self._open and clock() < deadline:  # each session ends once its last write is out
            await asyncio.sleep(0.01)


def worker_ended(client_uid: str, error: IfrtError) -> bytes:
    """The ``worker_ended`` event of a host session: the worker's own session would have ended with ``error``."""
    return pb.SessionEvent(worker_ended=pb.WorkerSessionEnded(
        client_uid=client_uid, code=error.code.value[0], error=type(error).__name__,
        message=capped(str(error), MAX_MESSAGE_BYTES))).SerializeToString()
