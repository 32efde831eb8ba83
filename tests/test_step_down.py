"""A replica that is alive but no longer leads sends every waiting call on at once, with UNAVAILABLE, so its
clients finish on the new leader instead of waiting out their own timeouts on the old one."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import ifrt
from coordinator.local import LocalCoordinator
from tests.replicas import serving

WAIT_S = 60.0
MOVED_ON_WITHIN_S = 25.0
"""Far below WAIT_S: a waiter that moves on does so within a second; one left behind waits WAIT_S or more."""


@pytest.fixture
def two_replicas(etcd):
    args = ("--store", etcd.url, "--leader-ttl", "2", "--heartbeat-timeout", "30", "--cluster-id", "step-down")
    replicas = [LocalCoordinator(*args, num_processes=2, log_level="DEBUG") for _ in range(2)]
    yield replicas
    for r in replicas:
        if r.process.poll() is None:
            os.kill(r.pid, signal.SIGCONT)  # never leave a stopped process behind
        r.close()


def in_thread(work) -> dict:
    result: dict = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as e:
            result["error"] = e

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def finished(result: dict, timeout: float):
    result["thread"].join(timeout)
    assert not result["thread"].is_alive(), f"still waiting after {timeout}s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_pending_barrier_and_key_value_read_finish_on_the_new_leader(two_replicas, monkeypatch):
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "1")
    first = serving(*two_replicas)
    standby = next(r for r in two_replicas if r is not first)
    addresses = ",".join([first.address, standby.address])
    clients = [ifrt.Client(addresses, process_id=pid, num_processes=2, timeout=60) for pid in range(2)]
    try:
        discovering = [in_thread(c.discover) for c in clients]
        for d in discovering:
            finished(d, 60)
        barrier = in_thread(lambda: clients[0].barrier("step-1", timeout=WAIT_S))
        reading = in_thread(lambda: clients[0].kv_get("bootstrap/id", timeout=WAIT_S))
        first.wait_for_log("barrier 'step-1': a process arrived and waits")
        first.wait_for_log("key-value get of 'bootstrap/id' waits")

        os.kill(first.pid, signal.SIGSTOP)  # alive, but silent past its lease: the standby takes over
        standby.wait_for_log("serving:", timeout=30)
        os.kill(first.pid, signal.SIGCONT)
        resumed = time.monotonic()
        first.wait_for_log("stepping down", timeout=30)

        clients[1].kv_set("bootstrap/id", b"\x01\x02")
        clients[1].barrier("step-1", timeout=WAIT_S)
        assert finished(reading, MOVED_ON_WITHIN_S) == b"\x01\x02"
        assert finished(barrier, MOVED_ON_WITHIN_S) is None
        assert time.monotonic() - resumed < MOVED_ON_WITHIN_S
        assert first.process.poll() is None  # the old leader is alive: it stepped down, it did not die
    finally:
        for c in clients:
            c.close()
