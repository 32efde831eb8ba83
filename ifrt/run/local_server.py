"""The agent's local server (``ifrt run --worker-link agent``): Coordinator.Register and Coordinator.Session for the
host's workers, on a Unix socket in a directory only the job's user may enter, named to each worker as
``IFRT_AGENT_SOCKET``. The workers' registrations go to the coordinator as one per host, their sessions ride on the
host's one session, and their other calls (key-values, barriers, ...) are forwarded on the agent's own connection
(``ifrt.run.forward``): the host holds one connection to the coordinator.

Who may call: whoever can reach the socket, which is the job's user (the directory is 0700, the socket 0600). A
worker proves who it is with its process secret as it would to the coordinator: its session must carry the secret
its registration did. What a caller can make the agent hold is bounded: requests of ``MAX_REQUEST_BYTES``, a few
pending registrations per worker (``host_rules.PENDING_PER_WORKER``), the job events kept for catch-up
(``host_rules.EVENTS_KEPT``), what one session leaves unread, and calls (``Slots``): each registered worker's calls
and each local rank's registrations have slots of their own, a worker's forwarded calls that wait (``WAITING``) apart
from those that do not, so that a set never queues behind gets that wait, so a caller that proves nothing (no registered
worker's secret) cannot keep a worker out; it holds at most ``UNPROVEN_CALLS`` calls at once, each for at most
``FIRST_MESSAGE_S`` if it sends nothing, and ``STRANGER_CALLS`` forwarded calls. A refusal for load is ``Overloaded``,
which the worker retries.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt.agent_link import HEARTBEAT_TIMEOUT_METADATA
from ifrt.connection import Connection
from ifrt.errors import (
    ERROR_TRAILER,
    CoordinatorUnavailable,
    IfrtError,
    InvalidArgument,
    Overloaded,
    PermissionDenied,
    UnknownClient,
)
from ifrt.hostport import MAX_SOCKET_PATH
from ifrt.protocol import SECRET_METADATA, proof_of
from ifrt.run.forward import FORWARDED, SERVICE, Forwarder, Refusal
from ifrt.run.host_register import HostRegistrar, Refused
from ifrt.run.host_rules import PENDING_PER_WORKER
from ifrt.run.host_session import HostSession
from ifrt.run.worker_stream import Ended, WorkerStream

log = logging.getLogger("ifrt.run")

SOCKET_NAME = "agent.sock"
MAX_REQUEST_BYTES = 16 << 20
"""The largest message a worker may send its agent: the coordinator's default ``--max-request-bytes``, so that a
forwarded call (a key-value multi-set) passes whole as far as the coordinator takes it."""
DETACH_DELAY_S = 0.05
"""How long a worker's ended session waits before the agent detaches it: where the worker died, the agent's waitpid
reports the exit first, and the coordinator fails it at once, naming how it ended."""
FIRST_MESSAGE_S = 2.0
"""How long a call may take to send its first message (a Register's request, a Session's SessionOpen): a worker
sends it with the call; a call that sends nothing is ended then, and its slot freed."""
BUSY_GRACE_S = 0.25
"""How long a call that no registered worker's secret proves may take to send its first message without holding one
of the ``UNPROVEN_CALLS``: a worker's first Register brings its request along, a silent caller has to wait for it."""
UNPROVEN_CALLS = 4
"""Calls at once, past ``BUSY_GRACE_S``, that wait for their first message without a registered worker's secret."""
PROVEN_CALLS = 4
"""Calls at once of each registered worker (its session, a registration again, a session that reconnects)."""
FORWARDED_CALLS = 16
"""Forwarded calls at once of each registered worker that do not wait (a set, a read, an increment), beside its
``PROVEN_CALLS`` and ``WAITING_CALLS``."""
WAITING_CALLS = 16
"""Forwarded calls at once of each registered worker that wait (``WAITING``: a get that waits for a key, a barrier),
each holding its slot while it waits; a start-up's few concurrent waits stay well inside. Apart from
``FORWARDED_CALLS``: waits that hold all of theirs never keep out the worker's calls that do not wait."""
WAITING = frozenset({"Barrier", "KeyValueGet", "LiveProcesses", "PreemptionSync"})
"""The forwarded methods that wait on the coordinator (for a key, for the other processes)."""
STRANGER_CALLS = 4
"""Forwarded calls at once, all together, that no registered worker's secret proves (a process that did not register
through this agent: the coordinator decides what it may do, as for a direct call)."""
SPARE_THREADS = 4
"""Threads beyond the slots: for calls during their ``BUSY_GRACE_S`` and refusals."""
UNPROVEN, STRANGER = ("unproven",), ("stranger",)
_LIMITS = {"worker": PROVEN_CALLS, "calls": FORWARDED_CALLS, "waits": WAITING_CALLS, "rank": PENDING_PER_WORKER,
           "unproven": UNPROVEN_CALLS, "stranger": STRANGER_CALLS}
