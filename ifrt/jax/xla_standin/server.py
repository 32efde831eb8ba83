"""The stand-in's gRPC server: every layout's service on one Unix socket in a private directory of this process.

Only this process's user can reach the socket (its directory is 0700), so nobody else on the host can call the
stand-in, which holds the job's token through ifrt's client; it serves this process's JAX client alone (a request for
another task is refused). It lives as long as the process, or until ``close``.

A caller of the same user can still open calls on it, so what calls can hold is bounded by kind (``LIMITS``): each kind
of wait (key gets, task watches, barriers, error polls) and the quick calls have a number of calls at once, and one
past it is refused at once with RESOURCE_EXHAUSTED naming the limit; heartbeats are answered at once and never wait
for a thread, which the server keeps beyond every kind's limit (``SPARE_THREADS``). A wait ends when its call does
(the caller cancels, or its deadline passes), freeing its thread and slot.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from ifrt._generated import tensorflow_coordination_pb2 as tf_pb
from ifrt.hostport import MAX_SOCKET_PATH
from ifrt.jax.xla_standin.layouts import LAYOUTS, PAYLOAD_KEY, Handler, Layout
from ifrt.jax.xla_standin.service import NO_DEADLINE_S, CoordinationError, CoordinationStandIn

log = logging.getLogger("ifrt.jax.xla_standin")

LIMITS = {"get": 64, "barrier": 32, "watch": 16, "poll": 4, "quick": 32}
"""Calls of each kind the stand-in serves at once; one more is refused at once (RESOURCE_EXHAUSTED naming the limit).
JAX's own client holds a few of each at most: one error poll, its preemption-notice get, a start-up's or a program's
few barriers and gets from a handful of threads; the rest is room. Heartbeats have no limit: each is answered at once
without a coordinator call."""
KINDS = {"GetKeyValue": "get", "WatchTasks": "watch", "WatchJobState": "watch", "PollForError": "poll",
         "RegisterTask": "barrier", "WaitForAllTasks": "barrier", "ShutdownTask": "barrier", "Barrier": "barrier",
         "GetAliveTasks": "barrier", "Heartbeat": "heartbeat"}
"""Each method's kind (``LIMITS``); every other method is a quick call (one coordinator call, no wait)."""
KIND_NAMES = {"get": "key-value gets that wait", "barrier": "barrier, registration and live-task waits",
              "watch": "task-state watches", "poll": "error polls", "quick": "quick calls (no wait)"}
SPARE_THREADS = 8
"""Threads beyond every kind's limit: heartbeats and refusals always find one, whatever the waits hold."""
WORKERS = sum(LIMITS.values()) + SPARE_THREADS
"""Threads answering calls at most: every kind's calls at once, and the spare ones."""
DETAILS_TRAILER = "grpc-status-details-bin"
"""Where XLA's client reads an error's payloads."""


