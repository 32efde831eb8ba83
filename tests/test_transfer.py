"""Array transfers between real processes over the topology's endpoints."""

from __future__ import annotations

import logging
import math
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import numpy as np
import pytest

import ifrt
from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.errors import InvalidArgument, TransferError, TransferTimeout
from ifrt.transfer import Channels, Endpoint, wait_seconds
from ifrt.transfer.frames import ARRAY, HEADER, HELLO, MAGIC, VERSION, encode_header
from ifrt.transfer.handshake import introduce
from tests.helpers import poll_until, register_request, status_json
from tests.netns import Hosts, skip_without_netns
from tests.resources import open_fds

ECHO = Path(__file__).with_name("echo_worker.py")
DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]


@pytest.fixture
def pair(start_coordinator):
    """Process 0 here (a Client) and process 1 in an echo worker; yields (client, channels, start_echo)."""
    coordinator = start_coordinator(num_processes=2)
    workers: list[subprocess.Popen] = []

    def start_echo(count: int, max_descriptors: int | None = None, stderr: IO | None = None) -> subprocess.Popen:
        """The echo worker, with at most ``max_descriptors`` open descriptors when given (its own limit only)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        env.update(IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID="1", IFRT_NUM_PROCESSES="2")

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_descriptors, max_descriptors))

        worker = subprocess.Popen([sys.executable, str(ECHO), "--count", str(count)], env=env,
                                  stdout=subprocess.PIPE, stderr=stderr, text=True,
                                  preexec_fn=limit if max_descriptors else None)
        workers.append(worker)
        return worker

    client = ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=60)
    yield client, start_echo
    client.close()
    for worker in workers:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGKILL)
        worker.wait()


def arrays():
    rng = np.random.default_rng(0)
    for dtype in DTYPES:
        for shape in [(), (0,), (7,), (2, 3, 4)]:
            yield (rng.standard_normal(shape) * 100).astype(dtype)
    yield np.arange(24.0).reshape(4, 6)[:, ::2]  # not contiguous


def test_arrays_of_common_dtypes_and_shapes_round_trip(pair):
    client, start_echo = pair
    sent = list(arrays())
    worker = start_echo(len(sent))
    topology = client.discover()
    assert worker.stdout.readline().strip() == "ready"
    peer = next(d.id for d in topology.devices if d.process_id == 1)
    with client.channels() as channels:
        for array in sent:
            channels.send(array, peer)
        for array in sent:
            back = channels.recv(peer, timeout=60)
            assert back.dtype == array.dtype and back.shape == array.shape
            assert np.array_equal(back, array)
        assert channels.open_connections == 1  # one socket to the peer, reused for every array
        client.barrier("echo-done", timeout=60)
    assert worker.wait(30) == 0


def test_a_large_array_round_trips(pair):
    client, start_echo = pair
    worker = start_echo(1)
    topology = client.discover()
    peer = next(d.id for d in topology.devices if d.process_id == 1)
    big = np.arange(64 << 20, dtype=np.float32)  # 256 MiB
    with client.channels() as channels:
        channels.send(big, peer)
        back = channels.recv(peer, timeout=120)
        assert back.nbytes == 256 << 20 and np.array_equal(back, big)
        client.barrier("echo-done", timeout=60)
    assert worker.wait(30) == 0


def test_transfers_within_one_process_touch_no_socket(start_coordinator, monkeypatch):
    coordinator = start_coordinator(num_processes=1)
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "2")
    with ifrt.Client(coordinator.address, process_id=0, timeout=30) as client, client.channels() as channels:
        first, second = (d.id for d in client.discover().local_devices)
        channels.send(np.arange(5), second, src_device=first)
        assert channels.recv(first, dst_device=second).tolist() == [0, 1, 2, 3, 4]
        assert channels.open_connections == 0
        assert client.endpoint.open_connections == 0


def raw_peer(topology: ifrt.Topology, sender: ifrt.Client | None = None) -> socket.socket:
    """A socket to process 0's endpoint that says it is process 1: proven with process 1's pair key when ``sender``
    (process 1's client) is given, which frames need; else with the plain hello only (a probe: it carries no frames)."""
    host, _, port = topology.process(0).address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    if sender is None:
        sock.sendall(encode_header(HELLO, 0, 1, 0))
        return sock
    assert introduce(sock, 1, 0, key=sender.transfer_key(0), token=None, what="process 0")
    sock.settimeout(None)
    return sock


@pytest.fixture
def two_clients(start_coordinator):
    """Processes 0 and 1 as two clients here, each with its own endpoint listening on a real socket."""
    coordinator = start_coordinator(num_processes=2)
    other = ifrt.Client(coordinator.address, process_id=1, num_processes=2, timeout=30)
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=30)
    t = threading.Thread(target=other.discover)
    t.start()
    client.discover()
    t.join(30)
    assert other.topology is not None, "process 1 did not discover within 30s"
    yield client, other
    client.close()
    other.close()


