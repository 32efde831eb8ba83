"""Transfer frames are bound to their sender: a connection proves its process with the pair key only that process can
get from the coordinator; every frame's source must be a device of that process; a bad frame fails its connection
alone, at once; what an endpoint holds for unread pairs is bounded. Real coordinators, real sockets on loopback."""

from __future__ import annotations

import hashlib
import hmac
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

import ifrt
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import TransferError, TransferTimeout
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA, proof_of
from ifrt.transfer import Channels
from ifrt.transfer.frames import ARRAY, CHALLENGE_BYTES, HEADER, HELLO, KEYED, MAGIC, VERSION, encode_header
from ifrt.transfer.handshake import introduce
from ifrt.transfer_keys import PairKey, pair_key
from tests.helpers import clients, poll_until
from tests.run_agents import RunAgent, loopback_env

TOKEN = "transfer-token-7c1e"
SERVICE = "/ifrt.topology.v1.Coordinator/"


def endpoint_of(receiver: ifrt.Client) -> tuple[str, int]:
    host, _, port = receiver.endpoint.address.rpartition(":")
    return host, int(port)


def proven(sender: ifrt.Client, receiver: ifrt.Client) -> socket.socket:
    """A raw socket into ``receiver``'s endpoint admitted as ``sender``'s process: the pair-key handshake, with the key
    the coordinator hands ``sender`` (what only that process can get)."""
    dst = receiver.process_id
    sock = socket.create_connection(endpoint_of(receiver), timeout=10)
    assert introduce(sock, sender.process_id, dst, key=sender.transfer_key(dst), token=None, what="the endpoint")
    sock.settimeout(None)
    return sock


def forged_plain(receiver: ifrt.Client, claims: int, token: str | None) -> socket.socket:
    """A raw socket from the claimed process's own address (loopback) saying it is process ``claims``, proving the
    cluster's token when given: all a token holder, or any member without a token, could do before keys."""
    sock = socket.create_connection(endpoint_of(receiver), timeout=10, source_address=("127.0.0.1", 0))
    sock.sendall(encode_header(HELLO, 0, claims, receiver.process_id))
    if token is not None:
        challenge = recv_all(sock, CHALLENGE_BYTES)
        sock.sendall(hmac.new(token.encode(), b"ifrt-transfer:" + challenge, hashlib.sha256).digest())
    return sock


