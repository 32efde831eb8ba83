"""Array transfers between real processes over the topology's endpoints."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import ifrt
from ifrt.errors import InvalidArgument
from ifrt.transfer import ARRAY, HELLO, Channels, TransferError, TransferTimeout, encode_header, wait_seconds

ECHO = Path(__file__).with_name("echo_worker.py")
DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128]


@pytest.fixture
def pair(start_coordinator):
    """Process 0 here (a Client) and process 1 in an echo worker; yields (client, channels, start_echo)."""
    coordinator = start_coordinator(num_processes=2)
    workers: list[subprocess.Popen] = []

    def start_echo(count: int) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        env.update(IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID="1", IFRT_NUM_PROCESSES="2")
        worker = subprocess.Popen([sys.executable, str(ECHO), "--count", str(count)], env=env,
                                  stdout=subprocess.PIPE, text=True)
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
        assert client.endpoint._peers == []


def raw_peer(topology: ifrt.Topology) -> socket.socket:
    """A socket to this process's endpoint that speaks as process 1 would."""
    host, _, port = topology.process(0).address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(encode_header(HELLO, 0, 1, 0))
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
    """Process 0 here; process 1 registered (so the topology has it) but speaking through raw sockets."""
    client, _ = two_clients
    return client, client.topology


def test_peer_dying_mid_frame_is_a_clear_error(half):
    client, topology = half
    peer = 1 << 17
    with raw_peer(topology) as sock:
        sock.sendall(encode_header(ARRAY, 0, peer, 0, np.zeros(1 << 18)))  # promises 2 MiB
        sock.sendall(b"\0" * 100)
    with Channels(topology, client.endpoint) as channels, pytest.raises(
            TransferError, match="closed the connection mid-frame: got 100 of 2097152 bytes"):
        channels.recv(peer, timeout=10)


def test_bad_frames_are_clear_errors(half):
    client, topology = half
    with raw_peer(topology) as sock:
        sock.sendall(b"JUNK" + b"\0" * 60)
    with Channels(topology, client.endpoint) as channels, pytest.raises(TransferError, match="bad frame header"):
        channels.recv(1 << 17, timeout=10)


def test_a_skipped_sequence_number_is_refused(start_coordinator, half):
    client, topology = half
    with raw_peer(topology) as sock:
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
    client, topology = half
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
    client, topology = half
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
