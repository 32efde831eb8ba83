"""With real etcd: job attempts never see each other's state, and increments survive a leader kill exactly once."""

from __future__ import annotations

import signal
import threading
import time

import pytest

import ifrt
from coordinator.local import LocalCoordinator
from tests.test_coordination import clients, coordination_worker

LEADER_TTL = "2"


def serving(*coordinators: LocalCoordinator, timeout: float = 30) -> LocalCoordinator:
    """The one of ``coordinators`` that leads, once it serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in coordinators:
            if c.process.poll() is None and "serving:" in c.log:
                return c
        time.sleep(0.05)
    raise AssertionError("no replica serves:\n" + "\n---\n".join(c.log for c in coordinators))


def test_a_new_attempt_sees_nothing_of_the_last_and_refuses_its_processes(etcd):
    args = ("--store", etcd.url, "--cluster-id", "job", "--leader-ttl", LEADER_TTL)
    first = LocalCoordinator(*args, "--attempt", "1", num_processes=2)
    try:
        old = clients(first.address, 2, attempt=1)
        old[0].kv_set("jax/coordinator", b"10.0.0.1:1234")
        threads = [threading.Thread(target=c.barrier, args=("step-100", 30)) for c in old]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert old[1].kv_try_get("jax/coordinator") == b"10.0.0.1:1234"
    finally:
        first.stop(signal.SIGKILL)  # the whole job dies: coordinator first, then its processes
    for c in old:
        c.close()

    second = LocalCoordinator(*args, "--attempt", "2", num_processes=2)
    try:
        second.wait_for_log("serving:")
        assert "attempt 2 of the job starts with an empty journal; attempt 1 is fenced off" in second.log
        new = clients(second.address, 2, attempt=2)
        assert new[0].kv_try_get("jax/coordinator") is None
        assert new[0].kv_dir("") == {}
        with pytest.raises(ifrt.BarrierTimeout, match="1 of 2 processes did not arrive"):
            new[0].barrier("step-100", timeout=1)  # not the old result: this attempt's barrier waits for its peer
        with ifrt.Client(second.address, process_id=1, num_processes=2, timeout=30, attempt=1) as stale, \
                pytest.raises(ifrt.ClusterMismatch) as info:
            stale.discover()
        assert "belongs to attempt 1 of the job; this coordinator serves attempt 2 of cluster 'job'" in str(info.value)
        replica_of_1 = LocalCoordinator(*args, "--attempt", "1", num_processes=2)  # a stale replica comes back
        try:
            replica_of_1.wait_for_log("this replica serves attempt 1, but attempt 2 of the job has started")
        finally:
            replica_of_1.close()
        for c in new:
            c.close()
    finally:
        second.close()


def test_increments_from_eight_processes_survive_a_leader_kill_exactly_once(etcd):
    args = ("--store", etcd.url, "--cluster-id", "counting", "--leader-ttl", LEADER_TTL, "--heartbeat-timeout", "5")
    replicas = [LocalCoordinator(*args, num_processes=9) for _ in range(2)]
    addresses = ",".join(c.address for c in replicas)
    workers = []
    try:
        leader = serving(*replicas)
        workers = [coordination_worker(addresses, i, 9, "increment", "counter", "1000") for i in range(8)]
        with ifrt.Client(addresses, process_id=8, num_processes=9, timeout=90) as client:
            client.discover()
            while int(client.kv_try_get("counter") or b"0") < 2000:  # polling the count, not a guess of time
                time.sleep(0.05)
            leader.stop(signal.SIGKILL)
            serving(*(c for c in replicas if c is not leader))
            lasts = [w.expect("incremented", timeout=300)["last"] for w in workers]
            assert max(lasts) == 8000
            assert client.kv_get("counter", timeout=30) == b"8000"
    finally:
        for w in workers:
            w.stop()
        for c in replicas:
            c.close()
