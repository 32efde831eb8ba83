"""Simulated ``ifrt run`` agents for the benchmarks: one grpc.aio channel (one connection) per agent, as a host has.

An agent joins the job (``JobAgents.WatchJob`` with its own secret, the watch held open as the real agent holds it),
registers its host's processes in one ``RegisterHost`` call (each worker's RegisterRequest with the hash of that
worker's own secret) and carries their sessions on one ``HostSession`` stream. Used by bench/host_driver.py
(discovery) and bench/liveness_hosts.py (liveness). What each worker registers is bench/content.py's process of that
id, on the host of its agent (``content.on_host``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
import uuid
from collections.abc import Callable

import grpc
from content import Cluster, on_host
from ifrt_driver import RETRYABLE, WAIT_MS, wire_fields

from ifrt._generated import coordinator_pb2 as pb
from ifrt.client_config import CHANNEL_OPTIONS
from ifrt.protocol import SECRET_METADATA, proof_of

COORDINATOR = "/ifrt.topology.v1.Coordinator"
WATCH_JOB = "/ifrt.topology.v1.JobAgents/WatchJob"


def worker_request(cluster: Cluster, process_id: int, per_host: int) -> pb.RegisterRequest:
    """What worker ``process_id`` asks its agent to register: an explicit id, its devices, its host's name and its
    local rank (as ``ifrt.Client`` builds it; host-only attributes are not sent)."""
    host, rank = on_host(cluster, process_id, per_host)
    request = pb.RegisterRequest(cluster_id="", num_processes=cluster.n, client_uid=uuid.uuid4().hex,
                                 hostname=host.hostname, local_rank=rank, address=host.address, plugin=host.plugin)
    request.process_id = process_id
    for d in host.devices:
        request.devices.add(**wire_fields(d))
    return request


class SimAgent:
    """One host's agent for processes ``first .. first + per_host - 1``: its channel, its secret, its workers'."""

    def __init__(self, address: str, cluster: Cluster, first: int, per_host: int) -> None:
        self.first, self.per_host = first, per_host
        self.workers = [worker_request(cluster, first + i, per_host) for i in range(per_host)]
        self.host = self.workers[0].hostname
        self.uid = f"agent-{first // per_host}-{secrets.token_hex(4)}"
        self.metadata = ((SECRET_METADATA, secrets.token_hex(16)),)
        self.worker_secrets = [secrets.token_hex(16) for _ in self.workers]
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.watch: grpc.aio.UnaryStreamCall | None = None
        self.session: grpc.aio.StreamStreamCall | None = None
        self.answer = pb.RegisterHostResponse()
        self.attempts = 0
        self.retried: list[str] = []

    async def join(self) -> None:
        """Joins the job with a watch (its first message, the JobState, means joined); the watch stays open."""
        request = pb.WatchJobRequest(host=self.host, agent_uid=self.uid, workers=self.per_host)
        self.watch = self.channel.unary_stream(WATCH_JOB)(request.SerializeToString(), metadata=self.metadata,
                                                           wait_for_ready=True)
        first = await self.watch.read()
        if first is grpc.aio.EOF:
            raise RuntimeError(f"the job watch of {self.host} ended before its JobState")

    async def register(self, deadline: float) -> bytes:
        """RegisterHost until every worker holds an id and the answer carries the topology (calling again on a
        progress answer, and on what ``ifrt.Client`` retries); returns the answer's bytes."""
        processes = [pb.HostProcess(request=r, proof=proof_of(s)) for r, s in zip(self.workers, self.worker_secrets,
                                                                                  strict=True)]
        raw = pb.RegisterHostRequest(agent_uid=self.uid, processes=processes, wait_ms=WAIT_MS).SerializeToString()
        call = self.channel.unary_unary(f"{COORDINATOR}/RegisterHost")
        failures = 0
        while (remaining := deadline - time.monotonic()) > 0:
            self.attempts += 1
            try:
                answer = await call(raw, timeout=remaining, metadata=self.metadata, wait_for_ready=True)
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                self.retried.append(f"{e.code().name}: {e.details()}")
                failures += 1
                await asyncio.sleep(random.uniform(0.5, 1.0) * min(0.1, 0.01 * 2 ** min(failures, 16)))
                continue
            self.answer = pb.RegisterHostResponse.FromString(answer)
            refused = [p for p in self.answer.processes if p.code]
            if refused:
                raise RuntimeError(f"{self.host}: {len(refused)} workers refused: {refused[0].error}: "
                                   f"{refused[0].message}")
            if all(p.process_id >= 0 for p in self.answer.processes) and pb.RegisterResponse.FromString(
                    self.answer.answer).topology:
                return answer
        raise TimeoutError(f"{self.host}: no topology before the deadline")

    def worker_answer(self, index: int) -> bytes:
        """The bytes worker ``index`` gets from its agent: its RegisterResponse (as the protocol defines it)."""
        return pb.RegisterResponse(process_id=self.answer.processes[index].process_id).SerializeToString() + \
            self.answer.answer

    async def open_session(self) -> None:
        """Opens the host session from the job event the answer says and attaches every worker; returns once the
        coordinator said ``attached`` for the host and for each worker."""
        since = pb.RegisterResponse.FromString(self.answer.answer).event_position
        self.session = self.channel.stream_stream(f"{COORDINATOR}/HostSession")(metadata=self.metadata,
                                                                                 wait_for_ready=True)
        await self.session.write(pb.HostSessionRequest(open=pb.HostSessionOpen(
            agent_uid=self.uid, since_event=since)).SerializeToString())
        for request, secret in zip(self.workers, self.worker_secrets, strict=True):
            await self.session.write(pb.HostSessionRequest(attach=pb.WorkerSession(
                client_uid=request.client_uid, proof=proof_of(secret))).SerializeToString())
        attached = 0
        while attached < 1 + len(self.workers):
            raw = await self.session.read()
            if raw is grpc.aio.EOF:
                raise RuntimeError(f"the host session of {self.host} ended while attaching")
            event = pb.SessionEvent.FromString(raw)
            kind = event.WhichOneof("kind")
            if kind == "worker_ended":
                raise RuntimeError(f"{self.host}: a worker was refused: {event.worker_ended.message}")
            attached += kind == "attached"

    async def report_exit(self, index: int, reason: str) -> None:
        """Reports worker ``index``'s exit, as the agent does the moment ``waitpid`` returns it."""
        assert self.session is not None
        await self.session.write(pb.HostSessionRequest(exited=pb.WorkerExit(
            client_uid=self.workers[index].client_uid, proof=proof_of(self.worker_secrets[index]),
            reason=reason)).SerializeToString())

    async def read_events(self, on_event: Callable[[pb.SessionEvent], None]) -> None:
        """Hands every event of the host session to ``on_event`` until the stream ends."""
        assert self.session is not None
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            while (raw := await self.session.read()) is not grpc.aio.EOF:
                on_event(pb.SessionEvent.FromString(raw))

    async def close(self) -> None:
        """Ends the session and the watch, then the channel."""
        for call in (self.session, self.watch):
            if call is not None:
                call.cancel()
        await self.channel.close()


def hosts(first: int, count: int, per_host: int) -> list[int]:
    """The first process of each host among processes ``first .. first + count - 1`` (whole hosts only)."""
    if first % per_host or count % per_host:
        raise ValueError(f"processes {first}..{first + count - 1} are not whole hosts of {per_host}")
    return list(range(first, first + count, per_host))
