"""With real etcd: job attempts never see each other's state, and increments survive a leader kill exactly once."""

from __future__ import annotations

import signal
import threading

import pytest

import ifrt
from coordinator.local import LocalCoordinator
from tests.helpers import clients
from tests.replicas import LEADER_TTL, Replicas, kill_the_leader_midway


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


def test_increments_from_four_processes_survive_a_leader_kill_exactly_once(etcd, coordination_workers):
    with Replicas(etcd, num_processes=5, cluster_id="counting", heartbeat="5") as replicas:
        counting = [coordination_workers(replicas.addresses, i, 5, "increment", "counter", "1000") for i in range(4)]
        with kill_the_leader_midway(replicas, 4, 5, lambda c: int(c.kv_try_get("counter") or b"0") >= 1000,
                                    "1000 increments before the kill") as client:
            lasts = [w.expect("incremented", timeout=300)["last"] for w in counting]
            assert max(lasts) == 4000
            assert client.kv_get("counter", timeout=30) == b"4000"
