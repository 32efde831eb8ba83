"""Runs the coordinator: a grpc.aio server around the service, until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import os
import resource
import signal
import socket
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from coordinator import door as doors
from coordinator import noise, operator_view
from coordinator.agents import AGENTS_SERVICE, JobAgentsService
from coordinator.auth import TokenCheck, server_credentials
from coordinator.config import CoordinatorConfig
from coordinator.core.limits import FLAGS, SPARE_CONNECTIONS, Limits, accept_cap, connection_cap, descriptors_needed
from coordinator.health import HealthService
from coordinator.service import SERVICE, CoordinatorService
from coordinator.store import Store, open_store

log = logging.getLogger("ifrt.coordinator")


class BindError(RuntimeError):
    """The coordinator could not listen on the address it was given."""


async def serve(config: CoordinatorConfig, stop: asyncio.Event | None = None, store: Store | None = None) -> None:
    """Serves until ``stop`` is set or the process gets SIGTERM/SIGINT, then shuts down cleanly. ``store``
    replaces the one ``config.store`` names (for tests that wrap a real store)."""
    stop = stop or asyncio.Event()
    store = store or open_store(config.store, config.cluster.cluster_id, config.leader_ttl_s, config.etcd_access,
                                attempt=config.cluster.attempt)
    metrics = None
    if config.metrics_port is not None:
        from coordinator.metrics import Metrics, MetricsBindError  # prometheus_client: only where metrics are served

        metrics = Metrics()
    limits = config.cluster.limits
    door = _door(config)
    trust = door.trust if door is not None else None
    interceptors = ([TokenCheck(config.token, SERVICE, trust), TokenCheck(config.token, AGENTS_SERVICE, trust)]
                    if config.token else [])
    if metrics is not None:
        interceptors.insert(0, metrics.interceptor())  # counts refused calls too
    server = grpc.aio.server(interceptors=interceptors,
                             options=[*config.grpc_options, *config.keepalive_options,
                                      ("grpc.max_receive_message_length", limits.request_bytes),
                                      ("grpc.max_send_message_length", -1),
                                      *_stream_limit(limits.concurrent_streams),
                                      *_connection_limits(limits, config.cluster.num_processes, door is not None)])
    try:
        if config.tls_cert and config.tls_key:
            credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            port = server.add_secure_port(config.bind, credentials)
        else:
            port = server.add_insecure_port(config.bind)
    except RuntimeError as e:
        raise BindError(f"cannot listen on {config.bind}: {e}") from e
    if not port:
        raise BindError(f"cannot listen on {config.bind}: the address is invalid or in use")
    address = f"{config.bind.rpartition(':')[0]}:{port}"
    advertise = config.advertise or (address if not address.startswith("0.0.0.0:")
                                     else f"{socket.gethostname()}:{port}")
    health = HealthService(limits, door.trusted if door is not None else None)
    if door is not None:
        door.listen(port)

    async def report(serving: bool) -> None:
        """The standard gRPC health service says SERVING exactly while this replica leads with its state."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await health.set(name, status)

    await report(False)  # the servicer starts out SERVING for ""; nothing is served before the journal is replayed
    service = CoordinatorService(config, store, advertise=advertise, report=report)
    agents = JobAgentsService(service)
    server.add_generic_rpc_handlers((service.handlers(), agents.handlers(), health.handlers()))
    if metrics is not None:
        metrics.watch(service, token=config.token, tls=bool(config.tls_cert))
        if door is not None:
            metrics.watch_door(door)
        try:
            metrics_port = metrics.serve(config.metrics_bind, config.metrics_port or 0,
                                         token=config.token if config.metrics_token else None)
        except MetricsBindError as e:
            raise BindError(str(e)) from e
        log.info("serving metrics on http://%s:%d/metrics, the status page at /", config.metrics_bind, metrics_port)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    security = ("mutual TLS" if config.tls_client_ca else "TLS" if config.tls_cert else "plaintext") + (
        ", token required" if config.token else ", no token")
    log.info("ifrt-coordinator listening on %s for cluster %r of %d processes (pid %d, store %s, %s)", address,
             config.cluster.cluster_id, config.cluster.num_processes, os.getpid(), store.description, security)
    if config.ready_file:
        _write_atomically(config.ready_file, address)
    deciding = [asyncio.create_task(service.tick_every(config.tick_s)),  # what makes journal entries on its own
                asyncio.create_task(agents.watch_hosts_every(config.tick_s))]
    background = [asyncio.create_task(service.replica.run()), *deciding,
                  asyncio.create_task(operator_view.log_progress_every(service, config.progress_interval_s)),
                  asyncio.create_task(noise.flush_every()),
                  asyncio.create_task(_collect_young_garbage_every(config.gc_interval_s))]
    if door is not None:
        background.append(asyncio.create_task(door.guard()))
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("shutting down: %s", operator_view.status(service))
        if metrics is not None:
            metrics.close()
        # New calls are refused from here on; calls in flight still get their journal writes.
        service.replica.stop_serving("the coordinator is shutting down")
        await health.enter_graceful_shutdown()
        await service.shutdown_sessions("the coordinator is shutting down", config.shutdown_grace_s)
        await server.stop(config.shutdown_grace_s)
        if config.check_replay:
            for task in deciding:
                task.cancel()
            await asyncio.gather(*deciding, return_exceptions=True)
            await service.replica.check_replay()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await store.close()  # gives up leadership at once: a standby takes over without waiting for the lease
        noise.noisy.flush()
        log.info("stopped")


