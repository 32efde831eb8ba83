"""Typed errors. Each maps to one gRPC status, and travels by name in the ``ifrt-error`` trailer.

The coordinator raises these; the client turns a failed call back into the same class, so a caller can
``except ifrt.ProcessIdTaken`` whether the check happened locally or on the coordinator.

Each class names its status (``status = "INVALID_ARGUMENT"``); ``cls.code`` is the matching
``grpc.StatusCode``, looked up on first use, so that plugins and other plain-value users can import these
errors without importing grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ifrt.progress import Progress

if TYPE_CHECKING:
    import grpc

ERROR_TRAILER = "ifrt-error"


class _StatusCode:
    """``error.code``: the ``grpc.StatusCode`` its class's ``status`` names (grpc is imported only here)."""

    def __get__(self, instance: object, owner: type[IfrtError]) -> grpc.StatusCode:
        import grpc

        return grpc.StatusCode[owner.status]


class IfrtError(Exception):
    """Base class of every error ifrt raises on purpose."""

    status: ClassVar[str] = "UNKNOWN"
    """The name of this error's one gRPC status code (a ``grpc.StatusCode`` member)."""
    code = _StatusCode()
    retryable: ClassVar[bool] = False


class InvalidArgument(IfrtError, ValueError):
    """A value is out of range or malformed; the message names the value and the expected range."""

    status = "INVALID_ARGUMENT"


class PluginError(InvalidArgument):
    """The device plugin is unknown, failed to load, or failed to list this process's devices; names it and why."""

    status = "INVALID_ARGUMENT"


class ProcessIdTaken(IfrtError):
    """Another process already holds this process id (or this stable key, with assigned ids)."""

    status = "ALREADY_EXISTS"


class ClusterMismatch(IfrtError):
    """The request does not fit this cluster: cluster id, process count, id mode, or the cluster is full."""

    status = "FAILED_PRECONDITION"


class UnknownClient(IfrtError):
    """The coordinator does not know this client (it restarted without a store); register again."""

    status = "NOT_FOUND"


class ProcessDeclaredFailed(IfrtError):
    """The coordinator declared this process failed (or replaced it by a restart); restart the process."""

    status = "FAILED_PRECONDITION"


class AttemptEnded(IfrtError):
    """The job attempt this call belongs to ended (the coordinator started the next one after a failure): the call's
    wait is over and its process is restarted by its agent (``ifrt run``) as part of the new attempt."""

    status = "ABORTED"


class StaleSession(IfrtError):
    """A session opened for a job run or attempt that is no longer the current one: its processes' registrations
    belong to the ended one. The session is opened again from the new run's or attempt's registration answer."""

    status = "FAILED_PRECONDITION"


class ResourceExhausted(InvalidArgument):
    """A coordinator-wide bound is reached (e.g. ``--max-agents`` job watches); the message names it and its flag."""

    status = "RESOURCE_EXHAUSTED"


class Overloaded(IfrtError):
    """A server refused the call for load: every slot it keeps for callers of this kind is taken (e.g. an ``ifrt run``
    agent's local server, ``docs/hosts.md``). Unlike ResourceExhausted (a bound the call's own content or its caller's
    budget passes), retrying may succeed: the slots free within a short bound, and the call is retried until its own
    deadline (never for a failover window: the server answered), then raises this, naming the refusal."""

    status = "RESOURCE_EXHAUSTED"
    retryable = True


class BarrierFailed(IfrtError):
    """A barrier participant failed or left before everyone arrived; the message names it and why."""

    status = "ABORTED"


class BarrierTimeout(BarrierFailed, TimeoutError):
    """A barrier participant's timeout passed; the message names the processes that did not arrive."""

    status = "DEADLINE_EXCEEDED"


class BarrierCancelled(BarrierFailed):
    """A participant cancelled the barrier (``cancel_barrier``): every current and future waiter gets this."""

    status = "CANCELLED"


class KeyExists(IfrtError):
    """The key already holds another value and overwriting was not asked for."""

    status = "ALREADY_EXISTS"


class KeyValueTimeout(IfrtError, TimeoutError):
    """``kv_get`` waited its whole timeout and the key was never set."""

    status = "DEADLINE_EXCEEDED"


class Unauthenticated(IfrtError):
    """The coordinator wants the cluster's token and the call had none or another; the message says which."""

    status = "UNAUTHENTICATED"


class PermissionDenied(IfrtError):
    """The call acts for a process it does not own (its process secret is missing or wrong)."""

    status = "PERMISSION_DENIED"


class HostHeld(PermissionDenied):
    """Another agent of the job acts for this host and watches the job now: a host has one agent, and a second one
    presenting its credential takes its place only once the first is gone (its watch ended, as a restarted agent's
    predecessor's does). The message names the host and the agent that holds it."""


class TransportMismatch(IfrtError):
    """One side speaks TLS and the other plaintext; the message says which side wants what."""

    status = "UNAVAILABLE"


class CertificateRejected(TransportMismatch):
    """This process's TLS refused the coordinator's certificate (another CA, or a name that is not the address
    dialled); the message names the problem and what to set."""


class TopologyError(IfrtError):
    """Topology bytes or a topology dict are corrupt or inconsistent (e.g. the fingerprint does not match)."""

    status = "DATA_LOSS"


class CoordinatorUnavailable(IfrtError):
    """The coordinator could not be reached or dropped the call; retrying may help."""

    status = "UNAVAILABLE"
    retryable = True


