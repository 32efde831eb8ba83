"""Runs the coordinator: a grpc.aio server around the service, until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from coordinator.config import CoordinatorConfig
from coordinator.service import SERVICE, CoordinatorService
from coordinator.store import Store, open_store

log = logging.getLogger("ifrt.coordinator")


class BindError(RuntimeError):
    """The coordinator could not listen on the address it was given."""


async def serve(config: CoordinatorConfig, stop: asyncio.Event | None = None, store: Store | None = None) -> None:
    """Serves until ``stop`` is set or the process gets SIGTERM/SIGINT, then shuts down cleanly. ``store``
    replaces the one ``config.store`` names (for tests that wrap a real store)."""
    stop = stop or asyncio.Event()
    store = store or open_store(config.store, config.cluster.cluster_id, config.leader_ttl_s)
    server = grpc.aio.server(options=[*config.grpc_options,
                                      ("grpc.max_receive_message_length", config.max_request_bytes),
                                      ("grpc.max_send_message_length", -1)])
    try:
        port = server.add_insecure_port(config.bind)
    except RuntimeError as e:
        raise BindError(f"cannot listen on {config.bind}: {e}") from e
    if not port:
        raise BindError(f"cannot listen on {config.bind}: the address is invalid or in use")
    address = f"{config.bind.rpartition(':')[0]}:{port}"
    advertise = config.advertise or (address if not address.startswith("0.0.0.0:")
                                     else f"{socket.gethostname()}:{port}")
    health = health_aio.HealthServicer()

    async def report(serving: bool) -> None:
        """The standard gRPC health service says SERVING exactly while this replica leads with its state."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await health.set(name, status)

    await report(False)  # the servicer starts out SERVING for ""; nothing is served before the journal is replayed
    service = CoordinatorService(config.cluster, store, advertise=advertise, max_wait_s=config.max_wait_s,
                                 report=report)
    server.add_generic_rpc_handlers((service.handlers(),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    log.info("ifrt-coordinator listening on %s for cluster %r of %d processes (pid %d, store %s)", address,
             config.cluster.cluster_id, config.cluster.num_processes, os.getpid(), store.description)
    if config.ready_file:
        _write_atomically(config.ready_file, address)
    background = [asyncio.create_task(service.replica.run()),
                  asyncio.create_task(service.log_progress_every(config.progress_interval_s)),
                  asyncio.create_task(service.tick_every(config.tick_s))]
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("shutting down: %s", service.status())
        # New calls are refused from here on; calls in flight still get their journal writes.
        service.replica.stop_serving("the coordinator is shutting down")
        await health.enter_graceful_shutdown()
        await service.shutdown_sessions("the coordinator is shutting down", config.shutdown_grace_s)
        await server.stop(config.shutdown_grace_s)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await store.close()  # gives up leadership at once: a standby takes over without waiting for the lease
        log.info("stopped")


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("received %s", sig.name)
    stop.set()


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
