"""The agent's local server (``ifrt run --worker-link agent``): Coordinator.Register and Coordinator.Session for the
host's workers, on a Unix socket in a directory only the job's user may enter, named to each worker as
``IFRT_AGENT_SOCKET``. The workers' registrations go to the coordinator as one per host, their sessions ride on the
host's one session; every other call of a worker goes to the coordinator itself.

Who may call: whoever can reach the socket, which is the job's user (the directory is 0700, the socket 0600). A
worker proves who it is with its process secret as it would to the coordinator: its session must carry the secret
its registration did. What a caller can make the agent hold is bounded: requests of ``MAX_REQUEST_BYTES``, a few
pending registrations per worker (``host_rules.PENDING_PER_WORKER``), ``2 x workers + 4`` calls at once, the job
events kept for catch-up (``host_rules.EVENTS_KEPT``) and what one session leaves unread.
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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import (
    ERROR_TRAILER,
    IfrtError,
    InvalidArgument,
    PermissionDenied,
    UnknownClient,
)
from ifrt.protocol import SECRET_METADATA, proof_of
from ifrt.run.host_register import HostRegistrar, Refused
from ifrt.run.host_session import HostSession
from ifrt.run.worker_stream import Ended, WorkerStream

log = logging.getLogger("ifrt.run")

SERVICE = "ifrt.topology.v1.Coordinator"
SOCKET_NAME = "agent.sock"
MAX_SOCKET_PATH = 107
"""The longest path a Unix socket may have (the kernel's sun_path holds 108 bytes, its terminating NUL included)."""
MAX_REQUEST_BYTES = 4 << 20
"""The largest message a worker may send its agent (gRPC's own default)."""
DETACH_DELAY_S = 0.05
"""How long a worker's ended session waits before the agent detaches it: where the worker died, the agent's waitpid
reports the exit first, and the coordinator fails it at once, naming how it ended."""
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


class LocalServer:
    """Serves the host's workers on ``path`` until ``close()``, which removes the socket and its directory."""

    def __init__(self, registrar: HostRegistrar, host: HostSession, workers: int, heartbeat_timeout_s: float) -> None:
        self._registrar, self._host = registrar, host
        self.directory = tempfile.mkdtemp(prefix="ifrt-agent-")  # 0700, the job's user's
        self.path = os.path.join(self.directory, SOCKET_NAME)
        if (problem := socket_path_problem(self.path)) is not None:
            os.rmdir(self.directory)
            raise InvalidArgument(problem)
        threads = 2 * workers + 4
        self._server = grpc.server(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ifrt-run-local"),
                                   maximum_concurrent_rpcs=threads,
                                   options=[*keepalive_options(heartbeat_timeout_s),
                                            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                                            ("grpc.max_send_message_length", -1)])
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Register": grpc.unary_unary_rpc_method_handler(self._register),
            "Session": grpc.stream_stream_rpc_method_handler(self._session),
        }),))
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

    def _register(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        request = _parse(pb.RegisterRequest, raw, context)
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else 60.0)
        try:
            return self._registrar.register(request, _proof(context), deadline)
        except Refused as e:
            _abort(context, e.error, e.code)

    def _session(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        first = next(requests, None)
        if first is None:
            return
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
        reader = threading.Thread(target=self._read, args=(requests, stream), name="ifrt-run-local-read",
                                  daemon=True)
        reader.start()
        try:
            yield from stream.items()
        except Ended as e:
            assert e.error is not None
            _abort(context, e.error, e.code)
        finally:  # a worker that died is reported by its agent's waitpid: that report goes first
            detach = threading.Timer(DETACH_DELAY_S, self._host.detach, (stream,))
            detach.daemon = True
            detach.start()

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