@pytest.fixture
def half(two_clients):
    """Process 0 here; process 1 registered (so the topology has it) but speaking through raw sockets, proven with
    the pair key its client gets from the coordinator."""
    client, other = two_clients
    return client, client.topology, other


def test_peer_dying_mid_frame_is_a_clear_error(half):
    client, topology, other = half
    peer = 1 << 17
    with raw_peer(topology, other) as sock:
        sock.sendall(encode_header(ARRAY, 0, peer, 0, np.zeros(1 << 18)))  # promises 2 MiB
        sock.sendall(b"\0" * 100)
    with Channels(topology, client.endpoint) as channels, pytest.raises(
            TransferError, match="closed the connection mid-frame: got 100 of 2097152 bytes"):
        channels.recv(peer, timeout=10)


def test_bad_frames_are_clear_errors(half):
    client, topology, other = half
    with raw_peer(topology, other) as sock:
        sock.sendall(b"JUNK" + b"\0" * 60)
    with Channels(topology, client.endpoint) as channels, pytest.raises(TransferError, match="bad frame header"):
        channels.recv(1 << 17, timeout=10)


def array_frame(seq: int, src: int, dst: int, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """An ARRAY frame's header as a peer could craft it: any shape, any promised payload length."""
    return (HEADER.pack(MAGIC, VERSION, ARRAY, len(shape), len(dtype), seq, src, dst, nbytes) + dtype.encode()
            + struct.pack(f"!{len(shape)}Q", *shape))


@pytest.mark.parametrize(("shape", "nbytes", "why"), [
    ((1 << 32, 1 << 32), 0, r"says 0 payload bytes for shape \(4294967296, 4294967296\)"),  # wraps to 0 in uint64
    ((1 << 63,), 8, r"has a dimension over 9223372036854775807"),
    ((1 << 60,), (1 << 60) * 8, r"\(9223372036854775808 bytes\) would pass the 1073741824-byte bound"),
], ids=["product overflows", "dimension overflows", "too big to hold"])
def test_a_frame_whose_shape_no_array_can_have_is_a_clear_error_and_the_endpoint_lives_on(half, shape, nbytes, why):
    client, topology, other = half
    peer = 1 << 17
    with raw_peer(topology, other) as sock:
        sock.sendall(array_frame(0, peer, 0, "<f8", shape, nbytes))
        began = time.monotonic()
        with pytest.raises(TransferError, match=f"transfer from process 1 failed: frame 0.*{why}"):
            client.endpoint.receive(peer, 0, 1, timeout=10)
        assert time.monotonic() - began < 5  # told at once, not after the receive's timeout
        assert closed_by_the_endpoint(sock)
    with raw_peer(topology, other) as again:  # the endpoint still accepts, and takes a good frame from another device
        again.sendall(encode_header(ARRAY, 0, peer + 1, 0, np.arange(3.0)) + np.arange(3.0).tobytes())

        def received() -> list | None:  # until it lands, a receive from process 1 names its failed connection
            try:
                return client.endpoint.receive(peer + 1, 0, 1, timeout=0.1).tolist()
            except TransferError:
                return None
        assert poll_until(received, timeout=10, what="the good frame") == [0.0, 1.0, 2.0]


def test_a_skipped_sequence_number_is_refused(start_coordinator, half):
    client, topology, other = half
    with raw_peer(topology, other) as sock:
        sock.sendall(encode_header(ARRAY, 1, 1 << 17, 0, np.zeros(2)) + np.zeros(2).tobytes())
        with Channels(topology, client.endpoint) as channels, pytest.raises(
                TransferError, match="frame 1 from device 131072 to device 0: expected frame 0"):
            channels.recv(1 << 17, timeout=10)


def test_sending_to_a_dead_peer_is_a_clear_error(pair):
    client, start_echo = pair
    worker = start_echo(1)
    client.discover()
    assert worker.stdout.readline().strip() == "ready"
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    with client.channels() as channels, pytest.raises(TransferError, match="process 1"):
        for _ in range(100):  # the first writes may still land in the socket buffer
            channels.send(np.zeros(1 << 20), 1 << 17)


def test_nothing_arriving_times_out_naming_the_source(half):
    client, topology, _ = half
    with Channels(topology, client.endpoint) as channels, pytest.raises(
            TransferTimeout, match="nothing arrived from device 131072 \\(process 1\\)"):
        channels.recv(1 << 17, timeout=0.2)


def test_threads_sending_on_one_pair_put_frames_on_the_wire_in_order(two_clients):
    sender, receiver = two_clients
    src, dst = sender.topology.local_devices[0].id, receiver.topology.local_devices[0].id
    threads, per_thread = 8, 300
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: races show up at once
    start = threading.Barrier(threads)
    failures: list[BaseException] = []

    def send_all(thread: int) -> None:
        try:
            start.wait(timeout=30)
            for i in range(per_thread):
                out.send(np.array([thread, i]), dst, src_device=src)
        except BaseException as e:  # reported by the main thread
            failures.append(e)

    try:
        with Channels(sender.topology, sender.endpoint) as out, \
                Channels(receiver.topology, receiver.endpoint) as into:
            senders = [threading.Thread(target=send_all, args=(t,)) for t in range(threads)]
            for t in senders:
                t.start()
            got = [into.recv(src, dst_device=dst, timeout=30).tolist() for _ in range(threads * per_thread)]
            for t in senders:
                t.join(30)
    finally:
        sys.setswitchinterval(previous)
    assert not failures
    for thread in range(threads):  # each thread's frames arrive all, in the order it sent them
        assert [i for t, i in got if t == thread] == list(range(per_thread))


def test_recv_without_a_timeout_waits_the_finite_default(half):
    client, topology, _ = half
    with Channels(topology, client.endpoint, recv_timeout=0.2) as channels, pytest.raises(
            TransferTimeout, match=r"nothing arrived from device 131072 \(process 1\) for device 0 within 0\.2s"):
        channels.recv(1 << 17, timeout=None)


def test_recv_from_a_local_device_without_a_timeout_waits_the_finite_default(start_coordinator, monkeypatch):
    coordinator = start_coordinator(num_processes=1)
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "2")
    with ifrt.Client(coordinator.address, process_id=0, timeout=30) as client:
        topology = client.discover()
        with Channels(topology, client.endpoint, recv_timeout=0.2) as channels, pytest.raises(
                TransferTimeout, match=r"nothing arrived from local device 1 within 0\.2s"):
            channels.recv(1, dst_device=0)


