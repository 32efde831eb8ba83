"""An ``ifrt run`` agent over a raw channel, for tests of the JobAgents service and of a host's calls (``HostAgent``:
one that registers its workers in one call and carries their sessions on its host session)."""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
from collections.abc import Iterator

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub, JobAgentsStub
from ifrt.agent_credential import AGENT_CREDENTIAL_METADATA
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA, proof_of
from tests.helpers import register_request


class WireAgent:
    """An agent over a raw channel: joins the job with a watch (its own secret on every call) and asks NextAttempt.
    Processes registered by ``register_all`` are on hosts ``host-<id>`` at 127.0.0.1: the agent on ``host-1``
    runs process 1."""

    def __init__(self, address: str, host: str, *, workers: int = 1, max_restarts: int | None = 3,
                 uid: str | None = None, secret: str | None = None, token: str | None = None,
                 credential: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.coordinator, self.jobs = CoordinatorStub(self.channel), JobAgentsStub(self.channel)
        self.host, self.workers, self.max_restarts = host, workers, max_restarts
        self.uid = uid or f"agent-{host}"
        self.metadata = [(SECRET_METADATA, secret or secrets.token_hex(16))]
        if token is not None:
            self.metadata.append((TOKEN_METADATA, token))
        if credential is not None:
            self.metadata.append((AGENT_CREDENTIAL_METADATA, credential))

    def watch(self, timeout: float = 120):
        """The job's watch, once it joined; and its first message (the JobState)."""
        request = pb.WatchJobRequest(host=self.host, agent_uid=self.uid, workers=self.workers,
                                     max_restarts=self.max_restarts)
        stream = self.jobs.WatchJob(request, timeout=timeout, metadata=self.metadata)
        return stream, next(stream)

    def join(self) -> WireAgent:
        stream, _ = self.watch()
        stream.cancel()
        return self

    def next(self, ended: int, *, process_id: int | None = None, reason: str = "worker exited with 1",
             request_id: str = "", max_restarts: int | None = None) -> pb.JobState:
        pid = int(self.host.rpartition("-")[2]) if process_id is None else process_id
        request = pb.NextAttemptRequest(ended_attempt=ended, max_restarts=max_restarts, request_id=request_id,
                                        agent_uid=self.uid, failure=pb.AttemptFailure(
                                            attempt=ended, process_id=pid, host=self.host, reason=reason))
        return self.jobs.NextAttempt(request, timeout=30, metadata=self.metadata).state

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WireAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HostAgent(WireAgent):
    """A WireAgent that registers its workers in one call and carries their sessions on one stream."""

    def __init__(self, address: str, host: str, workers: int = 2) -> None:
        super().__init__(address, host, workers=workers)
        self.secrets = {rank: secrets.token_hex(16) for rank in range(workers)}
        self.events: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()

    def request(self, rank: int, **fields) -> pb.HostProcess:
        defaults = {"client_uid": f"{self.host}-{rank}", "hostname": self.host, "local_rank": rank,
                    "address": f"127.0.0.1:{7100 + rank}"}
        return pb.HostProcess(request=register_request(**{**defaults, **fields}),
                              proof=proof_of(self.secrets[rank]))

    def register(self, *processes: pb.HostProcess, wait_ms: int = 20_000) -> pb.RegisterHostResponse:
        request = pb.RegisterHostRequest(agent_uid=self.uid, processes=processes, wait_ms=wait_ms)
        return self.coordinator.RegisterHost(request, timeout=30, metadata=self.metadata)

    def open(self, since_event: int) -> None:
        """Opens the host session from ``since_event``; its events arrive in ``events``."""
        self.send(open=pb.HostSessionOpen(agent_uid=self.uid, since_event=since_event))

        def requests() -> Iterator[pb.HostSessionRequest]:
            while (item := self._outbox.get()) is not None:
                yield item

        self.stream = self.coordinator.HostSession(requests(), metadata=self.metadata)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled, or the channel closed at the test's end
            for event in self.stream:
                self.events.put(event)

    def send(self, **kind) -> None:
        self._outbox.put(pb.HostSessionRequest(**kind))

    def attach(self, rank: int, secret: str | None = None) -> None:
        self.send(attach=pb.WorkerSession(client_uid=f"{self.host}-{rank}",
                                          proof=proof_of(secret or self.secrets[rank])))

    def next(self, kind: str, timeout: float = 10) -> pb.SessionEvent:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                break
            if event.WhichOneof("kind") == kind:
                return event
        raise AssertionError(f"no {kind} event on the host session of {self.host} within {timeout}s")

    def reconnect(self, address: str) -> None:
        """Drops the host session and channel (its coordinator is gone) for a channel to ``address``."""
        self._outbox.put(None)
        self.channel.close()
        self._outbox, self.events = queue.Queue(), queue.Queue()
        self.channel = grpc.insecure_channel(address)
        self.coordinator = CoordinatorStub(self.channel)

    def drained(self) -> list[pb.SessionEvent]:
        """The events received and not read yet."""
        events = []
        with contextlib.suppress(queue.Empty):
            while True:
                events.append(self.events.get_nowait())
        return events

    def close(self) -> None:
        self._outbox.put(None)
        super().close()