class StandInServer:
    """Serves ``standin`` to this process's JAX client at ``address`` (``unix:<path>``), in a directory of its own
    under ``within`` (the ``ifrt run`` agent's private directory, which the agent removes even after a SIGKILLed
    worker; else the system's temporary directory, where the next stand-in removes it if its process was killed)."""

    def __init__(self, standin: CoordinationStandIn, within: str | None = None) -> None:
        self.standin = standin
        self._directory = _own_directory(within or tempfile.gettempdir())  # 0700: this user's only
        self.path = os.path.join(self._directory, "coordination.sock")
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:  # a deep TMPDIR (a batch system's scratch, say)
            os.rmdir(self._directory)
            self._directory = _own_directory("/tmp")
            log.info("JAX's coordination socket would be %d bytes under %s, past the kernel's %d: it is under /tmp",
                     len(os.fsencode(self.path)), within or tempfile.gettempdir(), MAX_SOCKET_PATH)
            self.path = os.path.join(self._directory, "coordination.sock")
        self.address = f"unix:{self.path}"
        self.slots = Slots()
        """The calls of each kind being served now."""
        self._executor = DaemonExecutor(WORKERS)
        self._server = grpc.server(self._executor, options=[("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers(tuple(_service(layout, standin, self.slots) for layout in LAYOUTS))
        self._server.add_insecure_port(self.address)
        self._server.start()
        log.info("JAX's coordination service for process %d: ifrt's stand-in at %s (service incarnation %#x)",
                 standin.task, self.address, standin.incarnation)

    def close(self) -> None:
        """Stops serving (JAX's client must be shut down first: a dropped error poll terminates its process)."""
        self._server.stop(grace=None)
        self.remove_socket()

    def threads(self) -> int:
        """The threads answering calls, busy or idle (at most ``WORKERS``)."""
        return self._executor.started

    def remove_socket(self) -> None:
        """Removes the socket and its directory, where the process ends past ``close`` (fail fast's exit)."""
        shutil.rmtree(self._directory, ignore_errors=True)


OWN_DIRECTORY = re.compile(r"^ifrt-xla-p(\d+)-")
"""The name of a stand-in's directory: the pid of the process that made it, first."""


def _own_directory(parent: str) -> str:
    """A directory of this process's own in ``parent``, named by its pid. Those of this user's processes that are gone
    are removed first: nobody else removes the directory of a process SIGKILLed outside ``ifrt run`` (whose agent
    removes its private directory)."""
    for name in os.listdir(parent):
        if (found := OWN_DIRECTORY.match(name)) is None:
            continue
        path = os.path.join(parent, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.kill(int(found.group(1)), 0)
        except ProcessLookupError:  # its process is gone
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # the directory gone meanwhile, or the pid another user's
            pass
    return tempfile.mkdtemp(prefix=f"ifrt-xla-p{os.getpid()}-", dir=parent)


class DaemonExecutor:
    """The server's threads, as daemon threads that the interpreter's exit neither stops nor waits for: JAX's client
    shuts down in an exit hook, and its calls must be answered until then (``concurrent.futures``' pools refuse new
    work before any exit hook runs, and wait for the calls still open, JAX's error poll among them, forever)."""

    def __init__(self, workers: int) -> None:
        self._workers, self._started, self._idle = workers, 0, 0
        self._queue: queue.SimpleQueue[tuple[futures.Future, Callable[..., Any], tuple, dict]] = queue.SimpleQueue()
        self._lock = threading.Lock()

    @property
    def started(self) -> int:
        """Threads started so far (each stays, idle or busy, for the process's life)."""
        return self._started

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> futures.Future:
        future: futures.Future = futures.Future()
        self._queue.put((future, fn, args, kwargs))
        with self._lock:  # each call has a thread of its own: an idle one it takes, or a new one
            if self._idle > 0:
                self._idle -= 1
            elif self._started < self._workers:
                self._started += 1
                threading.Thread(target=self._work, name=f"ifrt-xla-{self._started}", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to stop: idle threads wait for work that no longer comes, and end with the process."""

    def _work(self) -> None:
        while True:
            future, fn, args, kwargs = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # handed to whoever waits on the future, as a pool does
                    future.set_exception(e)
            with self._lock:
                self._idle += 1


class Slots:
    """The calls of each kind (``KINDS``) being served, each kind at most its ``LIMITS``."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    def take(self, kind: str) -> bool:
        """Holds a slot of ``kind``; False, holding nothing, when all its slots are held."""
        with self._lock:
            held = self.held.get(kind, 0)
            if kind in LIMITS and held >= LIMITS[kind]:
                return False
            self.held[kind] = held + 1
            return True

    def give(self, kind: str) -> None:
        with self._lock:
            self.held[kind] -= 1
            if not self.held[kind]:
                del self.held[kind]
                self._refused.discard(kind)

    def first_refusal(self, kind: str) -> bool:
        """Whether this is the first refusal of ``kind`` since its calls last all ended (the one worth a warning)."""
        with self._lock:
            first = kind not in self._refused
            self._refused.add(kind)
            return first


def _service(layout: Layout, standin: CoordinationStandIn, slots: Slots) -> grpc.GenericRpcHandler:
    handlers = {method: grpc.unary_unary_rpc_method_handler(
        _answer(layout, method, handler, standin, slots), request_deserializer=request.FromString,
        response_serializer=lambda message: message.SerializeToString())
        for method, (request, handler) in layout.methods.items()}
    return grpc.method_handlers_generic_handler(layout.service, handlers)


def _answer(layout: Layout, method: str, handler: Handler, standin: CoordinationStandIn, slots: Slots) -> Any:
    kind = KINDS.get(method, "quick")

    def answer(request: Any, context: grpc.ServicerContext) -> Any:
        if not slots.take(kind):
            log.log(logging.WARNING if slots.first_refusal(kind) else logging.DEBUG, "%s/%s refused: %s",
                    layout.service, method, _full(kind))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {_full(kind)}")
        ended = threading.Event()

        def end() -> None:  # the call ended (cancelled, past its deadline, or answered): its wait ends now
            ended.set()
            standin.wake()
        try:
            if not context.add_callback(end):
                end()
            log.debug("%s/%s from JAX (%s s left)", layout.service, method, _timeout(context))
            with standin.serving(ended):
                return handler(standin, request, _timeout(context))
        except CoordinationError as e:
            if e.task is not None:
                payloads = tf_pb.PayloadContainer(payloads={PAYLOAD_KEY: layout.error_payload(e.task)})
                context.set_trailing_metadata(((DETAILS_TRAILER, payloads.SerializeToString()),))
            log.debug("%s/%s: %s", layout.service, method, e.message)
            context.abort(_CODES[e.code], e.message)
        finally:
            slots.give(kind)
    return answer


def _full(kind: str) -> str:
    return (f"ifrt's stand-in serves at most {LIMITS[kind]} {KIND_NAMES[kind]} at once and holds that many now "
            f"(ifrt.jax.xla_standin.server.LIMITS[{kind!r}]): refused for load; retry once one ends")


def _timeout(context: grpc.ServicerContext) -> float | None:
    """The call's time left; None for a call without a deadline (gRPC then says some 292 billion years)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > NO_DEADLINE_S else remaining


_CODES = {code.value[0]: code for code in grpc.StatusCode}