def recv_all(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = sock.recv(n - len(got))
        assert more, f"closed after {len(got)} of {n} bytes"
        got += more
    return got


def frame(seq: int, src: int, dst: int, array: np.ndarray) -> bytes:
    return encode_header(ARRAY, seq, src, dst, array) + array.tobytes()


def crafted(seq: int, src: int, dst: int, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """An ARRAY header as a peer could craft it: any dtype text, shape and promised length."""
    return (HEADER.pack(MAGIC, VERSION, ARRAY, len(shape), len(dtype), seq, src, dst, nbytes) + dtype.encode()
            + struct.pack(f"!{len(shape)}Q", *shape))


def closed_by_the_endpoint(sock: socket.socket, within: float = 10.0) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def device(c: ifrt.Client, local: int = 0) -> int:
    return c.topology.local_devices[local].id


@pytest.fixture(params=["token", "no token"])
def trio(request, start_coordinator, tmp_path) -> Iterator[tuple[list[ifrt.Client], str | None]]:
    """Processes 0 (the receiver), 1 (a healthy sender) and 2 (another member) as Clients here; with and without the
    cluster's token."""
    token = TOKEN if request.param == "token" else None
    args: tuple[str, ...] = ()
    if token:
        path = tmp_path / "token"
        path.write_text(token + "\n")
        args = ("--token-file", str(path))
    coordinator = start_coordinator(*args, num_processes=3)
    made = clients(coordinator.address, 3, **({"token": token} if token else {}))
    yield made, token
    for c in made:
        c.close()


def test_a_forged_hello_claiming_another_process_is_refused_and_the_real_process_is_received(trio, caplog):
    (receiver, real, member), token = trio
    victim, dst = device(real), device(receiver)
    # A member (or token holder) claims process 1 with a key it can get: its own toward process 0.
    with socket.create_connection(endpoint_of(receiver), timeout=10) as keyed:
        assert not introduce(keyed, 1, 0, key=member.transfer_key(0), token=None, what="process 0")
        assert closed_by_the_endpoint(keyed)
    # The old hello: the token's answer (or, without one, process 1's address), then a frame from process 1's device.
    with forged_plain(receiver, claims=1, token=token) as plain:
        plain.sendall(frame(0, victim, dst, np.array([666])))
        assert closed_by_the_endpoint(plain)
    assert "it does not hold process 1's transfer key" in caplog.text
    assert "did not prove process 1's transfer key" in caplog.text
    with Channels(real.topology, real.endpoint) as out, Channels(receiver.topology, receiver.endpoint) as into:
        out.send(np.array([2]), dst)
        assert into.recv(victim, timeout=10).tolist() == [2]
        with pytest.raises(TransferTimeout):
            into.recv(victim, timeout=0.3)  # nothing forged waits behind it


def test_a_frame_from_another_process_device_on_an_authenticated_connection_fails_only_that_connection(trio, caplog):
    (receiver, real, member), _ = trio
    victim, dst = device(real), device(receiver)
    with proven(member, receiver) as attacker:  # genuinely process 2, sending as process 1's device
        attacker.sendall(frame(0, victim, dst, np.array([666])))
        assert closed_by_the_endpoint(attacker)
    assert "says it comes from device 131072, which is not a device of process 2" in caplog.text
    began = time.monotonic()
    with pytest.raises(TransferError, match=r"receiving from device 262144 \(process 2\) on device 0: transfer from "
                                            r"process 2 failed: frame 0 says it comes from device 131072"):
        receiver.endpoint.receive(device(member), dst, 2, timeout=10)  # the offender's own pair fails, at once
    assert time.monotonic() - began < 2
    with Channels(real.topology, real.endpoint) as out, Channels(receiver.topology, receiver.endpoint) as into:
        for i in range(3):  # the victim pair's receives from the real sender all succeed
            out.send(np.array([i]), dst)
        assert [into.recv(victim, timeout=10).tolist() for _ in range(3)] == [[0], [1], [2]]
    with Channels(member.topology, member.endpoint) as again, \
            Channels(receiver.topology, receiver.endpoint) as into:  # the offender reconnects cleanly: it works again
        again.send(np.array([7]), dst)
        assert poll_until(lambda: received(into, device(member)), timeout=10, what="process 2 again") == [7]


def received(into: Channels, src: int) -> list | None:
    try:
        return into.recv(src, timeout=0.2).tolist()
    except TransferError:
        return None


@pytest.mark.parametrize("poison", ["junk", "bad kind", "negative shape"])
def test_a_poisoned_header_fails_only_its_connection_not_later_receives_from_the_healthy_sender(trio, poison):
    (receiver, real, member), token = trio
    victim, dst = device(real), device(receiver)
    bad = {"junk": b"JUNK" + bytes(60), "bad kind": encode_header(HELLO, 0, victim, dst),
           "negative shape": crafted(0, device(member), dst, "<i4", (2**64 - 1,), 4)}[poison]
    with Channels(real.topology, real.endpoint) as out, Channels(receiver.topology, receiver.endpoint) as into:
        out.send(np.array([0]), dst)  # the healthy sender's connection is open before and after
        with forged_plain(receiver, claims=1, token=token) as stranger:  # as a token holder claiming process 1
            stranger.sendall(bad)
            assert closed_by_the_endpoint(stranger)
        with proven(member, receiver) as poisoned:  # and genuinely process 2
            poisoned.sendall(bad)
            assert closed_by_the_endpoint(poisoned)
        for i in range(1, 7):
            out.send(np.array([i]), dst)
        assert [into.recv(victim, timeout=10).tolist() for _ in range(7)] == [[i] for i in range(7)]
        with pytest.raises(TransferError, match=r"\(process 2\).*transfer from process 2 failed"):
            into.recv(device(member), timeout=5)


BOUND = 8 << 20
FRAME = np.zeros(1 << 18, dtype=np.float32)  # 1 MiB


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_frames_for_unread_pairs_past_the_bound_fail_the_sender_naming_the_bound_and_memory_stays_bounded(trio):
    (receiver, sender, _), _ = trio
    receiver.endpoint.max_held_bytes = BOUND
    src, dst = device(sender), device(receiver)
    before = rss_bytes()
    sent, failed = 0, None
    with Channels(sender.topology, sender.endpoint) as out:
        for _ in range(256):  # 256 MiB for a pair nobody reads
            try:
                out.send(FRAME, dst)
            except TransferError as e:
                failed = e
                break
            sent += FRAME.nbytes
        grown = rss_bytes() - before
        assert failed is not None, f"{sent} bytes sent to an unread pair and never refused"
        assert receiver.endpoint.held_bytes <= BOUND
        assert grown < 64 << 20, f"the receiving process grew by {grown >> 20} MiB"
        with Channels(receiver.topology, receiver.endpoint) as into:
            began = time.monotonic()
            with pytest.raises(TransferError, match=rf"frame \d+ from device {src} to device {dst} \(1048576 bytes\) "
                                                    rf"would pass the {BOUND}-byte bound \(8\.0 MiB\)"):
                into.recv(src, timeout=10)
            assert time.monotonic() - began < 2
            out.send(np.array([5]), dst)  # the sender connects again: its frames are received again
            assert poll_until(lambda: received(into, src), timeout=10, what="a frame after reconnecting") == [5]


def test_one_peer_filling_the_bound_does_not_fail_another_peers_frames(trio):
    (receiver, hog, other), _ = trio
    receiver.endpoint.max_held_bytes = BOUND
    dst = device(receiver)
    with Channels(hog.topology, hog.endpoint) as flood, Channels(other.topology, other.endpoint) as out, \
            Channels(receiver.topology, receiver.endpoint) as into:
        for _ in range(7):  # 7 of the 8 MiB, for a pair nobody reads
            flood.send(FRAME, dst)
        poll_until(lambda: receiver.endpoint.held_bytes >= 7 << 20, timeout=10, what="the hog's frames held")
        out.send(FRAME, dst)
        out.send(FRAME, dst)  # past the bound: the hog, holding the most, is failed and its frames dropped
        assert [into.recv(device(other), timeout=10).nbytes for _ in range(2)] == [FRAME.nbytes] * 2
        with pytest.raises(TransferError, match=r"process 1 held \d+ bytes of frames not received"):
            into.recv(device(hog), timeout=5)


@pytest.mark.parametrize("dtype", ["(-1,)i4", "|O", "(2,)<i4", "<i4,<i4", "int32"])
def test_a_bad_dtype_fails_the_waiting_receive_at_once_and_the_endpoint_lives_on(trio, dtype):
    (receiver, sender, _), _ = trio
    src, dst = device(sender), device(receiver)
    outcome: list[BaseException | float] = []

    def wait() -> None:
        began = time.monotonic()
        try:
            receiver.endpoint.receive(src, dst, 1, timeout=8)
        except TransferError as e:
            outcome.append(e)
        outcome.append(time.monotonic() - began)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.2)  # the receive waits before the frame comes
    with proven(sender, receiver) as sock:
        sock.sendall(crafted(0, src, dst, dtype, (1,), 4))
        assert closed_by_the_endpoint(sock)
    waiting.join(15)
    error, waited = outcome
    assert isinstance(error, TransferError) and not isinstance(error, TransferTimeout), error
    assert re.search(r"dtype .* in frame 0", str(error)) and "transfer from process 1 failed" in str(error)
    assert waited < 3, f"the receive waited {waited:.1f}s"
    with Channels(sender.topology, sender.endpoint) as out, Channels(receiver.topology, receiver.endpoint) as into:
        out.send(np.arange(3), dst)
        assert poll_until(lambda: received(into, src), timeout=10, what="a good frame") == [0, 1, 2]


def test_a_frame_for_a_device_of_another_process_is_refused(trio):
    (receiver, sender, member), _ = trio
    with proven(sender, receiver) as sock:
        sock.sendall(frame(0, device(sender), device(member), np.array([1])))
        assert closed_by_the_endpoint(sock)
    with pytest.raises(TransferError, match="is for device 262144, which is not a device of this process"):
        receiver.endpoint.receive(device(sender), device(receiver), 1, timeout=5)


def test_a_stale_cached_key_is_fetched_again_once(trio):
    (receiver, sender, _), _ = trio
    sender.endpoint.keys._toward[0] = PairKey(bytes(32), 0)  # as after process 0 restarted with a new secret
    with Channels(sender.topology, sender.endpoint) as out, Channels(receiver.topology, receiver.endpoint) as into:
        out.send(np.array([3]), device(receiver))
        assert into.recv(device(sender), timeout=10).tolist() == [3]
    secret_hash = proof_of(receiver.process_secret)
    assert sender.endpoint.keys.outgoing(0) == (pair_key(secret_hash, 1, 0, 0), 0)


# The TransferKey call itself.

def transfer_key(address: str, uid: str, peer: int, secret: str | None, token: str | None) -> tuple:
    metadata = (((SECRET_METADATA, secret),) if secret else ()) + (((TOKEN_METADATA, token),) if token else ())
    request = pb.TransferKeyRequest(client_uid=uid, peer_process_id=peer).SerializeToString()
    with grpc.insecure_channel(address) as channel:
        try:
            raw = channel.unary_unary(f"{SERVICE}TransferKey")(request, timeout=10, metadata=metadata)
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, pb.TransferKeyResponse.FromString(raw)


def test_the_coordinator_hands_a_pair_key_only_to_the_process_that_proves_it_is_itself(trio):
    (receiver, sender, member), token = trio
    address = sender.settings.coordinators[0]
    code, answer = transfer_key(address, sender.client_uid, 0, sender.process_secret, token)
    assert code == grpc.StatusCode.OK
    assert (answer.key, answer.process_id, answer.peer_process_id, answer.incarnation) == (
        pair_key(proof_of(receiver.process_secret), 1, 0, 0), 1, 0, 0)
    # Process 2 asking as process 1 (its uid, its own secret), a caller without a secret, an unknown caller or peer.
    assert transfer_key(address, sender.client_uid, 0, member.process_secret, token)[0] == \
        grpc.StatusCode.PERMISSION_DENIED
    assert transfer_key(address, sender.client_uid, 0, None, token)[0] == grpc.StatusCode.PERMISSION_DENIED
    assert transfer_key(address, "nobody", 0, member.process_secret, token)[0] == grpc.StatusCode.NOT_FOUND
    code, details = transfer_key(address, sender.client_uid, 9, sender.process_secret, token)
    assert code == grpc.StatusCode.NOT_FOUND and "no process 9 in the published topology" in details


WORKER = """
import numpy as np
import ifrt
with ifrt.Client(timeout=60) as client, client.channels() as channels:
    topology = client.discover()
    me = topology.process_id
    peer = next(d.id for d in topology.devices if d.process_id == 1 - me)
    channels.send(np.array([me + 10]), peer)
    print("got", me, channels.recv(peer, timeout=30).tolist(), flush=True)
    client.barrier("transferred", timeout=30)
"""


def test_workers_of_an_ifrt_run_agent_get_their_keys_through_it_and_transfer(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    agent = RunAgent("--nproc-per-host", "2", "--host-rank", "0", "--num-hosts", "1", "--",
                     sys.executable, "-c", WORKER, env=loopback_env(coordinator.address))
    try:
        assert agent.wait(60) == 0, agent.output()
        out = "\n".join(agent.out)
        assert "got 0 [11]" in out and "got 1 [10]" in out, agent.output()
    finally:
        agent.stop()


def test_a_keyed_hello_the_endpoint_cannot_check_is_refused(trio, caplog):
    (receiver, _, _), _ = trio
    with socket.create_connection(endpoint_of(receiver), timeout=10) as sock:
        sock.sendall(encode_header(HELLO, KEYED, 1, 5))  # to a process this endpoint is not
        assert closed_by_the_endpoint(sock)
    assert "it is addressed to process 5, this is process 0" in caplog.text