_HEARTBEAT = pb.SessionRequest(heartbeat=pb.Heartbeat()).SerializeToString()


def socket_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be a Unix socket, or None."""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        return (f"the agent's socket path {path!r} is {size} bytes long: the kernel takes at most {MAX_SOCKET_PATH} "
                "(point TMPDIR at a shorter directory, e.g. TMPDIR=/tmp)")
    return None


def keepalive_options(heartbeat_timeout_s: float) -> list[tuple[str, int]]:
    """Pings every worker's connection twice per heartbeat timeout, as the coordinator does its clients': a stopped
    worker's session drops, and its agent detaches it."""
    interval_ms = max(100, round(heartbeat_timeout_s * 500))
    timeout_ms = max(100, round(heartbeat_timeout_s * 375))
    return [("grpc.keepalive_time_ms", interval_ms), ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 100),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 100)]


class Slots:
    """The calls the local server holds, by whose they are: ``("worker", proof)`` a registered worker's (at most
    ``PROVEN_CALLS``), ``("calls", proof)`` its forwarded ones that do not wait (``FORWARDED_CALLS``) and
    ``("waits", proof)`` those that do (``WAITING_CALLS``), ``("rank", r)`` the
    registrations of local rank ``r`` (``PENDING_PER_WORKER``; -1 for a rank the agent does not run), ``UNPROVEN`` the
    calls waiting for a first message that prove nothing (``UNPROVEN_CALLS``), ``STRANGER`` the forwarded calls that
    prove nothing (``STRANGER_CALLS``)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.held: Counter[tuple] = Counter()
        self._lock = threading.Lock()

    @staticmethod
    def threads(workers: int) -> int:
        """Threads for every slot of ``workers`` workers at once, and the spare ones: no call that has a slot waits."""
        return (workers * (PROVEN_CALLS + FORWARDED_CALLS + WAITING_CALLS + PENDING_PER_WORKER) + PENDING_PER_WORKER
                + UNPROVEN_CALLS
                + STRANGER_CALLS + SPARE_THREADS)

    def rank(self, local_rank: int) -> tuple[str, int]:
        """The key of local rank ``local_rank``'s registrations."""
        return ("rank", local_rank if 0 <= local_rank < self.workers else -1)

    def take(self, key: tuple) -> bool:
        """Holds a slot of ``key``; False, holding nothing, when all its slots are held."""
        with self._lock:
            if self.held[key] >= _LIMITS[key[0]]:
                return False
            self.held[key] += 1
            return True

    def give(self, key: tuple) -> None:
        with self._lock:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]