@pytest.mark.parametrize(("timeout", "default", "seconds"), [
    (None, 60.0, 60.0),
    (None, 0.5, 0.5),
    (0, 60.0, 0.0),
    (2.5, 60.0, 2.5),
    (np.int64(3), 60.0, 3.0),
])
def test_wait_seconds_are_finite(timeout, default, seconds):
    assert wait_seconds(timeout, default) == seconds


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1.0, "10", [1]])
def test_unbounded_or_malformed_timeouts_are_refused(timeout):
    with pytest.raises(InvalidArgument, match=r"receive timeout .* is not a finite number of seconds"):
        wait_seconds(timeout, 60.0)


# Bounded under attack: silent peers, strangers and floods cost an endpoint a bounded number of descriptors,
# threads and log lines, and members keep talking.

def connect_from(source: str, address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))


def closed_by_the_endpoint(sock: socket.socket, within: float = 10.0) -> bool:
    """Whether the endpoint ends the connection within ``within`` seconds (a reset too: it left data unread)."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("sent", [b"", encode_header(HELLO, 0, 1, 0)[:20]], ids=["nothing", "half a hello"])
def test_a_peer_silent_before_its_hello_is_closed_after_the_handshake_timeout(sent, caplog):
    endpoint = Endpoint("127.0.0.1:0", handshake_timeout=0.5)
    try:
        with connect_from("127.0.0.1", endpoint.address) as silent:
            silent.sendall(sent)
            assert closed_by_the_endpoint(silent, within=20)  # 40 handshake timeouts
        poll_until(lambda: endpoint.open_connections == 0, what="the closed connection leaves the endpoint")
        assert "no valid hello within 0.5s" in caplog.text
    finally:
        endpoint.close()


def test_a_peer_sending_its_hello_a_byte_at_a_time_gets_no_more_than_the_handshake_timeout():
    endpoint = Endpoint("127.0.0.1:0", handshake_timeout=0.5)
    hello = encode_header(HELLO, 0, 1, 0)
    try:
        with connect_from("127.0.0.1", endpoint.address) as slow:
            sent = 0
            with pytest.raises(OSError):  # the endpoint hangs up: a write then fails
                for byte in hello:  # each byte well within the timeout, the whole hello far beyond it
                    slow.sendall(bytes([byte]))
                    sent += 1
                    time.sleep(0.2)
        assert sent < len(hello) // 2, f"the endpoint read {sent} of the hello's {len(hello)} bytes"
    finally:
        endpoint.close()


def test_connections_that_close_leave_the_endpoint(two_clients):
    client, other = two_clients
    for _ in range(200):
        with raw_peer(client.topology):
            pass
    for _ in range(20):  # and connections made by Channels, the way a job makes them
        with Channels(other.topology, other.endpoint) as out:
            out.send(np.arange(3), client.topology.local_devices[0].id)
    poll_until(lambda: client.endpoint.open_connections == 0, what="200 closed connections leave the endpoint")
    with Channels(client.topology, client.endpoint) as into:
        for _ in range(20):
            assert into.recv(other.topology.local_devices[0].id, timeout=10).tolist() == [0, 1, 2]


def test_a_stranger_claiming_a_member_from_another_address_is_refused_and_members_still_talk(two_clients, caplog):
    client, other = two_clients
    with connect_from("127.0.0.2", other.endpoint.address) as stranger:  # process 0 is at 127.0.0.1
        stranger.sendall(encode_header(HELLO, 0, 0, 1))
        stranger.sendall(b"JUNK" + b"\0" * 60)  # what would fail process 1's next receive from process 0
        assert closed_by_the_endpoint(stranger)
    assert re.search(r"refused a transfer connection from \('127\.0\.0\.2', \d+\) \(says process 0\): it connects "
                     r"from 127\.0\.0\.2, but process 0 is at 127\.0\.0\.1", caplog.text), caplog.text
    src, dst = client.topology.local_devices[0].id, other.topology.local_devices[0].id
    with Channels(client.topology, client.endpoint) as out, Channels(other.topology, other.endpoint) as into:
        out.send(np.arange(4), dst)
        assert into.recv(src, timeout=10).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(("says", "to", "why"), [
    (7, 1, "topology generation 1 has no process 7"),
    (0, 0, "it is addressed to process 0, this is process 1"),
], ids=["no such process", "another destination"])
def test_a_hello_the_topology_does_not_match_is_refused(two_clients, caplog, says, to, why):
    _, other = two_clients
    with connect_from("127.0.0.1", other.endpoint.address) as peer:
        peer.sendall(encode_header(HELLO, 0, says, to))
        assert closed_by_the_endpoint(peer)
    assert why in caplog.text


def test_a_flood_of_strangers_is_one_log_line_and_a_count(two_clients, caplog):
    _, other = two_clients
    for _ in range(50):
        with connect_from("127.0.0.2", other.endpoint.address) as stranger:
            stranger.sendall(encode_header(HELLO, 0, 0, 1))
            assert closed_by_the_endpoint(stranger)
    assert caplog.text.count("refused a transfer connection") == 1
    assert other.endpoint._noisy.held_back("stranger") == 49
    other.endpoint.close()  # the count is written when the endpoint closes
    assert "49 more stranger records held back" in caplog.text


def test_an_endpoint_without_a_token_or_keys_says_transfers_are_unauthenticated_once_it_serves_a_job(
        start_coordinator, caplog):
    caplog.set_level(logging.INFO, logger="ifrt.transfer")
    unused = Endpoint("127.0.0.1:0")  # bound by a discovery that then failed: nothing to say yet
    unused.close()
    assert "unauthenticated" not in caplog.text
    coordinator = start_coordinator(num_processes=1)
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, timeout=30, session=False) as client:
        topology = client.discover()
        assert "unauthenticated" not in caplog.text  # a client's endpoint takes frames proven by pair keys only
        bare = Endpoint("127.0.0.1:0")  # one made without a client has no keys
        try:
            bare.expect(topology)
            bare.expect(topology)
            said = f"transfers to {bare.address} are unauthenticated (no cluster token)"
            assert caplog.text.count(said) == 1
            # INFO, not a warning in every process of the job: the coordinator warns the operator once
            assert [r.levelno for r in caplog.records if said in r.getMessage()] == [logging.INFO]
        finally:
            bare.close()


def test_a_coordinator_without_a_token_says_any_client_may_call_it(start_coordinator, tmp_path):
    bare = start_coordinator(num_processes=1)
    bare.wait_for_log("no cluster token (--token-file): any client that reaches")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    guarded = start_coordinator("--token-file", str(token), num_processes=1)
    assert "no cluster token" not in guarded.log


SILENT = 300
"""Silent connections held open against a worker limited to ``DESCRIPTORS`` descriptors (the issue's attack:
375 against 256 ended the endpoint for good)."""
DESCRIPTORS = 64


def test_an_endpoint_out_of_descriptors_keeps_accepting_and_members_still_talk(pair, tmp_path):
    client, start_echo = pair
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log_file:
        worker = start_echo(1, max_descriptors=DESCRIPTORS, stderr=log_file)
    topology = client.discover()
    assert worker.stdout.readline().strip() == "ready"
    baseline = open_fds(worker.pid)
    assert baseline < DESCRIPTORS - 20, f"the worker holds {baseline} descriptors before the attack"
    host, _, port = topology.process(1).address.rpartition(":")
    silent = []
    try:
        for _ in range(SILENT):  # non-blocking: the kernel completes them while the endpoint is out of descriptors
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex((host, int(port)))
            silent.append(sock)
        poll_until(lambda: "cannot accept connections" in log_path.read_text(), what="the worker ran out")
        peer = 1 << 17
        with client.channels() as channels:  # while the silent connections are still open
            channels.send(np.arange(10), peer)
            assert channels.recv(peer, timeout=60).tolist() == list(range(10))
    finally:
        for sock in silent:
            sock.close()
    poll_until(lambda: open_fds(worker.pid) <= baseline + 10, what="the worker lets go of the silent connections")
    client.barrier("echo-done", timeout=60)
    assert worker.wait(30) == 0
    lines = log_path.read_text().splitlines()
    assert 1 <= sum("cannot accept connections" in line for line in lines) <= 5, lines[-20:]


SENDER = """
import sys
import numpy as np
import ifrt
with ifrt.Client(timeout=60) as client, client.channels() as channels:
    peer = next(d.id for d in client.discover().devices if d.process_id == 1)
    print("ready", flush=True)
    sys.stdin.readline()
    channels.send(np.arange(5), peer)
    print(channels.recv(peer, timeout=60).tolist(), flush=True)
    client.barrier("echo-done", timeout=60)
