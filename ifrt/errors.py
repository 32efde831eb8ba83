"""Typed errors. Each maps to one gRPC status, and travels by name in the ``ifrt-error`` trailer.

The coordinator raises these; the client turns a failed call back into the same class, so a caller can
``except ifrt.ProcessIdTaken`` whether the check happened locally or on the coordinator.
"""

from __future__ import annotations

from typing import ClassVar

import grpc

from ifrt.progress import Progress

ERROR_TRAILER = "ifrt-error"


class IfrtError(Exception):
    """Base class of every error ifrt raises on purpose."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    retryable: ClassVar[bool] = False


class InvalidArgument(IfrtError, ValueError):
    """A value is out of range or malformed; the message names the value and the expected range."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ProcessIdTaken(IfrtError):
    """Another process already holds this process id (or this stable key, with assigned ids)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ClusterMismatch(IfrtError):
    """The request does not fit this cluster: cluster id, process count, id mode, or the cluster is full."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class UnknownClient(IfrtError):
    """The coordinator does not know this client (it restarted without a store); register again."""

    code = grpc.StatusCode.NOT_FOUND


class ProcessDeclaredFailed(IfrtError):
    """The coordinator declared this process failed (or replaced it by a restart); restart the process."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BarrierFailed(IfrtError):
    """A barrier participant failed or left before everyone arrived; the message names it and why."""

    code = grpc.StatusCode.ABORTED


class BarrierTimeout(BarrierFailed, TimeoutError):
    """A barrier participant's timeout passed; the message names the processes that did not arrive."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class KeyExists(IfrtError):
    """The key already holds another value and overwriting was not asked for."""

    code = grpc.StatusCode.ALREADY_EXISTS


class KeyValueTimeout(IfrtError, TimeoutError):
    """``kv_get`` waited its whole timeout and the key was never set."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TopologyError(IfrtError):
    """Topology bytes or a topology dict are corrupt or inconsistent (e.g. the fingerprint does not match)."""

    code = grpc.StatusCode.DATA_LOSS


class CoordinatorUnavailable(IfrtError):
    """The coordinator could not be reached or dropped the call; retrying may help."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DiscoveryTimeout(IfrtError, TimeoutError):
    """discover() ran out of time; the message names who is missing and how long it waited."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED

    def __init__(self, message: str, progress: Progress | None = None) -> None:
        super().__init__(message)
        self.progress = progress
        """The coordinator's last progress answer (None if it was never reached)."""


def _all_subclasses(cls: type[IfrtError]) -> list[type[IfrtError]]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_all_subclasses(sub))]


ERROR_CLASSES: dict[str, type[IfrtError]] = {cls.__name__: cls for cls in _all_subclasses(IfrtError)}
"""Every error class by name (how errors travel in the ``ifrt-error`` trailer and in the journal)."""
_BY_CODE: dict[grpc.StatusCode, type[IfrtError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: ProcessIdTaken,
    grpc.StatusCode.FAILED_PRECONDITION: ClusterMismatch,
}

_RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def from_rpc_error(error: grpc.RpcError, where: str) -> IfrtError:
    """The typed error for a failed call; ``where`` names the coordinator for the message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    cls = ERROR_CLASSES.get(trailers.get(ERROR_TRAILER, "")) or _BY_CODE.get(code)
    if cls is None:
        cls = CoordinatorUnavailable if code in _RETRYABLE_CODES else IfrtError
    return cls(f"coordinator {where}: {details} ({code.name})")

