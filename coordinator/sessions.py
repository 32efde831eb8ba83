"""The Session stream of every process: attach, catch up from a job event, then cluster events out and key watches
in, until the connection drops (which detaches the process) or the coordinator ends it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from coordinator.calls import abort, caller_proof, parse
from coordinator.history import GenerationPublished
from coordinator.limits import FLAGS, WATCH_OVERHEAD_BYTES, Limits
from coordinator.messages import PublishedGeneration, event_message, snapshot_message
from coordinator.noise import noisy
from coordinator.outbox import Backlogs, Outbox
from coordinator.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError, InvalidArgument, ProcessDeclaredFailed, ResourceExhausted

log = logging.getLogger("ifrt.coordinator")

_END = object()
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


class Sessions:
    """Every open session of this replica, by client uid, and the key prefixes each watches."""

    def __init__(self, service: SessionHost, limits: Limits) -> None:
        self._service = service
        self._limits = limits
        self._open: dict[str, dict[Outbox, None]] = {}  # client uid -> its open sessions, oldest first
        self._watches: dict[Outbox, set[str]] = {}  # session outbox -> the key prefixes it watches
        self.backlogs = Backlogs(limits.backlog_bytes)
        """What every session and job watch leaves unread, bounded together (``--max-backlog-bytes``)."""
        self._watch_bytes = 0  # of every prefix watched, as --max-watch-bytes counts them

    async def serve(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """A process's live session: cluster events out. Costs nothing while nothing happens: the server's keepalive
        pings watch the connection in gRPC's core, and dropping a silent one ends this call (detaching the process)."""
        service, limits = self._service, self._limits
        try:  # a stream that never opens holds nothing for long
            async with asyncio.timeout(limits.first_message_seconds):
                first = await anext(aiter(requests), None)
        except TimeoutError:
            await abort(context, InvalidArgument(
                f"no SessionOpen within {limits.first_message_seconds}s of the session's start: expected it as the "
                f"first message (the coordinator's {FLAGS['first_message_seconds']})"), "session")
        if first is None:
            return
        opening = await parse(pb.SessionRequest, first, context)
        if opening.WhichOneof("kind") != "open":
            await abort(context, InvalidArgument("the first session message must be SessionOpen"), "session")
        uid = opening.open.client_uid
        await service.serving(context, f"session of client {uid}")
        state = service.state
        try:
            process_id = state.attach(uid, service.clock(), proof=caller_proof(context))
        except IfrtError as e:
            await abort(context, e, f"session of client {uid}")
        queue = Outbox(limits.session_backlog_bytes, lambda waiting: _Evicted(InvalidArgument(
            f"this session left {waiting} bytes of events unread: expected at most {limits.session_backlog_bytes} "
            f"(the coordinator's {FLAGS['session_backlog_bytes']}); attach again and re-read watched keys")),
            self.backlogs, lambda waiting: _Evicted(ResourceExhausted(
                f"this session left {waiting} bytes of events unread, the most of any session, while all sessions "
                f"together passed the coordinator's {FLAGS['backlog_bytes']} of {limits.backlog_bytes} bytes; attach "
                "again and re-read watched keys")))
        self._hold(uid, queue)
        reader = asyncio.create_task(self._read(requests, queue, uid))
        log.debug("session of process %d attached", process_id)
        try:
            generation = service.current_generation()
            await context.write(pb.SessionEvent(attached=pb.Attached(
                heartbeat_interval_ms=round(state.config.heartbeat_interval_s * 1000),
                generation=generation.generation,
                heartbeat_timeout_ms=min(round(state.config.heartbeat_timeout_s * 1000), UINT32_MAX),
            )).SerializeToString())
            sent = 0  # the number of the last job event this session has
            if opening.open.since_event:
                sent = await self._catch_up(context, state, process_id, opening.open)
            else:  # a client that predates numbering: from now on
                if opening.open.generation != generation.generation:
                    await context.write(generation.event)
                for notice in state.notices():  # a notice given while this session was away
                    await context.write(pb.SessionEvent(preemption_notice=pb.ProcessEvent(
                        process_id=notice.process_id)).SerializeToString())
            skip = False
            while (item := await queue.get()) is not _END:
                if isinstance(item, _Evicted):
                    await abort(context, item.error, f"session of process {process_id}")
                if isinstance(item, _Number):
                    skip = item.number <= sent  # queued while the session caught up, and sent then
                elif skip:
                    skip = False
                else:
                    await context.write(item)
        finally:
            reader.cancel()
            self.backlogs.remove(queue)
            self._unwatch(queue)
            held = self._open.get(uid, {})
            held.pop(queue, None)
            if not held:
                self._open.pop(uid, None)
            state.detach(uid, service.clock())

    def _hold(self, uid: str, queue: Outbox) -> None:
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
        service = self._service
        await service.commit(context, what)  # only durable events are sent
        try:  # no await since the commit: nothing newer than what is durable is read
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
        service = self._service
        try:
            async for raw in requests:
                if raw == _HEARTBEAT:
                    service.state.heard(uid, service.clock())
                else:
                    self._request(raw, queue)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait(_END)

    def _request(self, raw: bytes, queue: Outbox) -> None:
        """A watch of a key prefix, acknowledged once changes flow. A watch over a limit is not acknowledged (the
        session has no way to refuse one message) and is logged."""
        try:
            request = pb.SessionRequest.FromString(raw)
        except DecodeError:
            noisy.warning("session:malformed", "ignored a malformed session message of %d bytes", len(raw))
            return
        if request.WhichOneof("kind") != "watch":
            return
        prefix, limits = request.watch.prefix, self._limits
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
        queue.put_nowait(pb.SessionEvent(watching=request.watch).SerializeToString())

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
        """Ends the sessions of a process declared failed, telling it why."""
        for queue in self._open.get(client_uid, ()):
            queue.put_nowait(_Evicted(ProcessDeclaredFailed(f"this process was {reason}; restart it to rejoin")))

    def close(self, reason: str) -> None:
        """Tells every session why it ends, then ends it."""
        self.broadcast(0, pb.SessionEvent(shutdown=pb.Shutdown(reason=reason)).SerializeToString())
        for queues in self._open.values():
            for queue in queues:
                queue.put_nowait(_END)

    async def shutdown(self, reason: str, timeout_s: float) -> None:
        """Tells every session the coordinator is going away, so clients need not wait for a timeout."""
        self.close(reason)
        clock = self._service.clock
        deadline = clock() + timeout_s
        while self._open and clock() < deadline:  # each session ends once its last write is out
            await asyncio.sleep(0.01)
