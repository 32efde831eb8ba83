"""One connection per process: discovery and the live session share it, with no probe before the first call; the
client's tunables (``ClientConfig``) are the ones it runs by."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import pytest

import ifrt
from ifrt.client_config import ClientConfig


class CountingRelay:
    """A loopback TCP relay in front of ``target``: counts the connections clients open to it, forwards each."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            upstream = socket.create_connection(self._target)
            self._sockets += [conn, upstream]
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def relay(start_coordinator) -> Iterator[CountingRelay]:
    relay = CountingRelay(start_coordinator(num_processes=1).address)
    yield relay
    relay.close()


def test_discovery_and_the_session_take_one_connection_and_no_probe(relay):
    with ifrt.Client(relay.address, process_id=0, num_processes=1, transfer=False, timeout=30) as client:
        assert client.discover().num_processes == 1
        assert client.wait_attached(30)
        client.kv_set("k", b"v")
        assert client.kv_get("k", timeout=30) == b"v"
        assert relay.accepted == 1  # a TLS/plaintext probe would be a second connection, before the first call


def test_the_client_runs_by_its_config(start_coordinator, caplog):
    coordinator = start_coordinator(num_processes=2)
    config = ClientConfig(poll_s=0.2)  # one Register call waits at most this long: a progress line after each
    caplog.set_level(logging.INFO, logger="ifrt.wait")
    with ifrt.Client(coordinator.address, process_id=0, transfer=False, timeout=2.0, config=config) as client, \
            pytest.raises(ifrt.DiscoveryTimeout, match=r"missing process ids \[1\]"):
        client.discover()
    lines = [r for r in caplog.records if r.getMessage().startswith("waiting for the topology")]
    assert len(lines) >= 4, [r.getMessage() for r in lines]  # the default (1.5 s, then 5 s per call): one in 2 s


@pytest.mark.parametrize(("field", "value"), [("poll_s", 0), ("events_kept", -1), ("backoff_cap_s", float("inf"))])
def test_a_tunable_out_of_range_is_named(field, value):
    with pytest.raises(ifrt.InvalidArgument, match=f"ClientConfig {field}={value!r} is out of range"):
        ClientConfig(**{field: value})
