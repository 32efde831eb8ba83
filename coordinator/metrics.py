"""Prometheus metrics of one coordinator (``--metrics-port``): RPCs by method and status code, journal append
latency, and gauges read from the state machine when scraped. Each server has its own registry, so several
coordinators in one process do not collide."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.status import DEGRADED, PUBLISHED, WAITING, StatusReport

if TYPE_CHECKING:
    from coordinator.service import CoordinatorService

RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Unary RPC latency: sub-millisecond answers up to Register calls held for the topology (30 s by default)."""
JOURNAL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Journal appends: microseconds in memory, milliseconds to etcd, seconds when etcd struggles."""
SCRAPE_TIMEOUT_S = 5.0
"""Longest a scrape waits for the coordinator's event loop to read its state."""


class MetricsBindError(RuntimeError):
    """The metrics HTTP server could not listen on the address it was given."""


class Metrics:
    """The metrics of one coordinator, in a registry of its own, and the HTTP server that exposes them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpcs = Counter("ifrt_rpcs", "RPCs handled, by service, method and gRPC status code",
                            ["service", "method", "code"], registry=self.registry)
        self.rpc_seconds = Histogram("ifrt_rpc_duration_seconds", "Time to answer unary RPCs (streams are counted "
                                     "in ifrt_rpcs_total only), by service, method and gRPC status code",
                                     ["service", "method", "code"], buckets=RPC_BUCKETS, registry=self.registry)
        self.journal_append_seconds = Histogram("ifrt_journal_append_seconds", "Time of each successful journal "
                                                "append to the store (one append carries many calls' entries)",
                                                buckets=JOURNAL_BUCKETS, registry=self.registry)
        self._http: Any = None
        self._thread: threading.Thread | None = None

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """Counts and times every RPC of the server it is installed in (install it first, to see every refusal)."""
        return _RpcMetrics(self)

    def watch(self, service: CoordinatorService) -> None:
        """Reads ``service``'s state at every scrape (on its event loop) and times its journal appends. Call it
        from that event loop."""
        service.replica.on_append = self.journal_append_seconds.observe
        self.registry.register(_StateCollector(service, asyncio.get_running_loop()))

    def serve(self, host: str, port: int) -> int:
        """Serves ``/metrics`` over HTTP on ``host:port`` (port 0 picks one) in a thread; returns the port."""
        try:
            self._http, self._thread = start_http_server(port, host, registry=self.registry)
        except OSError as e:
            raise MetricsBindError(f"cannot serve metrics on {host}:{port}: {e}") from e
        return self._http.server_port

    def close(self) -> None:
        """Stops the HTTP server, if it runs."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(SCRAPE_TIMEOUT_S)
            self._thread = None


class _RpcMetrics(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:  # gRPC answers UNIMPLEMENTED itself
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")
        for kind in ("unary_unary", "stream_unary", "unary_stream", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                timed = not handler.response_streaming
                return handler._replace(**{kind: self._wrap(behavior, service, method, timed)})
        return handler

    def _wrap(self, behavior: Callable, service: str, method: str, timed: bool) -> Callable:
        metrics = self._metrics

        def record(started: float, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
            code = _code(context, error)
            metrics.rpcs.labels(service, method, code).inc()
            if timed:
                metrics.rpc_seconds.labels(service, method, code).observe(time.perf_counter() - started)

        if inspect.isasyncgenfunction(behavior):
            async def streamed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started, error = time.perf_counter(), None
                try:
                    async for item in behavior(request, context):
                        yield item
                except BaseException as e:
                    error = e
                    raise
                finally:
                    record(started, context, error)
            return streamed

        async def answered(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, error = time.perf_counter(), None
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                record(started, context, error)
        return answered


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status the call ends with: what the handler set or aborted with, CANCELLED, or UNKNOWN."""
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return "UNKNOWN"  # what gRPC answers for an exception that escapes a handler
    return "OK"


@dataclass(frozen=True)
class _Snapshot:
    leader: bool
    expected: int
    report: StatusReport | None
    time_to_publish_s: float | None


class _StateCollector(Collector):
    """Gauges read from the state machine at scrape time, on the coordinator's event loop (never mid-change)."""

    def __init__(self, service: CoordinatorService, loop: asyncio.AbstractEventLoop) -> None:
        self._service = service
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # no scrape at registration: that would wait on the loop that is registering it

    def collect(self) -> Iterator[Metric]:
        if threading.get_ident() == self._loop_thread:
            snapshot = self._read()
        else:
            snapshot = asyncio.run_coroutine_threadsafe(self._read_on_loop(), self._loop).result(SCRAPE_TIMEOUT_S)
        yield _gauge("ifrt_leader", "1 while this replica leads and serves, else 0", int(snapshot.leader))
        yield _gauge("ifrt_processes_expected", "Processes the cluster expects (--num-processes)", snapshot.expected)
        report = snapshot.report
        if report is None:  # a standby knows nothing of the cluster's processes
            return
        states = GaugeMetricFamily("ifrt_cluster_state", "1 for the cluster's current state", labels=["state"])
        for state in (WAITING, PUBLISHED, DEGRADED):
            states.add_metric([state], int(report.state == state))
        yield states
        yield _gauge("ifrt_processes_registered", "Processes registered (current incarnations)", report.registered)
        yield _gauge("ifrt_processes_failed", "Processes declared failed and not restarted", len(report.failed))
        yield _gauge("ifrt_generation", "Generation of the published topology (0 before publication)",
                     report.generation)
        yield _gauge("ifrt_sessions_open", "Live session streams open", report.sessions_open)
        yield _gauge("ifrt_heartbeat_age_max_seconds", "Longest time since a joining or alive process was last "
                     "heard from", report.max_heartbeat_age_s)
        if snapshot.time_to_publish_s is not None:
            yield _gauge("ifrt_time_to_publish_seconds", "From the first registration to the publication of "
                         "generation 1 (on the replica that published it)", snapshot.time_to_publish_s)

    async def _read_on_loop(self) -> _Snapshot:
        return self._read()

    def _read(self) -> _Snapshot:
        service = self._service
        return _Snapshot(service.replica.serving, service.replica.config.num_processes, service.report(),
                         service.time_to_publish_s)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
