"""A worker's transfer port cannot be taken between ``ifrt run``'s pick and the worker's bind: the agent keeps each
picked port listening and hands the socket itself to every worker of that rank (``IFRT_TRANSFER_FDS``), which accepts
on it. Real agent-side spawning (``ifrt.run.workers``), real worker processes, real sockets on loopback."""

from __future__ import annotations

import errno
import os
import socket
import sys

import pytest

from ifrt.errors import InvalidArgument
from ifrt.hostport import split_host_port
from ifrt.run.workers import Worker, transfer_binds
from ifrt.settings import TRANSFER_BIND_ENV, TRANSFER_FDS_ENV
from ifrt.transfer import adopted_listener

WORKER = """
import os, sys, time
from ifrt.transfer import Endpoint
endpoint = Endpoint(os.environ["IFRT_TRANSFER_BIND"])  # as a Client binds it
deadline = time.monotonic() + 20
while endpoint.open_connections < 1 and time.monotonic() < deadline:  # the test's connection, accepted here
    time.sleep(0.05)
sys.exit(0 if endpoint.open_connections == 1 else 3)
"""


def taken(port: int) -> socket.socket | None:
    """Another socket on this host binding ``port`` (as any program might, between the pick and the worker's bind);
    None when it cannot."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen()
    except OSError as e:
        assert e.errno == errno.EADDRINUSE, e
        sock.close()
        return None
    return sock


def test_a_port_taken_after_the_pick_neither_fails_the_worker_nor_its_restart():
    (bind,) = transfer_binds("127.0.0.1", 1)
    port = int(split_host_port(bind)[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    env[TRANSFER_BIND_ENV] = bind
    squatters = []
    for _ in ("first worker", "its restart"):
        squatter = taken(port)  # before the fix: the port was free here, the worker's bind then failed EADDRINUSE
        if squatter is not None:
            squatters.append(squatter)
        worker = Worker([sys.executable, "-c", WORKER], env, attempt=0, local_rank=0, label=None)
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            assert worker.wait() == 0  # its endpoint accepted the connection on the picked port
    for squatter in squatters:
        squatter.close()
    assert not squatters


def test_a_malformed_handed_descriptor_is_refused_naming_it_and_a_foreign_one_is_skipped(tmp_path):
    with pytest.raises(InvalidArgument, match=f"{TRANSFER_FDS_ENV}='127.0.0.1:1=x'.*address=descriptor"):
        adopted_listener("127.0.0.1:1", 1, {TRANSFER_FDS_ENV: "127.0.0.1:1=x"})
    with open(tmp_path / "f", "w") as f:  # a descriptor that is no listening socket: bind as before
        assert adopted_listener("127.0.0.1:1", 1, {TRANSFER_FDS_ENV: f"127.0.0.1:1={f.fileno()}"}) is None
    assert adopted_listener("127.0.0.1:1", 1, {TRANSFER_FDS_ENV: "127.0.0.1:2=3"}) is None  # not this address's
