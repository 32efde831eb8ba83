"""The ``TransferKey`` RPC: hands a process of the published topology the key it proves itself with to a peer's
transfer endpoint (``ifrt.transfer_keys``). A read of durable state: it changes nothing, and is answered only to a
caller that proves, with its own process secret, that it is the registered process it says (``client_uid``), its id's
current incarnation (the key binds that incarnation, and the answer names it), for a peer of the same run that
registered with a secret of its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import grpc

from coordinator.calls import caller_proof, parse
from coordinator.core.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
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
                                                          lambda: key_for(service.state, request, proof))
        return pb.TransferKeyResponse(key=key, process_id=process_id, peer_process_id=request.peer_process_id,
                                      incarnation=incarnation).SerializeToString()
    return handle


def key_for(state: ClusterState, request: pb.TransferKeyRequest, proof: str) -> tuple[int, bytes, int]:
    """(the caller's process id, K(caller -> peer, its incarnation), that incarnation); the caller's error when it
    may not have it (``coordinator.core.transfer_parties``)."""
    p = state.transfer_parties(request.client_uid, request.peer_process_id, proof)
    return p.process_id, pair_key(p.peer_secret_hash, p.process_id, p.peer, p.incarnation), p.incarnation
