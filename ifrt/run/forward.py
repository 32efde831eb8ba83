"""A worker's unary calls (key-values, barriers, LiveProcesses, preemption, Leave, Status, TransferKey) forwarded by its
``ifrt run`` agent to the coordinator on the agent's own connection, so that a host holds one connection to the
coordinator.

A call goes as it came: its bytes, the worker's token and process secret (the coordinator checks the worker's secret
as on a direct call; the agent adds no authority of its own) and its deadline. Its answer comes back as the coordinator
gave it, a refusal's status, details and ``ifrt-error`` trailer included. One attempt per call: the worker's own retry
loop (``Connection.call``, which rides out a failover) does the waiting, so nothing is retried twice; a replica that
refuses or cannot be reached moves the agent's connection on to the next, and a coordinator the agent cannot reach at
all is answered as CoordinatorUnavailable, which the worker retries, never as its agent gone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

from ifrt.connection import Connection
from ifrt.errors import ERROR_TRAILER, CoordinatorUnavailable, from_rpc_error
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA

SERVICE = "ifrt.topology.v1.Coordinator"
FORWARDED = ("Leave", "Barrier", "CancelBarrier", "KeyValueSet", "KeyValueGet", "KeyValueTryGet", "KeyValueDir",
             "KeyValueMultiGet", "KeyValueMultiSet", "KeyValueIncrement", "KeyValueCompareSet", "KeyValueDelete",
             "LiveProcesses", "PreemptionNotice", "PreemptionSync", "Status", "TransferKey")
"""The Coordinator's unary methods a worker's agent forwards (Register goes in the host's RegisterHost instead)."""
PASSED = (SECRET_METADATA, TOKEN_METADATA)
"""The metadata of a worker's call that goes on with it: whose call it is, and the job's token."""

Metadata = tuple[tuple[str, Any], ...]


class Refusal(Exception):
    """The coordinator's refusal of a forwarded call (or why it could not be asked), to answer the worker with."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: Metadata) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers


class Forwarder:
    """Forwards calls on ``connection``, the agent's own (its RegisterHost and HostSession ride on it too)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    def forward(self, method: str, request: bytes, context: grpc.ServicerContext) -> tuple[bytes, Metadata]:
        """The coordinator's answer to the worker's call ``context`` carrying ``request``, and its trailers; Refusal
        when it refused. Ends when the worker's call does (its wait on the coordinator with it)."""
        connection = self._connection
        target = connection.current()
        channel = connection.bare_channel(target)
        remaining = context.time_remaining()
        # As a direct call does: wait for a connection only to the one replica there is, once it answered.
        ready = len(connection.settings.coordinators) == 1 and connection.ever_answered
        call = channel.unary_unary(f"/{SERVICE}/{method}").future(
            request, timeout=None if remaining is None else max(0.0, remaining), wait_for_ready=ready,
            metadata=tuple((k, v) for k, v in context.invocation_metadata() or () if k in PASSED))
        if not context.add_callback(call.cancel):  # the worker's call ended already
            call.cancel()
        try:
            answer = call.result()
        except grpc.FutureCancelledError:
            raise Refusal(grpc.StatusCode.CANCELLED, "the worker's call ended", ()) from None
        except grpc.RpcError as e:
            raise self._refusal(e, target) from None
        connection.answered(target)
        return answer, passed(call.trailing_metadata())

    def _refusal(self, error: grpc.RpcError, target: str) -> Refusal:
        trailers = passed(error.trailing_metadata())
        if from_rpc_error(error, target).retryable:
            self._connection.rotate(target)  # the worker's next attempt goes to the next replica
        if error.code() == grpc.StatusCode.UNAVAILABLE and ERROR_TRAILER not in dict(trailers):
            unreached = CoordinatorUnavailable(f"this host's ifrt run agent could not reach the coordinator at "
                                               f"{target} ({error.details()})")
            return Refusal(unreached.code, str(unreached), ((ERROR_TRAILER, type(unreached).__name__),))
        return Refusal(error.code(), error.details() or "", trailers)


def passed(metadata: Iterable[tuple[str, Any]] | None) -> Metadata:
    """The trailers of the coordinator's answer that go back to the worker: all but gRPC's own."""
    return tuple((k, v) for k, v in metadata or () if not k.startswith("grpc-"))