def _stream_limit(streams: int) -> list[tuple[str, int]]:
    """gRPC's per-connection HTTP/2 stream limit (SETTINGS_MAX_CONCURRENT_STREAMS); 0 keeps gRPC's default."""
    return [("grpc.max_concurrent_streams", streams)] if streams else []


GARBAGE_GROWTH_BYTES = 16 << 20
"""Resident memory gained since the last full collection past which a round collects every generation."""
FULL_COLLECTION_SHARE = 20
"""A full collection waits at least this many times the last one's duration after it (5% of the loop at most)."""


async def _collect_young_garbage_every(interval_s: float) -> None:
    """Frees the reference cycles that finished calls leave (gRPC's call objects hold their request): a server that
    allocates little never triggers Python's collector, so the large requests of refused calls would stay. A call
    in flight during a collection has its objects promoted to the oldest generation, which Python collects by its
    count of objects, not their bytes (a 4 MiB request is a few containers of strings): once resident memory grew by
    GARBAGE_GROWTH_BYTES (a quarter, for a large heap), a round collects them all, as often as their cost allows."""
    loop = asyncio.get_running_loop()
    baseline, not_before = _resident_bytes(), 0.0
    while True:
        await asyncio.sleep(interval_s)
        resident = _resident_bytes()
        if resident > baseline + max(GARBAGE_GROWTH_BYTES, baseline // 4) and loop.time() >= not_before:
            started = loop.time()
            gc.collect()
            _trim()
            baseline, not_before = _resident_bytes(), loop.time() + FULL_COLLECTION_SHARE * (loop.time() - started)
        else:
            gc.collect(1)
            _trim()
            baseline = min(baseline, resident)


def _resident_bytes() -> int:
    """This process's resident memory (0 where /proc is not there: then every round is a young one)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _libc_trim() -> Callable[[], object]:
    """glibc's malloc_trim(0): gives the free pages inside malloc's heaps back to the system (the chunks a large
    request was read into are freed, but stay resident otherwise); a no-op without glibc."""
    try:
        return functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)
    except (OSError, AttributeError):
        return lambda: None


_trim = _libc_trim()


def _door(config: CoordinatorConfig) -> doors.Door | None:
    """The door that keeps strangers' connections within their budget: only with a token (without one every
    caller is the job's), and only where /proc lists connections (else a warning, and one cap for everyone)."""
    if not config.token:
        return None
    missing = doors.available()
    if missing is not None:
        log.warning("cannot tell the job's connections from strangers' (%s): callers without the token share the "
                    "--max-connections cap with the job, and can hold it", missing)
        return None
    return doors.Door(config.cluster.limits.stranger_connections)


def _connection_limits(limits: Limits, num_processes: int, door: bool = False) -> list[tuple[str, int]]:
    """gRPC options that bound connections: idle ones (no call in flight) and unfinished handshakes are closed
    after --max-connection-idle, and accepting stops below the descriptor limit (raised to its hard limit here),
    so a flood of connections can neither hold descriptors forever nor starve the coordinator's own. With a
    ``door``, gRPC accepts the strangers' budget twice beyond the job's share (``accept_cap``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    cap = connection_cap(limits, soft, num_processes)
    if cap < num_processes + SPARE_CONNECTIONS or (limits.connections and limits.connections > cap):
        log.warning("the descriptor limit (ulimit -n) is %d, so at most %d connections are accepted at once: a "
                    "job of %d processes needs at least %d; raise the limit (or --max-connections)", soft, cap,
                    num_processes, descriptors_needed(num_processes))
    if door:
        job_share, cap = cap, accept_cap(limits, soft, num_processes)
        if cap < job_share + 2 * limits.stranger_connections:
            log.warning("the descriptor limit (ulimit -n) is %d, so at most %d connections are accepted at once: "
                        "callers without the token may take the job's slots until their connections are closed "
                        "(%s %d needs %d); raise the limit", soft, cap, FLAGS["stranger_connections"],
                        limits.stranger_connections, job_share + 2 * limits.stranger_connections + 64)
    idle_ms = limits.connection_idle_seconds * 1000
    return [("grpc.max_connection_idle_ms", idle_ms), ("grpc.server_handshake_timeout_ms", idle_ms),
            ("grpc.max_allowed_incoming_connections", cap)]


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("received %s", sig.name)
    stop.set()


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