"""
STRANGER = """
import socket, sys
from ifrt.transfer.frames import HELLO, encode_header
with socket.create_connection((sys.argv[1], 9000), timeout=10) as stranger:
    stranger.sendall(encode_header(HELLO, 0, 0, 1) + b"JUNK" + bytes(60))  # says it is process 0
    try:
        print("closed" if stranger.recv(1) == b"" else "answered", flush=True)
    except ConnectionResetError:
        print("closed", flush=True)
"""


def test_between_hosts_a_stranger_is_refused_and_members_transfer(tmp_path):
    skip_without_netns()
    with Hosts(3) as hosts:
        coordinator = LocalCoordinator(num_processes=2, bind=f"{hosts.address(1)}:8476",
                                       wrapper=hosts.command(1, []))
        env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        env.update(IFRT_COORDINATOR=coordinator.address, IFRT_NUM_PROCESSES="2")
        worker_log = tmp_path / "worker.log"
        with open(worker_log, "w") as log_file:
            worker = subprocess.Popen(hosts.command(3, [sys.executable, str(ECHO), "--count", "1"]),
                                      env={**env, "IFRT_PROCESS_ID": "1",
                                           "IFRT_TRANSFER_BIND": f"{hosts.address(3)}:9000"},
                                      stdout=subprocess.PIPE, stderr=log_file, text=True)
        sender = subprocess.Popen(hosts.command(2, [sys.executable, "-c", SENDER]), env={**env, "IFRT_PROCESS_ID": "0"},
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout.readline().strip() == "ready"
            assert worker.stdout.readline().strip() == "ready"
            stranger = subprocess.run(hosts.command(1, [sys.executable, "-c", STRANGER, hosts.address(3)]),
                                      capture_output=True, text=True, timeout=60)
            assert stranger.stdout.strip() == "closed", stranger.stderr
            sender.stdin.write("go\n")
            sender.stdin.flush()
            assert sender.stdout.readline().strip() == "[0, 1, 2, 3, 4]"
            assert sender.wait(60) == 0 and worker.wait(60) == 0
        finally:
            for child in (sender, worker):
                if child.poll() is None:
                    os.kill(child.pid, signal.SIGKILL)
                child.wait()
            coordinator.close()
        assert (f"refused a transfer connection from ('{hosts.address(1)}'" in worker_log.read_text()
                and f"but process 0 is at {hosts.address(2)}" in worker_log.read_text()), worker_log.read_text()


@pytest.fixture(scope="module")
def untouched() -> Iterator[LocalCoordinator]:
    """A coordinator of 2 processes that the tests below only ever refuse: each checks nothing was admitted."""
    with LocalCoordinator(num_processes=2) as coordinator:
        yield coordinator


@pytest.mark.parametrize(("address", "why"), [
    ("node001", "it has no port"),
    ("fe80::1:8476", "an IPv6 address goes in brackets"),
    ("evil host:80", "is not a host name or an address"),
    ("127.0.0.1:99999", "port '99999' is not a number from 1 to 65535"),
])
def test_a_registration_whose_transfer_address_is_not_host_port_is_refused_and_changes_nothing(
        untouched, address, why):
    coordinator = untouched
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(register_request(0, address=address, num_processes=2), timeout=10)
        status = stub.Status(pb.StatusRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the transfer endpoint address {address!r} is not an address: " in refused.value.details()
    assert why in refused.value.details() and "expected HOST:PORT" in refused.value.details()
    assert (status.registered, list(status.processes)) == (0, [])


@pytest.mark.parametrize(("bind", "why"), [
    ("127.0.0.1", "it has no port"),
    ("127.0.0.1:http", "port 'http' is not a number from 0 to 65535"),
    ("fe80::1:0", "an IPv6 address goes in brackets"),
])
def test_a_transfer_bind_that_is_not_host_port_is_refused_by_the_client_naming_it(untouched, bind, why):
    coordinator = untouched
    expected = re.escape(f"the transfer endpoint's bind address {bind!r} is not an address: ") + f".*{why}"
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=2, transfer_bind=bind, timeout=10)
    with client, pytest.raises(InvalidArgument, match=expected + ".*expected HOST:PORT"):
        client.discover()
    assert status_json(coordinator.address)["registered"] == 0  # refused before any call
    with pytest.raises(InvalidArgument, match="advertised host 'a b' is not a host name or an address: expected"):
        Endpoint("127.0.0.1:0", advertise_host="a b")
