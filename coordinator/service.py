"""The gRPC face of the state machine: decode, apply, wait, answer with pre-serialized bytes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from coordinator import registration as reg
from coordinator.state import ClusterState, Published
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import ERROR_TRAILER, IfrtError, InvalidArgument

log = logging.getLogger("ifrt.coordinator")

MAX_HOSTS_IN_PROGRESS = 32
"""Registered hosts listed in one progress answer (the count is always exact)."""


def peer_host(peer: str) -> str:
    """The IP of a gRPC peer string: ``ipv4:10.0.0.2:5000`` -> ``10.0.0.2``, ``ipv6:[::1]:5000`` -> ``::1``."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return rest or peer


class CoordinatorService:
    """Serves Register. Serializes each generation's topology once; every answer reuses those bytes."""

    def __init__(self, state: ClusterState, *, max_wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.state = state
        self._clock = clock
        self._max_wait_s = max_wait_s
        self._published = asyncio.Event()
        self._answer_tail = b""

    def handlers(self) -> grpc.GenericRpcHandler:
        """The method handlers; responses are already bytes, so the serializer is the identity."""
        register = grpc.unary_unary_rpc_method_handler(self.register)  # raw bytes in and out
        return grpc.method_handlers_generic_handler(pb.DESCRIPTOR.services_by_name["Coordinator"].full_name,
                                                    {"Register": register})

    async def register(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            request = _parse(raw)
            registration = reg.from_request(request, peer_host(context.peer()))
            before = self.state.registered
            outcome = self.state.register(registration, self._clock())
        except IfrtError as e:
            log.warning("rejected registration from %s: %s", context.peer(), e)
            await context.abort(e.code, str(e), trailing_metadata=((ERROR_TRAILER, type(e).__name__),))
        if self.state.registered > before:
            self._log_admitted(registration)
        if isinstance(outcome, Published):
            if not self._published.is_set():
                self._publish(outcome)
            return self._answer(outcome.process_id)
        try:
            await asyncio.wait_for(self._published.wait(), min(request.wait_ms / 1000, self._max_wait_s))
        except TimeoutError:
            return self._progress_answer()
        outcome = self.state.register(registration, self._clock())
        assert isinstance(outcome, Published)
        return self._answer(outcome.process_id)

    def _publish(self, outcome: Published) -> None:
        canonical = wire.encode(outcome.topology)
        fingerprint = wire.fingerprint(canonical)
        encoding, payload = wire.compress(canonical)
        self._answer_tail = pb.RegisterResponse(topology=payload, encoding=encoding, fingerprint=fingerprint,
                                                generation=outcome.topology.generation).SerializeToString()
        self._published.set()
        log.info("published generation %d: %d processes, %d devices, %d bytes (%d sent), fingerprint %s",
                 outcome.topology.generation, len(outcome.topology.processes), len(outcome.topology.devices),
                 len(canonical), len(payload), fingerprint[:16])

    def _answer(self, process_id: int) -> bytes:
        # Concatenated protobuf messages parse as one: the per-process field, then the shared bytes.
        return pb.RegisterResponse(process_id=process_id).SerializeToString() + self._answer_tail

    def _progress_answer(self) -> bytes:
        p = self.state.progress(self._clock())
        return pb.RegisterResponse(progress=pb.Progress(
            registered=p.registered, expected=p.expected, missing_process_ids=p.missing_process_ids,
            registered_hosts=p.registered_hosts[:MAX_HOSTS_IN_PROGRESS], waited_seconds=p.waited_seconds,
        )).SerializeToString()

    def _log_admitted(self, r: reg.Registration) -> None:
        state = self.state
        who = f"process {r.process_id}" if r.process_id is not None else "a process"
        missing = state.missing_count()
        if not missing:
            waiting = "complete"
        elif ids := state.missing_ids_if_few():
            waiting = f"waiting for process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
        else:
            waiting = f"waiting for {missing} more"
        log.info("registered %s on %s with %d devices: %d/%d registered, %s", who, r.describe(), len(r.devices),
                 state.registered, state.config.num_processes, waiting)

    def status(self) -> str:
        """One line for operators: the published generation, or who is still missing."""
        topology = self.state.topology
        if topology is not None:
            return f"generation {topology.generation} published with {len(topology.processes)} processes"
        return self.state.progress(self._clock()).describe()

    async def log_progress_every(self, interval_s: float) -> None:
        """Logs who is missing every ``interval_s`` while some, but not all, processes have registered."""
        while not self._published.is_set():
            await asyncio.sleep(interval_s)
            if self.state.registered and not self._published.is_set():
                log.info("waiting: %s", self.status())


def _parse(raw: bytes) -> pb.RegisterRequest:
    try:
        return pb.RegisterRequest.FromString(raw)
    except DecodeError as e:
        raise InvalidArgument(f"request is not a valid ifrt.topology.v1.RegisterRequest: {e}") from e
