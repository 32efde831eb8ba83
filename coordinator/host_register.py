"""RegisterHost's handler, beside ``CoordinatorService`` (whose pipeline it uses): one agent's call admits its host's
processes, journals them in one store write, and is held, as a Register call is, until the topology is complete;
then answers each process's id, or why it was refused, and the bytes every process of the generation gets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import grpc

from coordinator.calls import MAX_MESSAGE_BYTES, abort, caller_proof, capped, parse, peer_host
from coordinator.core import registration as reg
from coordinator.core.effects import Effect, Published, Waiting, WaitingForNextRun
from coordinator.core.limits import Limits
from coordinator.core.state import Admitted
from coordinator.core.waits import wait_s
from coordinator.messages import next_run_answer
from coordinator.waiters import PUBLISHED, resolved_within
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError, InvalidArgument, UnknownClient

if TYPE_CHECKING:
    from coordinator.core.state import ClusterState
    from coordinator.messages import PublishedGeneration
    from coordinator.replica import Replica
    from coordinator.waiters import Waiters

log = logging.getLogger("ifrt.coordinator")


class Pipeline(Protocol):
    """What RegisterHost uses of the service (``coordinator.service.CoordinatorService``): the state, its clock and
    replica, the waits, and the steps every call goes through."""

    clock: Callable[[], float]
    replica: Replica
    waiters: Waiters

    @property
    def state(self) -> ClusterState: ...
    def current_generation(self) -> PublishedGeneration: ...
    async def serving(self, context: grpc.aio.ServicerContext, what: str, epoch: int | None = None) -> None: ...
    async def commit(self, context: grpc.aio.ServicerContext, what: str) -> None: ...
    def announce(self, outcome: Waiting | Published) -> None: ...
    def carry_out(self, effects: list[Effect]) -> None: ...
    def progress_answer(self) -> bytes: ...
    async def wait_for_next_run(self, r: reg.Registration, outcome: WaitingForNextRun, until: float,
                                context: grpc.aio.ServicerContext, what: str,
                                epoch: int) -> tuple[Admitted, list[Effect]]: ...


class HostRegister:
    """``RegisterHost``, with the service's pipeline (serving, commit, waits, effects) and its answers."""

    def __init__(self, service: Pipeline) -> None:
        self.service = service

    async def register_host(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        service = self.service
        request = await parse(pb.RegisterHostRequest, raw, context)
        what = f"host registration of agent {capped(request.agent_uid, 80)!r} from {context.peer()}"
        await service.serving(context, "host registration")
        state, epoch = service.state, service.replica.epoch
        until = service.clock() + wait_s(state.config, request.wait_ms / 1000)
        address, limits = peer_host(context.peer()), state.config.limits
        try:
            agent = state.host_agent(request.agent_uid, caller_proof(context))
            registrations = [_registration(p, address, limits) for p in request.processes]
            with wire.gc_paused():
                results, effects = state.register_host(agent, registrations, service.clock())
        except IfrtError as e:
            await abort(context, e, what)
        for i, outcome in enumerate(results):  # a registration that waits for the job's next run (rare)
            r = registrations[i]
            if isinstance(outcome, WaitingForNextRun) and isinstance(r, reg.Registration):
                results[i], more = await service.wait_for_next_run(r, outcome, until, context, what, epoch)
                effects += more
        admitted = [(registrations[i].client_uid, outcome) for i, outcome in enumerate(results)  # type: ignore[union-attr]
                    if isinstance(outcome, Waiting | Published)]
        for uid, _ in admitted:
            state.call_started(uid, service.clock())  # alive while held, as a Register call's process is
        waiting = any(isinstance(o, Waiting) for _, o in admitted)
        published = service.waiters.expect(PUBLISHED) if waiting else None
        try:
            await service.commit(context, "host registration")
            for _, outcome in admitted:
                service.announce(outcome)  # type: ignore[arg-type]
            service.carry_out(effects)
            if published is not None:
                await resolved_within(published, max(0.0, until - service.clock()))
        finally:
            if published is not None:
                service.waiters.drop(PUBLISHED, published)
            for uid, _ in admitted:
                state.call_ended(uid, service.clock())
        await service.serving(context, "host registration", epoch)
        if waiting:
            await service.commit(context, "host registration")
        return self._host_answer(registrations, results)

    def _host_answer(self, registrations: list[reg.Registration | IfrtError],
                     results: list[Admitted | IfrtError]) -> bytes:
        """Each process's id, or its error; the generation's shared bytes once every admitted one is published."""
        service = self.service
        state, answer = service.state, pb.RegisterHostResponse()
        complete, next_run = True, None
        for r, outcome in zip(registrations, results, strict=True):
            entry = answer.processes.add(process_id=-1)
            if isinstance(outcome, WaitingForNextRun):
                complete, next_run = False, outcome
                continue
            if isinstance(outcome, IfrtError):
                _refused(entry, outcome)
                continue
            assert isinstance(r, reg.Registration)
            try:
                current = state.answer(r.client_uid, service.clock())
            except UnknownClient:  # forgotten while it waited: its next call registers it again
                complete = False
                continue
            except IfrtError as e:  # failed or replaced while it waited
                _refused(entry, e)
                continue
            if isinstance(current, Published):
                entry.process_id = current.process_id
            else:
                complete = False
        if next_run is not None:
            answer.answer = next_run_answer(next_run, 0.0)
        elif complete and any(e.process_id >= 0 for e in answer.processes):
            answer.answer = service.current_generation().answer_tail
        else:
            answer.answer = service.progress_answer()
            for entry in answer.processes:  # no id is an answer until every one is
                entry.process_id = -1
        return answer.SerializeToString()


def _registration(p: pb.HostProcess, address: str, limits: Limits) -> reg.Registration | IfrtError:
    """One worker's registration as its own Register call would be checked, with its own secret's hash."""
    raw = p.request.SerializeToString()
    try:
        if len(raw) > limits.request_bytes:
            raise InvalidArgument(f"the registration of local rank {p.request.local_rank} is {len(raw)} bytes: "
                                  f"expected at most {limits.request_bytes} (the coordinator's --max-request-bytes)")
        return reg.from_request(p.request, address, limits, p.proof, raw)
    except IfrtError as e:
        return e


def _refused(entry: pb.HostRegistration, error: IfrtError) -> None:
    entry.process_id = -1
    entry.code = error.code.value[0]
    entry.error = type(error).__name__
    entry.message = capped(str(error), MAX_MESSAGE_BYTES)

