"""The HostSession stream of an ``ifrt run`` agent: one stream carries the sessions of its host's workers. Events go
out once per host (the same bytes every session gets); the agent attaches and detaches each worker as that worker's
session with it opens and ends, and reports an exit the moment it sees one. The stream's connection vouches for every
worker attached on it, as a process's own session's connection vouches for that process. Each exit the agent reports
is acknowledged (``exit_noted``) once the coordinator holds it durably, so that the agent stops sending it again on
its next streams; a report of a worker that failed, left or was replaced already changes nothing and is acknowledged
too."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from coordinator.calls import MAX_MESSAGE_BYTES, abort, caller_proof, capped
from coordinator.core.catchup import check_since
from coordinator.core.job_records import Agent
from coordinator.core.limits import shown
from coordinator.noise import noisy
from coordinator.outbox import Outbox
from coordinator.sessions import END, Sessions, worker_ended
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError

log = logging.getLogger("ifrt.coordinator")


class HostSessions:
    """Serves HostSession streams on the sessions of a service."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def serve(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """An agent's host session: the host's events out; its workers' attaches, detaches and exits in."""
        sessions = self._sessions
        service = sessions.service
        opening = await sessions.first(requests, context, pb.HostSessionRequest, "HostSessionOpen")
        if opening is None:
            return
        what = f"host session of agent {shown(opening.open.agent_uid)}"
        await service.serving(context, what)
        try:
            agent = service.state.host_agent(opening.open.agent_uid, caller_proof(context))
        except IfrtError as e:
            await abort(context, e, what)
        what = f"host session of agent {shown(agent.uid)} on {shown(agent.host)}"
        queue = sessions.outbox()
        key = ("host", agent.uid)  # never a client uid: a process cannot take the host's place in sessions
        sessions.hold(key, queue)
        carried: dict[str, None] = {}  # the workers attached on this stream
        sessions.hosts[queue] = carried
        reader = asyncio.create_task(self._read(requests, queue, agent, carried, context))
        log.info("%s opened", what)
        try:
            try:  # refused before it is told it attached
                service.state.check_current(opening.open.run, opening.open.attempt)
                check_since(opening.open.since_event, service.state.event_position)
            except IfrtError as e:
                await abort(context, e, what)
            await context.write(sessions.attached(service.current_generation().generation))
            session_open = pb.SessionOpen(generation=opening.open.generation, since_event=opening.open.since_event)
            sent = await sessions.catch_up(context, -1, session_open)  # -1: every process's events
            await sessions.pump(context, queue, sent, what)
        finally:
            reader.cancel()
            sessions.release(key, queue)
            sessions.hosts.pop(queue, None)
            now = service.clock()
            for uid in carried:
                if sessions.carried.get(uid) is queue:
                    del sessions.carried[uid]
                service.state.detach(uid, now, carried=True)  # closed or dropped: silence is assumed
            log.info("%s ended (%d workers attached on it)", what, len(carried))

    async def _read(self, requests: AsyncIterator[bytes], queue: Outbox, agent: Agent,
                    carried: dict[str, None], context: grpc.aio.ServicerContext) -> None:
        """The stream's messages after HostSessionOpen until it ends."""
        try:
            async for raw in requests:
                try:
                    request = pb.HostSessionRequest.FromString(raw)
                except DecodeError:
                    noisy.warning("host-session:malformed", "ignored a malformed host session message of %d bytes",
                                  len(raw))
                    continue
                await self._request(request, queue, agent, carried, context)
        except (grpc.RpcError, asyncio.CancelledError, grpc.aio.AbortError):  # aborted: this replica stepped down
            pass
        finally:
            queue.put_nowait(END)

    async def _request(self, request: pb.HostSessionRequest, queue: Outbox, agent: Agent,
                       carried: dict[str, None], context: grpc.aio.ServicerContext) -> None:
        sessions = self._sessions
        service = sessions.service
        state, now = service.state, service.clock()
        match request.WhichOneof("kind"):
            case "attach":
                uid, proof = request.attach.client_uid, request.attach.proof
                try:
                    process_id = state.attach_worker(agent, uid, now, proof, len(carried) - (uid in carried))
                except IfrtError as e:
                    queue.put_nowait(worker_ended(uid, e))
                    return
                if uid in carried:
                    # attached again (its session with the agent reconnected): counted once
                    state.detach(uid, now)
                carried[uid] = None
                sessions.carried[uid] = queue
                queue.put_nowait(sessions.attached(service.current_generation().generation, client_uid=uid,
                                                   process_id=process_id))
            case "detach":
                uid = request.detach.client_uid
                if carried.pop(uid, 0) is None:
                    if sessions.carried.get(uid) is queue:
                        del sessions.carried[uid]
                    state.detach(uid, now)
            case "exited":
                await self._exited(request.exited, queue, agent, context)
            case "watch":
                sessions.watch(request.watch, queue)
            case "unwatch":
                sessions.unwatch(request.unwatch, queue)

    async def _exited(self, exited: pb.WorkerExit, queue: Outbox, agent: Agent,
                      context: grpc.aio.ServicerContext) -> None:
        """An exit (or hang) the agent reports: the process fails at once; ``exit_noted`` once that is durable (also
        for a process that is not live any more: a report sent again changes nothing)."""
        service = self._sessions.service
        uid, decided = exited.client_uid, []

        def decision() -> list:
            try:
                reason = capped(exited.reason, MAX_MESSAGE_BYTES)
                effects = service.state.worker_exited(agent, uid, reason, service.clock(), exited.proof)
            except IfrtError as e:
                queue.put_nowait(worker_ended(uid, e))
                return []
            decided.append(bool(effects))
            return effects

        durable = await service.decide(decision)  # False: this replica stepped down first, the agent sends it again
        if not durable or not decided:  # or refused (worker_ended)
            return
        if not decided[0]:  # nothing new: what made the process not live may still be on its way to the store
            await service.commit(context, f"the exit report of {uid}")
        queue.put_nowait(pb.SessionEvent(exit_noted=pb.WorkerSession(client_uid=uid)).SerializeToString())