class AgentGone(IfrtError):
    """The ``ifrt run`` agent whose socket this worker was given (``IFRT_AGENT_SOCKET``) no longer answers: it exited
    or was killed, and with it this worker's link to the coordinator."""

    status = "UNAVAILABLE"


class DiscoveryTimeout(IfrtError, TimeoutError):
    """discover() ran out of time; the message names who is missing and how long it waited."""

    status = "DEADLINE_EXCEEDED"

    def __init__(self, message: str, progress: Progress | None = None) -> None:
        super().__init__(message)
        self.progress = progress
        """The coordinator's last progress answer (None if it was never reached)."""


class BackendAlreadyInitialized(IfrtError, RuntimeError):
    """The runtime's own distributed layer (JAX's backend or ``jax.distributed``, a default ``torch.distributed``
    process group) already exists in this process, so ifrt cannot start it from the topology."""

    status = "FAILED_PRECONDITION"


class PreflightFailed(IfrtError):
    """Some processes cannot reach the transfer endpoints of others; ``report`` (``ifrt.preflight``) names every
    such pair."""

    status = "FAILED_PRECONDITION"

    def __init__(self, message: str, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


class TransferError(IfrtError):
    """A transfer failed: a bad or truncated frame, a peer that went away, an unknown device."""

    status = "DATA_LOSS"


class OldIncarnation(TransferError):
    """A frame from an incarnation of its process that was replaced or declared failed: refused, its connection
    closed; the receives from that process are not failed (its current incarnation may be sending)."""


class TransferTimeout(TransferError, TimeoutError):
    """Nothing arrived from the named device within the timeout."""

    status = "DEADLINE_EXCEEDED"


EXIT_PEER_FAILED = 75
"""Exit code of a process that fail-fast ended because another process of the job failed or restarted, or the
coordinator declared this one failed (sysexits' EX_TEMPFAIL: this program has no bug, restart the job). A bug in
the program itself exits as Python does (1 for an uncaught exception)."""
EXIT_COORDINATOR_LOST = 69
"""Exit code of a process that fail-fast ended because the coordinator stayed out of reach beyond the failover
window (sysexits' EX_UNAVAILABLE)."""


class JobFailed(IfrtError):
    """The job cannot go on after its runtime started (``ifrt.failfast``): ``exit_code`` is what the process exits
    with, the message names who failed, where, why and in which topology generation."""

    status = "ABORTED"
    exit_code: ClassVar[int] = EXIT_PEER_FAILED

    def __init__(self, message: str, process_id: int | None = None, hostname: str = "", reason: str = "",
                 generation: int = 0) -> None:
        super().__init__(message)
        self.process_id, self.hostname, self.reason, self.generation = process_id, hostname, reason, generation


class PeerFailed(JobFailed):
    """A process of the job failed or restarted (or the coordinator declared this process failed)."""

    status = "ABORTED"
    exit_code = EXIT_PEER_FAILED


class CoordinatorGone(JobFailed):
    """The coordinator stayed out of reach longer than the failover window."""

    status = "UNAVAILABLE"
    exit_code = EXIT_COORDINATOR_LOST


class CollectiveFailed(IfrtError):
    """A collective of this process failed or was aborted because peers failed (``ifrt.torch`` with
    ``on_failure="recover"``): ``process_ids`` names them. Call ``ifrt.torch.recover()`` to re-form the groups once
    they are replaced (``ifrt run --recover replace``), then bring the newcomers up to date
    (``ifrt.torch.Healing`` does both)."""

    status = "ABORTED"

    def __init__(self, message: str, process_ids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.process_ids = process_ids


class StateLost(IfrtError):
    """A replacement's state cannot be healed from its peers (``ifrt.torch.Healing``): no survivor holds a copy of
    it, or the survivors hold different steps (the message names the process and its replica set), or the state a
    peer describes does not fit the replacement's own (the message names the peer, the tensor and both
    descriptions)."""

    status = "FAILED_PRECONDITION"


def _all_subclasses(cls: type[IfrtError]) -> list[type[IfrtError]]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_all_subclasses(sub))]


ERROR_CLASSES: dict[str, type[IfrtError]] = {cls.__name__: cls for cls in _all_subclasses(IfrtError)}
"""Every error class by name (how errors travel in the ``ifrt-error`` trailer and in the journal)."""
_BY_STATUS: dict[str, type[IfrtError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "RESOURCE_EXHAUSTED": InvalidArgument,  # gRPC's own refusal of a message past its size limit
    "ALREADY_EXISTS": ProcessIdTaken,
    "FAILED_PRECONDITION": ClusterMismatch,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
}
"""The class for a failed call that carries no ``ifrt-error`` trailer (refused by gRPC itself, or an old peer)."""
_RETRYABLE_STATUSES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})


def __getattr__(name: str) -> Any:
    """``_BY_CODE``: ``_BY_STATUS`` keyed by ``grpc.StatusCode``, built on first use (imports grpc)."""
    if name == "_BY_CODE":
        import grpc

        return {grpc.StatusCode[status]: cls for status, cls in _BY_STATUS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_rpc_error(error: grpc.RpcError, where: str) -> IfrtError:
    """The typed error for a failed call; ``where`` names the coordinator for the message."""
    status = error.code().name if hasattr(error, "code") else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else str(error)
    trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    cls = ERROR_CLASSES.get(trailers.get(ERROR_TRAILER, "")) or _BY_STATUS.get(status)
    if cls is None:
        cls = CoordinatorUnavailable if status in _RETRYABLE_STATUSES else IfrtError
    return cls(f"coordinator {where}: {details} ({status})")
