"""``ifrt status``: what the coordinator's replicas say about the cluster, as a dict (``--json``) or as text."""

from __future__ import annotations

from typing import Any

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.client_config import CHANNEL_OPTIONS
from ifrt.errors import CoordinatorUnavailable, IfrtError, TransportMismatch, from_rpc_error
from ifrt.security import open_channel, transport_mismatch
from ifrt.settings import Settings
from ifrt.status_view import LEADER, STANDBY, to_dict

UNREACHABLE = "unreachable"
REFUSED = "refused"


def query(settings: Settings, timeout: float) -> dict[str, Any]:
    """Asks every replica of ``settings.coordinators`` at once (with the token and TLS the settings give); returns
    the leader's report (else a standby's) with each replica's role. If none answers: the typed error of a refusal
    retrying cannot fix (e.g. Unauthenticated), else CoordinatorUnavailable naming every replica and its error."""
    addresses = settings.coordinators
    # No process secret: this caller acts for no process.
    channels = [open_channel(a, settings, "", CHANNEL_OPTIONS) for a in addresses]
    try:
        calls = [CoordinatorStub(c).Status.future(pb.StatusRequest(), timeout=timeout) for c in channels]
        answers: list[pb.StatusResponse | None] = []
        replicas: list[dict[str, Any]] = []
        errors: list[IfrtError] = []
        for address, call in zip(addresses, calls, strict=True):
            try:
                answer = call.result()
            except grpc.RpcError as e:
                error = from_rpc_error(e, address)
                if error.retryable and (mismatch := transport_mismatch(address, settings.tls)) is not None:
                    error = TransportMismatch(mismatch)  # TLS on one side only: say so, not "unavailable"
                errors.append(error)
                answers.append(None)
                role = UNREACHABLE if errors[-1].retryable else REFUSED
                replicas.append({"address": address, "role": role, "error": str(errors[-1])})
                continue
            answers.append(answer)
            role = STANDBY if answer.state == pb.CLUSTER_PHASE_STANDBY else LEADER
            replicas.append({"address": address, "role": role})
    finally:
        for channel in channels:
            channel.close()
    answered = [a for a in answers if a is not None]
    if not answered:
        refused = [e for e in errors if not e.retryable]
        if refused:
            raise refused[0]
        raise CoordinatorUnavailable("no coordinator answered: " + "; ".join(str(e) for e in errors))
    leading = [a for a in answered if a.state != pb.CLUSTER_PHASE_STANDBY]
    view = to_dict((leading or answered)[0])
    view["replicas"] = replicas
    return view
