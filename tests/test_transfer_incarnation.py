"""Transfers are bound to the sender's incarnation: a process declared failed (a gray failure or a partition: it lives
on) and replaced keeps what it held, its pair key and its admitted connection, yet its peer closes that connection as
it learns of the failure and refuses the old incarnation's fresh handshakes, counting them; the replacement's frames
are received. Real coordinator, a real old process (SIGSTOP: alive to the kernel, silent to the coordinator), real
sockets on loopback.

Run as a script, this file is that old process (``old_sender``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ifrt
from ifrt.errors import TransferError, TransferTimeout
from ifrt.events import ProcessFailed, ProcessRestarted
from ifrt.ids import LOCAL_ID_BITS
from ifrt.protocol import proof_of
from ifrt.transfer import Channels
from ifrt.transfer.frames import ARRAY, encode_header
from ifrt.transfer.handshake import introduce
from ifrt.transfer_keys import PairKey, pair_key
from tests.helpers import clients, poll_until

HEARTBEAT_TIMEOUT = "1"
WAIT_S = 30.0
ROOT = Path(__file__).resolve().parents[1]


def frame(seq: int, src: int, dst: int, value: int) -> bytes:
    array = np.array([value])
    return encode_header(ARRAY, seq, src, dst, array) + array.tobytes()


def old_sender(address: str) -> None:
    """Process 1's first incarnation: admitted to process 0 with its pair key, it sends [100]; then, on each stdin
    command, acts with what it held before it was declared failed and prints what happened as a JSON line."""
    client = ifrt.Client(address, process_id=1, num_processes=2, timeout=30)
    topology = client.discover()
    assert client.endpoint is not None and client.endpoint.keys is not None
    key = client.endpoint.keys.outgoing(0)  # cached, as a sender caches it
    host, _, port = topology.process(0).address.rpartition(":")
    src, dst = topology.local_devices[0].id, 0  # device 0: process 0's first

    def connect() -> tuple[socket.socket, bool]:
        sock = socket.create_connection((host, int(port)), timeout=10)
        try:
            return sock, introduce(sock, 1, 0, key=key, token=None, what="process 0")
        except (OSError, TransferError):
            return sock, False

    held, admitted = connect()
    assert admitted
    held.sendall(frame(0, src, dst, 100))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "held":  # the connection admitted before: was it closed? then a frame on it anyway
            held.settimeout(10)
            try:
                closed = held.recv(1) == b""
            except (ConnectionResetError, TimeoutError) as e:
                closed = isinstance(e, ConnectionResetError)
            with contextlib.suppress(OSError):
                held.sendall(frame(1, src, dst, 101))
            print(json.dumps({"held_closed": closed}), flush=True)
        elif command == "fresh":  # a new handshake with the key cached before the cut, then a frame
            sock, admitted = connect()
            if admitted:
                sock.sendall(frame(0, src, dst, 102))
            print(json.dumps({"fresh_admitted": admitted}), flush=True)
        elif command == "channels":  # the library's own send, told it was declared failed
            try:
                Channels(topology, client.endpoint).send(np.array([103]), dst)
                print(json.dumps({"channels": "sent"}), flush=True)
            except TransferError as e:
                print(json.dumps({"channels": str(e)}), flush=True)


class OldProcess:
    def __init__(self, address: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        self.process = subprocess.Popen([sys.executable, "-m", "tests.test_transfer_incarnation", address], env=env,
                                        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, command: str) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the old process exited ({self.process.poll()}) instead of answering {command!r}"
        return json.loads(line)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def test_pair_keys_differ_per_sender_incarnation():
    assert pair_key("h" * 64, 1, 0, 0) != pair_key("h" * 64, 1, 0, 1)
    with pytest.raises(ValueError, match="incarnation -1"):
        pair_key("h" * 64, 1, 0, -1)


def test_a_later_incarnation_proving_itself_fences_the_older_one_without_any_event(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    receiver, sender = clients(coordinator.address, 2)
    try:
        host, _, port = receiver.endpoint.address.rpartition(":")
        src, dst = 1 << LOCAL_ID_BITS, receiver.topology.local_devices[0].id
        old_key = sender.transfer_key(0)
        assert old_key.incarnation == 0
        # What the coordinator would hand process 1's next incarnation (the test knows process 0's secret).
        new_key = PairKey(pair_key(proof_of(receiver.process_secret), 1, 0, 1), 1)

        def proven(key: PairKey) -> tuple[socket.socket, bool]:
            sock = socket.create_connection((host, int(port)), timeout=10)
            return sock, introduce(sock, 1, 0, key=key, token=None, what="process 0")

        held, admitted = proven(old_key)
        assert admitted
        held.sendall(frame(0, src, dst, 1))
        into = Channels(receiver.topology, receiver.endpoint)
        assert into.recv(src, timeout=WAIT_S).tolist() == [1]
        new, admitted = proven(new_key)
        assert admitted
        held.settimeout(10)
        assert held.recv(1) == b""  # closed as the later incarnation proved itself
        assert not proven(old_key)[1]  # and the old one's fresh handshake refused
        new.sendall(frame(0, src, dst, 2))
        assert into.recv(src, timeout=WAIT_S).tolist() == [2]
        assert receiver.endpoint.fenced.connections == 1 and receiver.endpoint.fenced.handshakes == 1
    finally:
        for c in (receiver, sender):
            c.close()


def test_a_replaced_incarnation_is_closed_and_refused_and_the_replacement_is_received(start_coordinator, caplog):
    coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, num_processes=2)
    old = OldProcess(coordinator.address)
    receiver = ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=30)
    heard: list = []
    receiver.on_event(heard.append)
    replacement = None
    try:
        receiver.discover()
        assert old.ask("") == {"ready": True}
        src, dst = 1 << LOCAL_ID_BITS, receiver.topology.local_devices[0].id  # process 1's first device
        into = Channels(receiver.topology, receiver.endpoint)
        assert into.recv(src, timeout=WAIT_S).tolist() == [100]  # before the cut: the old incarnation's frame
        assert receiver.wait_attached(10)
        os.kill(old.process.pid, signal.SIGSTOP)  # alive to the kernel, its connections open; silent to gRPC
        try:
            poll_until(lambda: [e for e in heard if isinstance(e, ProcessFailed) and e.process_id == 1],
                       timeout=WAIT_S, what="process 1 declared failed")
            replacement = ifrt.Client(coordinator.address, process_id=1, num_processes=2, timeout=30)
            replacement.discover()
            poll_until(lambda: [e for e in heard if isinstance(e, ProcessRestarted) and e.process_id == 1],
                       timeout=WAIT_S, what="process 1 replaced")
        finally:
            os.kill(old.process.pid, signal.SIGCONT)
        assert old.ask("held") == {"held_closed": True}  # closed by process 0 once it heard of the failure
        assert old.ask("fresh") == {"fresh_admitted": False}  # its cached key is its old incarnation's
        said = old.ask("channels")["channels"]
        assert "declared failed" in said, said
        with Channels(replacement.topology, replacement.endpoint) as out:
            out.send(np.array([200]), dst)
            assert into.recv(src, timeout=WAIT_S).tolist() == [200]  # the replacement's, and never 101, 102, 103
        with pytest.raises(TransferTimeout):
            into.recv(src, timeout=0.5)
        fenced = receiver.endpoint.fenced
        assert fenced.connections >= 1 and fenced.handshakes >= 1, fenced
        assert "from an old incarnation of process 1" in caplog.text
    finally:
        old.stop()
        for c in (receiver, replacement):
            if c is not None:
                c.close()


if __name__ == "__main__":
    old_sender(sys.argv[1])
