"""The operator's view of a coordinator (``ifrt status``, the status page, the metrics, the progress log): only what
is durable, a standby naming the leader."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

import grpc

from coordinator.calls import parse
from coordinator.core import status as status_view
from coordinator.core.state import ClusterState
from coordinator.messages import PublishedGeneration
from coordinator.replica import NotServing, Replica
from ifrt._generated import coordinator_pb2 as pb

log = logging.getLogger("ifrt.coordinator")


class CoordinatorService(Protocol):
    """What the operator's view reads of the coordinator's service (``coordinator.service``)."""

    replica: Replica
    advertise: str
    time_to_publish_s: float | None
    clock: Callable[[], float]
    agents_watching: Callable[[], frozenset[str]]

    @property
    def state(self) -> ClusterState: ...

    def current_generation(self) -> PublishedGeneration: ...


async def status_rpc(service: CoordinatorService, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """The operator's view (``ifrt status``); a standby answers it too, naming the leader."""
    await parse(pb.StatusRequest, raw, context)
    return (await status_answer(service)).SerializeToString()


async def status_answer(service: CoordinatorService) -> pb.StatusResponse:
    """What ``Status`` answers now (also the status page's source): only what is durable."""
    if service.replica.serving:
        with contextlib.suppress(NotServing):  # then this replica answers as a standby
            await service.replica.commit()  # report only what is durable
    replica, config = service.replica, service.replica.config
    if not replica.serving:
        return status_view.standby_answer(cluster_id=config.cluster_id, expected=config.num_processes,
                                          replica=service.advertise, leader=replica.store.leader,
                                          store=replica.store.description, reason=replica.not_serving_reason(),
                                          attempt=config.attempt)
    generation = service.current_generation()  # no await since the commit: the report and fingerprint agree
    return status_view.leader_answer(service.state.report(service.clock()), fingerprint=generation.fingerprint,
                                     replica=service.advertise, leader=replica.store.leader or service.advertise,
                                     store=replica.store.description, time_to_publish_s=service.time_to_publish_s,
                                     attempt=service.state.attempts.current, agents=service.state.attempts.listed(),
                                     watching=service.agents_watching())


def report(service: CoordinatorService) -> status_view.StatusReport | None:
    """The state machine's report as of now (for metrics); None while this replica does not serve."""
    return service.state.report(service.clock()) if service.replica.serving else None


def status(service: CoordinatorService) -> str:
    """One line for operators: the published generation, or who is still missing."""
    if not service.replica.serving:
        return service.replica.reason
    topology = service.state.topology
    if topology is not None:
        return f"generation {topology.generation} published with {len(topology.processes)} processes"
    return service.state.progress(service.clock()).describe()


async def log_progress_every(service: CoordinatorService, interval_s: float) -> None:
    """Logs who is missing every ``interval_s`` while some, but not all, processes have registered."""
    while True:
        await asyncio.sleep(interval_s)
        if service.replica.serving and service.state.registered and service.state.topology is None:
            log.info("waiting: %s", status(service))

