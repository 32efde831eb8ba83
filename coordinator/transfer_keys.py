"""The ``TransferKey`` RPC: hands a process of the published topology the key it proves itself with to a peer's
transfer endpoint (``ifrt.transfer_keys``). A read of durable state: it changes nothing, and is answered only to a
caller that proves, with its own process secret, that it is the registered process it says (``client_uid``), its id's
current incarnation (the key binds that incarnation, and the answer names it), for a peer of the same run that
registered with a secret of its own."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import grpc

from coordinator.calls import caller_proof, parse
from coordinator.core.run import Run
from coordinator.core.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import PermissionDenied, ProcessDeclaredFailed, UnknownClient
from ifrt.transfer_keys import pair_key

R = TypeVar("R")


class Serving(Protocol):
    """What the handler needs of the service (``coordinator.service.CoordinatorService``)."""

    @property
    def state(self) -> ClusterState: ...

    async def serving(self, context: grpc.aio.ServicerContext, what: str, epoch: int | None = None) -> None: ...

    async def read(self, context: grpc.aio.ServicerContext, what: str, query: Callable[[], R]) -> R: ...


def transfer_key_handler(service: Serving) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
    """The raw-bytes handler of ``TransferKey`` for ``service`` (registered in its ``handlers()``)."""
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await parse(pb.TransferKeyRequest, raw, context)
        what = f"a transfer key toward process {request.peer_process_id}"
        await service.serving(context, what)
        proof = caller_proof(context)
        process_id, key, incarnation = await service.read(context, what,
                                                          lambda: key_for(service.state.current, request, proof))
        return pb.TransferKeyResponse(key=key, process_id=process_id, peer_process_id=request.peer_process_id,
                                      incarnation=incarnation).SerializeToString()
    return handle


def key_for(run: Run, request: pb.TransferKeyRequest, proof: str) -> tuple[int, bytes, int]:
    """(the caller's process id, K(caller -> peer, its incarnation), that incarnation); UnknownClient,
    PermissionDenied or ProcessDeclaredFailed when the caller may not have it (a replaced incarnation included: it
    is no longer its id's current one), UnknownClient when the run has no such peer."""
    process_id = run.process_id_of(request.client_uid, proof=proof)  # published, usable, its secret matches
    member = run.admission.member_of(process_id)
    if member is None or member.uid != request.client_uid:
        raise ProcessDeclaredFailed(f"client {request.client_uid} is no longer the current incarnation of process "
                                    f"{process_id}: no transfer key for a replaced process")
    own = member.registration
    if not own.secret_hash or not hmac.compare_digest(own.secret_hash, proof):
        raise PermissionDenied(f"process {process_id} registered without a process secret, or this call does not "
                               "carry it: transfer keys are handed only to a process that proves it is itself")
    peer = request.peer_process_id
    registration = run.registration_of(peer) if peer in run.admission.in_topology else None
    if registration is None:
        raise UnknownClient(f"no process {peer} in the published topology of run {run.number}: no transfer key "
                            "toward it")
    if not registration.secret_hash:
        raise PermissionDenied(f"process {peer} registered without a process secret: its transfers cannot be keyed")
    return process_id, pair_key(registration.secret_hash, process_id, peer, member.incarnation), member.incarnation
