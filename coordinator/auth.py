"""Who may call the coordinator: the cluster token checked in front of every Coordinator RPC, and TLS credentials.

The health service stays open (probes carry no token); everything else without the token is refused with
UNAUTHENTICATED before any handler runs and before its request is read, so nothing changes and a refused caller
costs no more than its headers. Refusals are logged rate-limited, naming only methods that exist. A call that
carries the token tells the coordinator's door (``coordinator.door``) that its connection is the job's.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable

import grpc

from coordinator.noise import noisy
from ifrt.errors import ERROR_TRAILER, Unauthenticated
from ifrt.protocol import TOKEN_METADATA


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses calls to ``service`` whose ``ifrt-token`` metadata is missing or differs (constant-time compare);
    with ``trust``, a call that carries the token first hands its peer to it (the interceptor has no peer)."""

    def __init__(self, token: str, service: str, trust: Callable[[str], None] | None = None) -> None:
        self._token = token.encode()
        self._prefix = f"/{service}/"
        self._trust = trust
        self._marking: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        """id of a method's handler -> (it, it marking its peer first): one wrapper a method, not one a call."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails):
        if not details.method.startswith(self._prefix):
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == TOKEN_METADATA), None)
        if given is not None and hmac.compare_digest(given.encode() if isinstance(given, str) else given,
                                                     self._token):
            handler = await continuation(details)
            if self._trust is None or handler is None:
                return handler
            known = self._marking.get(id(handler))
            if known is None:
                known = (handler, _marking(handler, self._trust))
                if len(self._marking) < MARKED_METHODS:  # kept with its handler, so the id stays its own
                    self._marking[id(handler)] = known
            return known[1]
        if await continuation(details) is None:
            return None  # no such method: gRPC answers UNIMPLEMENTED, and the caller's text goes nowhere
        why = "carries no token" if given is None else "carries a wrong token"
        return _refusal(details.method.rpartition("/")[2], why)


MARKED_METHODS = 256
"""Handlers whose marking wrapper is kept (the methods served: a few dozen)."""


def _marking(handler: grpc.RpcMethodHandler, trust: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """``handler`` with ``trust(context.peer())`` run as each call starts."""
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            break
    else:
        return handler
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler  # served in a thread: none of the coordinator's methods
    if inspect.isasyncgenfunction(behavior):
        async def marked_stream(request, context: grpc.aio.ServicerContext):
            trust(context.peer())
            async for response in behavior(request, context):
                yield response
        return handler._replace(**{kind: marked_stream})

    async def marked(request, context: grpc.aio.ServicerContext):
        trust(context.peer())
        return await behavior(request, context)
    return handler._replace(**{kind: marked})


def _refusal(method: str, why: str) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED at once: stream-shaped whatever the method, so the request is never
    read (a refused caller cannot make the coordinator receive a large message)."""
    message = (f"this coordinator requires the cluster's token and the call {why}: set IFRT_TOKEN_FILE (or "
               "IFRT_TOKEN) to the file the coordinator's --token-file names")

    async def refuse(requests, context: grpc.aio.ServicerContext) -> None:
        noisy.warning(f"token:{method}:{why}", "refused %s from %s: the call %s", method, context.peer(), why)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message,
                            trailing_metadata=((ERROR_TRAILER, Unauthenticated.__name__),))

    return grpc.stream_stream_rpc_method_handler(refuse)


def server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS with this certificate and key; with ``client_ca``, every client must present a certificate it signed."""
    def read(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_server_credentials([(read(key), read(cert))],
                                       root_certificates=read(client_ca) if client_ca else None,
                                       require_client_auth=client_ca is not None)
