"""Only the job's own processes get in, and no process can act for another: the cluster token, TLS and mutual
TLS (certificates made with openssl at run time), process secrets, and the transfer endpoints' handshake."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import ifrt
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.errors import TransferTimeout
from ifrt.protocol import SECRET_METADATA
from ifrt.transfer import Channels
from ifrt.transfer.frames import CHALLENGE_BYTES, HELLO, encode_header
from tests.helpers import BIN, TOKEN, clients, discover_processes, health, poll_until

MISMATCH_WITHIN_S = 10.0
"""A transport mismatch is reported this fast; the discovery timeout it replaces is 120 s."""


def timed_discover(**kwargs) -> tuple[Exception | None, float]:
    start = time.monotonic()
    try:
        with ifrt.Client(timeout=120, process_id=0, num_processes=1, session=False, **kwargs) as client:
            client.discover()
    except ifrt.IfrtError as e:
        return e, time.monotonic() - start
    return None, time.monotonic() - start


# The cluster token.

def test_the_token_lets_the_job_in_and_is_never_shown(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), num_processes=2)
    topologies = discover_processes(coordinator.address, 2, {"IFRT_TOKEN_FILE": str(token_file)})
    assert len({t["fingerprint"] for t in topologies}) == 1
    assert "token required" in coordinator.log and TOKEN not in coordinator.log
    shown = subprocess.run([str(BIN / "ifrt"), "env"], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "IFRT_COORDINATOR": coordinator.address, "IFRT_TOKEN": TOKEN})
    assert "token: set" in shown.stdout and TOKEN not in shown.stdout + shown.stderr


def test_a_call_without_the_token_or_with_another_is_unauthenticated_and_changes_nothing(start_coordinator,
                                                                                          token_file):
    coordinator = start_coordinator("--token-file", str(token_file), num_processes=2)
    for token, why in ((None, "carries no token"), ("not-the-token", "carries a wrong token")):
        with ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=60, token=token) as stranger, \
                pytest.raises(ifrt.Unauthenticated, match=why) as refused:
            stranger.discover()
        assert "not-the-token" not in str(refused.value)
        coordinator.wait_for_log("refused Register from ipv4:127.0.0.1:")
        coordinator.wait_for_log(why)
    assert health(coordinator.address) == "SERVING"  # probes need no token
    # Had a stranger been admitted as process 0, the real process 0 would now be refused as a duplicate.
    topologies = discover_processes(coordinator.address, 2, {"IFRT_TOKEN": TOKEN})
    assert sorted(t["process_id"] for t in topologies) == [0, 1] and {t["generation"] for t in topologies} == {1}
    assert "not-the-token" not in coordinator.log


# TLS.

def tls_env(certs: Path, client_cert: bool = False) -> dict[str, str]:
    env = {"IFRT_TLS_CA": str(certs / "ca.pem")}
    if client_cert:
        env.update(IFRT_TLS_CERT=str(certs / "client.pem"), IFRT_TLS_KEY=str(certs / "client-key.pem"))
    return env


def test_a_tls_coordinator_serves_clients_that_trust_its_ca(start_coordinator, certs):
    coordinator = start_coordinator("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                                    num_processes=2)
    assert "(pid" in coordinator.log and ", TLS, no token" in coordinator.log
    topologies = discover_processes(coordinator.address, 2, tls_env(certs))
    assert len({t["fingerprint"] for t in topologies}) == 1


def test_a_plaintext_client_of_a_tls_coordinator_is_told_at_once(start_coordinator, certs):
    coordinator = start_coordinator("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                                    num_processes=1)
    error, took = timed_discover(coordinator=coordinator.address)
    assert isinstance(error, ifrt.TransportMismatch), error
    assert "requires TLS: set IFRT_TLS_CA" in str(error)
    assert took < MISMATCH_WITHIN_S


def test_a_tls_client_of_a_plaintext_coordinator_is_told_at_once(start_coordinator, certs):
    coordinator = start_coordinator(num_processes=1)
    error, took = timed_discover(coordinator=coordinator.address, tls_ca=str(certs / "ca.pem"))
    assert isinstance(error, ifrt.TransportMismatch), error
    assert "speaks plaintext" in str(error)
    assert took < MISMATCH_WITHIN_S


def test_mutual_tls_admits_certified_clients_only(start_coordinator, certs):
    coordinator = start_coordinator("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                                    "--tls-client-ca", str(certs / "ca.pem"), num_processes=2)
    assert ", mutual TLS, no token" in coordinator.log
    error, took = timed_discover(coordinator=coordinator.address, tls_ca=str(certs / "ca.pem"))
    assert isinstance(error, ifrt.TransportMismatch), error
    assert "requires a client certificate" in str(error) and took < MISMATCH_WITHIN_S
    topologies = discover_processes(coordinator.address, 2, tls_env(certs, client_cert=True))
    assert len({t["fingerprint"] for t in topologies}) == 1


# Ownership: a process secret per registration.

@pytest.fixture
def two_processes(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    made = clients(coordinator.address, 2)
    yield coordinator, made
    for c in made:
        c.close()


def impersonate(address: str, secret: str | None):
    """A stub whose calls carry ``secret`` (another process's, or none)."""
    channel = grpc.insecure_channel(address)
    if secret is not None:
        from ifrt.security import _WithMetadata

        channel = grpc.intercept_channel(channel, _WithMetadata(((SECRET_METADATA, secret),)))
    return channel, CoordinatorStub(channel)


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def acting_for(stub: CoordinatorStub, uid: str) -> dict[str, grpc.StatusCode]:
    """What each call on behalf of client ``uid`` gets."""
    opening = iter([pb.SessionRequest(open=pb.SessionOpen(client_uid=uid))])
    return {
        "Leave": code_of(lambda: stub.Leave(pb.LeaveRequest(client_uid=uid), timeout=10)),
        "KeyValueSet": code_of(lambda: stub.KeyValueSet(pb.KeyValueSetRequest(client_uid=uid, key="nccl/id",
                                                                              value=b"forged"), timeout=10)),
        "Barrier": code_of(lambda: stub.Barrier(pb.BarrierRequest(client_uid=uid, name="b", timeout_ms=5000),
                                                timeout=10)),
        "Session": code_of(lambda: list(stub.Session(opening, timeout=10))),
    }


def test_no_process_can_act_for_another(two_processes):
    coordinator, (victim, other) = two_processes
    uid = victim.client_uid  # suppose it leaked: the uid alone is no longer enough to act for process 0
    for secret in (other.process_secret, None):
        channel, stub = impersonate(coordinator.address, secret)
        with channel:
            assert acting_for(stub, uid) == dict.fromkeys(("Leave", "KeyValueSet", "Barrier", "Session"),
                                                         grpc.StatusCode.PERMISSION_DENIED)
    coordinator.wait_for_log("does not carry its process secret")
    # Nothing happened to process 0: it is neither left nor failed, and it still acts for itself.
    other.kv_set("nccl/id", b"real")
    assert victim.kv_get("nccl/id", timeout=10) == b"real"
    done = threading.Thread(target=lambda: victim.barrier("after", timeout=30))
    done.start()
    other.barrier("after", timeout=30)
    done.join(30)
    assert not done.is_alive()
    assert not re.search(r"process 0 \(.*\) (left|failed)", coordinator.log)


def test_leave_from_an_unknown_client_is_not_found(two_processes):
    coordinator, _ = two_processes
    channel, stub = impersonate(coordinator.address, None)
    with channel:
        assert code_of(lambda: stub.Leave(pb.LeaveRequest(client_uid="nobody"), timeout=10)) == \
            grpc.StatusCode.NOT_FOUND


# Transfer endpoints.

@pytest.fixture
def token_pair(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), num_processes=2)
    made = clients(coordinator.address, 2, token=TOKEN)
    yield made
    for c in made:
        c.close()