class _Requests:
    """A call's request stream, read in a thread of its own: its first message awaited with a bound (a caller that
    sends nothing cannot hold a handler past it), the rest handed to ``then`` or left unread (``release``)."""

    def __init__(self, requests: Iterator[bytes]) -> None:
        self._requests = requests
        self.first: bytes | None = None
        self._got, self._go = threading.Event(), threading.Event()
        self._rest: Callable[[Iterator[bytes]], None] | None = None
        threading.Thread(target=self._run, name="ifrt-run-local-read", daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # the call ended before it sent anything
            self.first = next(self._requests, None)
        self._got.set()
        self._go.wait()
        if self._rest is not None:
            self._rest(self._requests)

    def wait(self, seconds: float) -> bool:
        """Whether the first message came (or the stream ended) within ``seconds``."""
        return self._got.wait(max(0.0, seconds))

    def then(self, rest: Callable[[Iterator[bytes]], None]) -> None:
        self._rest = rest
        self._go.set()

    def release(self) -> None:
        self._go.set()


class _Held:
    """The slots one call holds, each given back once: when its handler ends or the call does, whichever comes first
    (a session's handler may be finished with only when the garbage collector gets to it)."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self._keys: list[tuple] = []
        self._lock = threading.Lock()

    def take(self, context: grpc.ServicerContext, key: tuple, why: str) -> None:
        """Holds a slot of ``key``, or ends the call: Overloaded saying ``why``."""
        if not self._slots.take(key):
            _abort(context, Overloaded(f"{why}: this host's agent refused the call for load; retry shortly"))
        with self._lock:
            self._keys.append(key)

    def give(self, key: tuple) -> None:
        """Gives back the slot of ``key`` it holds, if it holds one."""
        with self._lock:
            if key not in self._keys:
                return
            self._keys.remove(key)
        self._slots.give(key)

    def give_all(self) -> None:
        with self._lock:
            keys, self._keys = self._keys, []
        for key in keys:
            self._slots.give(key)


class LocalServer:
    """Serves the host's workers on ``path`` until ``close()``, which removes the socket and its directory; their
    other calls are forwarded on ``coordinator``, the agent's connection (None: not served, UNIMPLEMENTED)."""

    def __init__(self, registrar: HostRegistrar, host: HostSession, workers: int, heartbeat_timeout_s: float,
                 coordinator: Connection | None = None) -> None:
        self._registrar, self._host = registrar, host
        self._forwarder = None if coordinator is None else Forwarder(coordinator)
        self._heartbeat_ms = str(round(heartbeat_timeout_s * 1000))
        self.slots = Slots(workers)
        """Whose calls the server holds now."""
        self.directory = tempfile.mkdtemp(prefix="ifrt-agent-")  # 0700, the job's user's
        self.path = os.path.join(self.directory, SOCKET_NAME)
        if (problem := socket_path_problem(self.path)) is not None:
            os.rmdir(self.directory)
            raise InvalidArgument(problem)
        threads = Slots.threads(workers)  # gRPC's own refusal past them reaches a worker as Overloaded too
        self._server = grpc.server(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ifrt-run-local"),
                                   maximum_concurrent_rpcs=threads,
                                   options=[*keepalive_options(heartbeat_timeout_s),
                                            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                                            ("grpc.max_send_message_length", -1)])
        methods = {
            "Register": grpc.stream_unary_rpc_method_handler(self._register),  # one message: read with a bound
            "Session": grpc.stream_stream_rpc_method_handler(self._session),
        }
        if self._forwarder is not None:  # unary calls, read as Register is
            methods.update({name: grpc.stream_unary_rpc_method_handler(self._forward(name)) for name in FORWARDED})
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
        mask = os.umask(0o177)  # the socket is created 0600
        try:
            if not self._server.add_insecure_port(f"unix:{self.path}"):
                raise InvalidArgument(f"cannot listen on the agent's socket {self.path}")
            self._server.start()
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        finally:
            os.umask(mask)
        os.chmod(self.path, 0o600)

    def close(self) -> None:
        self._server.stop(0.5).wait(2.0)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _register(self, raw: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        requests = _Requests(raw)
        try:
            with self._opened(requests, context) as (first, proven):
                if first is None:
                    _abort(context, InvalidArgument("the call carried no RegisterRequest"))
                request = _parse(pb.RegisterRequest, first, context)
                key = None if proven else self.slots.rank(request.local_rank)  # a worker's slot holds it already
                if key is not None and not self.slots.take(key):
                    _abort(context, Overloaded(f"local rank {request.local_rank} has {PENDING_PER_WORKER} "
                                               "registrations pending with this host's agent already: retry shortly"))
                try:
                    remaining = context.time_remaining()
                    deadline = time.monotonic() + (remaining if remaining is not None else 60.0)
                    answer = self._registrar.register(request, _proof(context), deadline)
                except Refused as e:
                    _abort(context, e.error, e.code)
                finally:
                    if key is not None:
                        self.slots.give(key)
                context.set_trailing_metadata(((HEARTBEAT_TIMEOUT_METADATA, self._heartbeat_ms),))  # its keepalive
                return answer
        finally:
            requests.release()

    def _forward(self, method: str) -> Callable[[Iterator[bytes], grpc.ServicerContext], bytes]:
        """The handler of ``method``: the worker's call forwarded to the coordinator, its answer or refusal as given."""
        def forward(raw: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            assert self._forwarder is not None
            requests = _Requests(raw)
            try:
                with self._opened(requests, context, forwarded=method) as (first, _):
                    if first is None:
                        _abort(context, InvalidArgument(f"the call carried no {method} request"))
                    try:
                        answer, trailers = self._forwarder.forward(method, first, context)
                    except Refusal as r:
                        context.set_trailing_metadata(r.trailers)
                        context.abort(r.code, r.details)
                    context.set_trailing_metadata(trailers)
                    return answer
            finally:
                requests.release()
        return forward

    def _session(self, raw: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        requests = _Requests(raw)
        try:
            with self._opened(requests, context) as (first, _):
                if first is None:
                    return
                yield from self._serve(first, requests, context)
        finally:
            requests.release()

    def _serve(self, first: bytes, requests: _Requests, context: grpc.ServicerContext) -> Iterator[bytes]:
        """A worker's session from its opening message on: checked, attached to the host's, served until it ends."""
        opening = _parse(pb.SessionRequest, first, context)
        if opening.WhichOneof("kind") != "open":
            _abort(context, InvalidArgument("the first session message must be SessionOpen"))
        uid = opening.open.client_uid
        registered = self._registrar.registered.get(uid)
        if registered is None:
            _abort(context, UnknownClient(f"this host's agent holds no registration of client {uid!r}: register "
                                          "again"))
        proof = _proof(context)
        if not hmac.compare_digest(proof, registered.proof):
            _abort(context, PermissionDenied(f"client {uid!r} is another process's: this call's process secret is "
                                             "not the one its registration carried"))
        stream = WorkerStream(uid, proof, opening.open.since_event)
        context.add_callback(lambda: stream.end(Ended(None)))  # the connection dropped: the writer stops waiting
        self._host.attach(stream)
        requests.then(lambda rest: self._read(rest, stream))
        try:
            yield from stream.items()
        except Ended as e:
            assert e.error is not None
            _abort(context, e.error, e.code)
        finally:  # a worker that died is reported by its agent's waitpid: that report goes first
            detach = threading.Timer(DETACH_DELAY_S, self._host.detach, (stream,))
            detach.daemon = True
            detach.start()

    @contextlib.contextmanager
    def _opened(self, requests: _Requests, context: grpc.ServicerContext,
                forwarded: str | None = None) -> Iterator[tuple[bytes | None, bool]]:
        """The call's first message (None: its stream ended without one) and whether a registered worker's secret
        proves the call, while the call holds its slot (a call of ``forwarded``, a method forwarded to the
        coordinator, one of its worker's forwarded calls that wait or of those that do not, or of the strangers'). A
        call that sends nothing within FIRST_MESSAGE_S is ended; one that finds its slots held is refused for load
        (Overloaded), the caller retries."""
        began = time.monotonic()
        proof = _proof(context)
        proven = any(hmac.compare_digest(proof, r.proof) for r in list(self._registrar.registered.values()))
        held = _Held(self.slots)
        context.add_callback(held.give_all)  # the call ended: at once, whenever its handler is done with it
        try:
            if proven and forwarded in WAITING:
                held.take(context, ("waits", proof), f"{forwarded}: this worker has {WAITING_CALLS} calls that wait "
                                                     "(gets of a key, barriers) forwarded by its agent open already")
            elif proven and forwarded:
                held.take(context, ("calls", proof), f"{forwarded}: this worker has {FORWARDED_CALLS} calls that do "
                                                     "not wait forwarded by its agent open already")
            elif proven:
                held.take(context, ("worker", proof), f"this worker has {PROVEN_CALLS} calls open with its agent "
                                                      "already")
            elif not requests.wait(BUSY_GRACE_S):  # a worker's first call brings its message along
                held.take(context, UNPROVEN, f"{UNPROVEN_CALLS} calls that no registered worker's secret proves wait "
                                             "for their first message already")
            if not requests.wait(began + FIRST_MESSAGE_S - time.monotonic()):
                _abort(context, CoordinatorUnavailable(f"this host's agent ended the call: no first message within "
                                                       f"{FIRST_MESSAGE_S:g}s (a worker sends its request with the "
                                                       "call)"))
            held.give(UNPROVEN)  # it showed its message: it waits no more
            if forwarded and not proven:
                held.take(context, STRANGER, f"{STRANGER_CALLS} forwarded calls that no registered worker's secret "
                                             "proves are open already")
            yield requests.first, proven
        finally:
            held.give_all()

    def _read(self, requests: Iterator[bytes], stream: WorkerStream) -> None:
        """A worker's Heartbeats and key watches, until its request stream ends."""
        with contextlib.suppress(grpc.RpcError, ValueError):
            for raw in requests:
                if raw == _HEARTBEAT:
                    self._host.heard(stream.uid)
                    continue
                with contextlib.suppress(Exception):
                    message = pb.SessionRequest.FromString(raw)
                    if message.WhichOneof("kind") == "watch":
                        self._host.watch(stream, message.watch.prefix)
                    elif message.WhichOneof("kind") == "heartbeat":
                        self._host.heard(stream.uid)
        stream.end(Ended(None))


def _proof(context: grpc.ServicerContext) -> str:
    secret = next((v for k, v in context.invocation_metadata() or () if k == SECRET_METADATA), "")
    return proof_of(secret if isinstance(secret, str) else secret.decode(errors="replace"))


def _parse(cls, raw: bytes, context: grpc.ServicerContext):
    try:
        return cls.FromString(raw)
    except Exception as e:
        _abort(context, InvalidArgument(f"request is not a valid {cls.DESCRIPTOR.full_name}: {e}"))


def _abort(context: grpc.ServicerContext, error: IfrtError, code: grpc.StatusCode | None = None):
    """Ends the call with ``error`` as the coordinator would: its status, message and class in the trailer."""
    context.set_trailing_metadata(((ERROR_TRAILER, type(error).__name__),))
    context.abort(code or error.code, str(error))
