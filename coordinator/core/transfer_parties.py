"""Who may have a transfer key toward whom (``TransferKey``): only a process of the published topology that proves,
with its own process secret, that it is its id's current incarnation, toward a peer of the same run that registered
with a secret of its own. The shell derives the key (``ifrt.transfer_keys.pair_key``) from what this hands it."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from coordinator.core.run import Run
from ifrt.errors import PermissionDenied, ProcessDeclaredFailed, UnknownClient


@dataclass(frozen=True)
class Parties:
    """A caller that may have its key toward ``peer``: its id and incarnation, and the peer's secret hash."""

    process_id: int
    incarnation: int
    peer: int
    peer_secret_hash: str


def parties(run: Run, client_uid: str, peer: int, proof: str) -> Parties:
    """The caller ``client_uid`` (``proof``: the hash of the secret its call carries) and ``peer``; UnknownClient,
    PermissionDenied or ProcessDeclaredFailed when the caller may not have the key (a replaced incarnation included:
    it is no longer its id's current one), UnknownClient when the run has no such peer."""
    process_id = run.process_id_of(client_uid, proof=proof)  # published, usable, its secret matches
    member = run.admission.member_of(process_id)
    if member is None or member.uid != client_uid:
        raise ProcessDeclaredFailed(f"client {client_uid} is no longer the current incarnation of process "
                                    f"{process_id}: no transfer key for a replaced process")
    own = member.registration
    if not own.secret_hash or not hmac.compare_digest(own.secret_hash, proof):
        raise PermissionDenied(f"process {process_id} registered without a process secret, or this call does not "
                               "carry it: transfer keys are handed only to a process that proves it is itself")
    registration = run.registration_of(peer) if peer in run.admission.in_topology else None
    if registration is None:
        raise UnknownClient(f"no process {peer} in the published topology of run {run.number}: no transfer key "
                            "toward it")
    if not registration.secret_hash:
        raise PermissionDenied(f"process {peer} registered without a process secret: its transfers cannot be keyed")
    return Parties(process_id, member.incarnation, peer, registration.secret_hash)
