"""An ``ifrt run`` agent over a raw channel, for tests of the JobAgents service and of a host's calls."""

from __future__ import annotations

import secrets

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub, JobAgentsStub
from ifrt.agent_credential import AGENT_CREDENTIAL_METADATA
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA


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
