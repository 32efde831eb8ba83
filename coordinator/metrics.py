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
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator import health, operator_view
from coordinator.core import status_page
from coordinator.core.status import DEGRADED, PUBLISHED, WAITING, StatusReport
from coordinator.http_server import BoundedWSGIServer, token_required
from ifrt import status_svg, status_view
from ifrt._generated import coordinator_pb2
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.protocol import TOKEN_METADATA

if TYPE_CHECKING:
    from coordinator.door import Door
    from coordinator.service import CoordinatorService

RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Unary RPC latency: sub-millisecond answers up to Register calls held for the topology (30 s by default)."""
JOURNAL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Journal appends: microseconds in memory, milliseconds to etcd, seconds when etcd struggles."""
SCRAPE_TIMEOUT_S = 5.0
"""Longest a scrape waits for the coordinator's event loop to read its state."""
LEADER_TIMEOUT_S = 2.0
"""Longest a standby's status page waits for the leader's view (within the scrape timeout)."""
KNOWN_METHODS = frozenset({*(f"/{service.full_name}/{method.name}"
                             for service in coordinator_pb2.DESCRIPTOR.services_by_name.values()
                             for method in service.methods), *health.METHODS})
"""The methods counted under their own name; every other one is counted as service and method ``unknown``, so a
caller's text never becomes a label (each label value is a series every scrape carries)."""
UNKNOWN = "unknown"


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
        self._read_view: Callable[[], dict[str, Any]] = _no_view

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """Counts and times every RPC of the server it is installed in (install it first, to see every refusal)."""
        return _RpcMetrics(self)

    def watch(self, service: CoordinatorService, *, token: str | None = None, tls: bool = False) -> None:
        """Reads ``service``'s state at every scrape and page view (on its event loop) and times its journal
        appends. Call it from that event loop. On a standby the page asks the leader's view with ``token`` (not
        over ``tls``: a replica holds no client certificate)."""
        service.replica.on_append = self.journal_append_seconds.observe
        loop = asyncio.get_running_loop()
        self.registry.register(_StateCollector(service, loop))
        page_view = _PageView(service, token, tls)
        self._read_view = lambda: asyncio.run_coroutine_threadsafe(page_view.read(), loop).result(SCRAPE_TIMEOUT_S)

    def watch_door(self, door: Door) -> None:
        """Gauges of the connections ``door`` saw at its last full scan, and a count of strangers' it closed."""
        self.registry.register(_DoorCollector(door))

    def serve(self, host: str, port: int, token: str | None = None) -> int:
        """Serves ``/metrics``, and the status page at ``/`` (``/status``, ``/status.json``), over HTTP on
        ``host:port`` (port 0 picks one) in a thread, with bounded connections (``coordinator.http_server``);
        returns the port. With ``token``, every request must carry it (``http_server.token_required``)."""
        app = status_page.wsgi_app(make_wsgi_app(self.registry), lambda: self._read_view())
        if token is not None:
            app = token_required(app, token)
        try:
            self._http = BoundedWSGIServer((host, port), app)
        except OSError as e:
            raise MetricsBindError(f"cannot serve metrics on {host}:{port}: {e}") from e
        self._thread = threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
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
        if details.method in KNOWN_METHODS:
            service, _, method = details.method.lstrip("/").rpartition("/")
        else:
            service = method = UNKNOWN
        if handler is None:  # answered UNIMPLEMENTED, as gRPC would, but counted
            handler = grpc.stream_stream_rpc_method_handler(_unimplemented)
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


async def _unimplemented(requests: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


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
        yield _gauge("ifrt_processes_slow", "Processes alive whose session has sent no heartbeat for a third of the "
                     "heartbeat timeout (stopped answering; failed if it stays so)", len(report.slow))
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
        return _Snapshot(service.replica.serving, service.replica.config.num_processes, operator_view.report(service),
                         service.time_to_publish_s)


class _DoorCollector(Collector):
    """The door's counts (plain ints, read as they are: a scrape may see one sweep's numbers half-way)."""

    def __init__(self, door: Door) -> None:
        self._door = door

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        door = self._door
        yield _gauge("ifrt_connections", "Connections to the coordinator's gRPC port at the door's last full scan",
                     door.connections)
        yield _gauge("ifrt_stranger_connections", "Of them, connections that made no call with the token",
                     door.strangers)
        yield CounterMetricFamily("ifrt_stranger_connections_closed", "Connections of callers without the token "
                                  "closed past --max-stranger-connections", value=door.closed)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _no_view() -> dict[str, Any]:
    raise RuntimeError("the coordinator is not started yet")


class _PageView:
    """The status view the page draws, read on the coordinator's event loop: what ``ifrt status --json`` shows,
    with the attempt and, once published, each process's slice, devices' global ids and default mesh order."""

    def __init__(self, service: CoordinatorService, token: str | None, tls: bool) -> None:
        self._service = service
        self._token = token
        self._tls = tls
        self._extras: tuple[int, dict[int, dict[str, Any]]] = (0, {})  # per generation: the mesh order is costly

    async def read(self) -> dict[str, Any]:
        service = self._service
        answer = await operator_view.status_answer(service)
        view = status_view.to_dict(answer)
        standby = view["state"] == status_view.STANDBY
        view["replicas"] = [{"address": answer.replica, "role": status_view.STANDBY if standby else
                             status_view.LEADER}]
        if standby and answer.leader and answer.leader != answer.replica:
            view["replicas"].append({"address": answer.leader, "role": status_view.LEADER})
        view["attempt"] = answer.attempt  # the job's current attempt (a standby: its --attempt)
        if standby and answer.leader and answer.leader != answer.replica:
            view.update(await self._leader_view(answer.leader))
        topology = service.state.topology if not standby else None
        if topology is not None:
            if self._extras[0] != topology.generation:
                hostnames = {p.process_id: p.hostname for p in topology.processes}
                networks = {p.process_id: p.network for p in topology.processes if p.network}
                self._extras = (topology.generation,
                                status_svg.topology_extras(topology.devices, hostnames, networks))
            view = status_svg.with_extras(view, self._extras[1])
        return view

    async def _leader_view(self, leader: str) -> dict[str, Any]:
        """``leader_view``: the leader's Status as the page draws it; else ``leader_error``, why there is none."""
        if self._tls:
            return {"leader_error": "Over TLS a standby does not ask the leader (it holds no client certificate)."}
        metadata = [(TOKEN_METADATA, self._token)] if self._token else []
        try:
            async with grpc.aio.insecure_channel(leader) as channel:
                answer = await CoordinatorStub(channel).Status(coordinator_pb2.StatusRequest(), metadata=metadata,
                                                               timeout=LEADER_TIMEOUT_S)
        except grpc.RpcError as e:
            return {"leader_error": f"The leader {leader} did not answer: {e.code().name}: {e.details()}."}
        view = status_view.to_dict(answer)
        if view["state"] == status_view.STANDBY:
            return {"leader_error": f"{leader} no longer leads: {view['reason']}."}
        return {"leader_view": view}  # with the leader's current attempt