def test_peers_holding_the_token_transfer(token_pair):
    a, b = token_pair
    with Channels(a.topology, a.endpoint) as out, Channels(b.topology, b.endpoint) as into:
        payload = np.arange(12, dtype=np.float32).reshape(3, 4)
        out.send(payload, dst_device=1 << 17)
        assert np.array_equal(into.recv(src_device=0, timeout=30), payload)


@pytest.mark.parametrize("answer", [b"\x00" * CHALLENGE_BYTES, None], ids=["wrong proof", "no proof"])
def test_a_stranger_on_a_transfer_endpoint_is_refused_and_logged(token_pair, caplog, answer):
    _, b = token_pair
    host, _, port = b.endpoint.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as stranger:
        stranger.sendall(encode_header(HELLO, 0, 0, 1))  # claims to be process 0
        challenge = stranger.recv(CHALLENGE_BYTES)
        assert len(challenge) == CHALLENGE_BYTES
        if answer is not None:
            stranger.sendall(answer)
        else:
            stranger.shutdown(socket.SHUT_WR)
        stranger.settimeout(15)
        assert stranger.recv(1) == b""  # closed by the endpoint
    poll_until(lambda: "refused a transfer connection" in caplog.text, timeout=10, what="the refusal logged")
    assert ("does not hold the cluster's token" if answer else "no answer to the token challenge") in caplog.text
    with Channels(b.topology, b.endpoint) as into, pytest.raises(TransferTimeout):
        into.recv(src_device=0, timeout=0.5)  # nothing the stranger sent was taken as process 0's
