"""The standard gRPC health service (``grpc.health.v1.Health``), bounded: it needs no token (probes carry none), so
whatever a caller sends it costs kilobytes: short names, a deadline for the request, few watches per connection.

Check and Watch are served stream-shaped (wire-compatible with unary requests) so that the request is read under
a deadline: a caller that opens a call and never sends its request holds nothing past ``--first-message-timeout``.
With a token, a watch from a connection that made no call with it (a stranger's) counts against
``--max-stranger-health-watches`` and ends after ``--max-connection-idle``: it cannot keep a connection busy for good.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from coordinator.core.limits import FLAGS, Limits
from coordinator.noise import noisy
from ifrt.errors import ERROR_TRAILER, IfrtError, InvalidArgument, ResourceExhausted

SERVICE = "grpc.health.v1.Health"
METHODS = (f"/{SERVICE}/Check", f"/{SERVICE}/Watch")
ServingStatus = health_pb2.HealthCheckResponse.ServingStatus
_FRAMING = 8
"""Bytes of a HealthCheckRequest besides its name (a field tag and a length)."""


class HealthService:
    """Serves the status of each name ``set`` was called for; other names are NOT_FOUND (Check) or SERVICE_UNKNOWN
    (Watch), as in gRPC's reference servicer."""

    def __init__(self, limits: Limits, trusted: Callable[[str], bool] | None = None) -> None:
        """``trusted`` tells whether a peer's connection made a call with the token (None: every caller is the
        job's, as without a token)."""
        self._limits = limits
        self._trusted = trusted
        self._status: dict[str, ServingStatus] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Event()  # replaced by a new one at every change
        self._shutting_down = False
        self._watches: Counter[str] = Counter()  # peer (one per connection) -> its open watches
        self.watching = 0
        """Watches open now, over all connections."""
        self.strangers_watching = 0
        """Of them, watches from connections that made no call with the token."""

    async def set(self, name: str, status: ServingStatus) -> None:
        """Sets the status served for ``name`` (ignored once shutting down)."""
        if not self._shutting_down:
            self._set(name, status)

    async def enter_graceful_shutdown(self) -> None:
        """Every name is NOT_SERVING from now on."""
        self._shutting_down = True
        for name in self._status:
            self._set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set(self, name: str, status: ServingStatus) -> None:
        self._status[name] = status
        self._changed.set()
        self._changed = asyncio.Event()

    def handlers(self) -> grpc.GenericRpcHandler:
        """Raw-bytes handlers for Check and Watch."""
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Check": grpc.stream_unary_rpc_method_handler(self._check),
            "Watch": grpc.stream_stream_rpc_method_handler(self._watch),
        })

    async def _check(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        name = await self._name(requests, context, "health check")
        status = self._status.get(name)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=status).SerializeToString()

    async def _watch(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        name = await self._name(requests, context, "health watch")
        peer, limits = context.peer(), self._limits
        if self._watches[peer] >= limits.health_watches_per_connection:
            await _refuse(context, InvalidArgument(
                f"this connection holds {self._watches[peer]} health watches: expected at most "
                f"{limits.health_watches_per_connection} (the coordinator's "
                f"{FLAGS['health_watches_per_connection']})"), "health watch")
        if self.watching >= limits.health_watches:
            await _refuse(context, InvalidArgument(
                f"the coordinator holds {self.watching} health watches: expected at most {limits.health_watches} "
                f"(the coordinator's {FLAGS['health_watches']})"), "health watch")
        stranger = self._trusted is not None and not self._trusted(peer)
        if stranger and self.strangers_watching >= limits.stranger_health_watches:
            await _refuse(context, ResourceExhausted(
                f"callers without the cluster token hold {self.strangers_watching} health watches: expected at most "
                f"{limits.stranger_health_watches} (the coordinator's {FLAGS['stranger_health_watches']})"),
                "health watch")
        self._watches[peer] += 1
        self.watching += 1
        self.strangers_watching += stranger
        try:
            if stranger:  # ends cleanly; a watcher that wants more watches again, within the limits above
                async with asyncio.timeout(limits.connection_idle_seconds):
                    await self._send_changes(name, context)
            else:
                await self._send_changes(name, context)
        except TimeoutError:
            return
        finally:
            self.watching -= 1
            self.strangers_watching -= stranger
            self._watches[peer] -= 1
            if not self._watches[peer]:
                del self._watches[peer]

    async def _send_changes(self, name: str, context: grpc.aio.ServicerContext) -> None:
        """Writes the status of ``name`` now and at every change, until cancelled."""
        last = None
        while True:
            changed = self._changed
            status = self._status.get(name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status).SerializeToString())
                last = status
            await changed.wait()

    async def _name(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext, what: str) -> str:
        """The service name of the call's one request, read within the first-message deadline and checked."""
        limits = self._limits
        try:
            async with asyncio.timeout(limits.first_message_seconds):
                raw = await anext(aiter(requests), None)
        except TimeoutError:
            raw = None
        if raw is None:
            await _refuse(context, InvalidArgument(
                f"no request within {limits.first_message_seconds}s: expected a HealthCheckRequest (the "
                f"coordinator's {FLAGS['first_message_seconds']})"), what)
        size = len(raw)
        if size > limits.health_name_bytes + _FRAMING:  # refused unparsed, and not kept by the refusal's traceback
            del raw
            await _refuse(context, InvalidArgument(
                f"a {what} request of {size} bytes: expected a service name of at most {limits.health_name_bytes} "
                f"bytes (the coordinator's {FLAGS['health_name_bytes']})"), what)
        try:
            request = health_pb2.HealthCheckRequest.FromString(raw)
        except DecodeError:
            await _refuse(context, InvalidArgument(f"a {what} request of {size} bytes is not a valid "
                                                   "HealthCheckRequest"), what)
        if len(request.service.encode()) > limits.health_name_bytes:
            await _refuse(context, InvalidArgument(
                f"service name of {len(request.service.encode())} bytes: expected at most "
                f"{limits.health_name_bytes} (the coordinator's {FLAGS['health_name_bytes']})"), what)
        return request.service


async def _refuse(context: grpc.aio.ServicerContext, error: IfrtError, what: str) -> None:
    noisy.warning(f"health:{type(error).__name__}", "refused a %s from %s: %s", what, context.peer(), error)
    await context.abort(error.code, str(error), trailing_metadata=((ERROR_TRAILER, type(error).__name__),))
