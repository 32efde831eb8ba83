"""What every gRPC handler of the coordinator shares: parsing a request, the caller's proof and address, and turning
a typed error (or an unexpected exception) into the call's status."""

from __future__ import annotations

import asyncio
import logging
from functools import wraps
from typing import NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from grpc._cython import cygrpc

from coordinator.noise import noisy
from ifrt.errors import ERROR_TRAILER, IfrtError, InvalidArgument
from ifrt.hostport import split_host_port
from ifrt.protocol import SECRET_METADATA, proof_of

log = logging.getLogger("ifrt.coordinator")

MAX_MESSAGE_BYTES = 2048
"""Longest status message sent (and logged): the facts an operator needs fit; a caller's long input does not (and
clients refuse status metadata past 8 KiB, which would lose the typed error)."""
_CALL_GONE = getattr(cygrpc, "ExecuteBatchError", ())
"""What grpc.aio raises when a write meets a call its caller has cancelled or whose connection is gone."""

M = TypeVar("M", bound=Message)


def peer_host(peer: str) -> str:
    """The IP of a gRPC peer string: ``ipv4:10.0.0.2:5000`` -> ``10.0.0.2``, ``ipv6:[::1]:5000`` -> ``::1``."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return split_host_port(rest)[0]
    return rest or peer


def caller_proof(context: grpc.aio.ServicerContext) -> str:
    """The hash of the process secret the call carries ("" without one): what the state machine compares."""
    return proof_of(metadata_value(context, SECRET_METADATA) or "")


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str | None:
    """The call's metadata ``key`` as text (None: not sent)."""
    value = next((v for k, v in context.invocation_metadata() or () if k == key), None)
    return value if value is None or isinstance(value, str) else value.decode(errors="replace")


async def parse(cls: type[M], raw: bytes, context: grpc.aio.ServicerContext) -> M:
    """The request ``raw`` encodes; INVALID_ARGUMENT if it does not parse."""
    try:
        return cls.FromString(raw)
    except DecodeError as e:
        await abort(context, InvalidArgument(f"request is not a valid {cls.DESCRIPTOR.full_name}: {e}"), "request")


async def abort(context: grpc.aio.ServicerContext, error: IfrtError, what: str,
                level: int = logging.WARNING) -> NoReturn:
    """Ends the call with ``error``'s status, its message (capped) and its class in the trailer; logs the refusal."""
    message = capped(str(error), MAX_MESSAGE_BYTES)
    if level >= logging.WARNING:  # a caller's doing: rate-limited per kind of error
        noisy.log(level, f"rejected:{type(error).__name__}", "rejected %s: %s", capped(what, MAX_MESSAGE_BYTES // 8),
                  message)
    else:
        log.log(level, "rejected %s: %s", capped(what, MAX_MESSAGE_BYTES // 8), message)
    await context.abort(error.code, message, trailing_metadata=((ERROR_TRAILER, type(error).__name__),))
    raise AssertionError("context.abort returned")


def internal_errors(handler, name: str = ""):
    """Turns an unexpected exception into INTERNAL (logged with its traceback) instead of gRPC's bare UNKNOWN."""
    name = name or handler.__name__

    @wraps(handler)
    async def guarded(request, context: grpc.aio.ServicerContext):
        try:
            return await handler(request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as e:
            if isinstance(e, _CALL_GONE) or context.cancelled():  # the caller went away mid-write: nothing to tell
                log.debug("%s from %s ended by its caller: %s: %s", name, context.peer(), type(e).__name__, e)
                return None
            log.exception("internal error in %s from %s", name, context.peer())
            await context.abort(grpc.StatusCode.INTERNAL, capped(
                f"internal coordinator error in {name}: {type(e).__name__}: {e}", MAX_MESSAGE_BYTES))
    return guarded


def capped(text: str, most_bytes: int) -> str:
    """``text`` cut to ``most_bytes`` of UTF-8: status messages travel as metadata, which clients refuse past
    8 KiB (the caller would lose the typed error), and a log line should not carry a whole request."""
    raw = text.encode()
    if len(raw) <= most_bytes:
        return text
    return raw[:most_bytes].decode(errors="ignore") + " ... (cut)"
