"""Coordinator state in etcd: a kill -9 of the leader at any point loses nothing, etcd outages are survived.

Processes 1 and 2 are worker processes; process 0 is a Client in this test. Every scenario ends with every
process holding the topology a run without any kill produces: the same bytes, generation 1.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import grpc
import pytest

import ifrt
from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from tests.helpers import barrier_started_for, discover_process, finish, free_port, health, poll_until
from tests.replicas import LEADER_TTL, NUM, Replicas, client0, start_worker
from tests.workers import Worker

HEARTBEAT = "3"  # the replicas' default --heartbeat-timeout


COORDINATOR_SERVICE = "ifrt.topology.v1.Coordinator"


def wait_health(address: str, status: str, timeout: float = 30) -> None:
    """Waits until the health service at ``address`` reports the coordinator service ``status``."""
    poll_until(lambda: health(address, COORDINATOR_SERVICE), lambda seen: seen == status, timeout,
               f"{address} to report {status}")


@pytest.fixture(autouse=True)
def two_devices_here(monkeypatch):
    """Process 0 (in this test) has 2 devices, like the workers."""
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "2")


@pytest.fixture
def ports():
    """Fixed transfer ports per process id, so every run describes the same processes."""
    return {pid: free_port() for pid in range(NUM)}


def reference_fingerprint(ports: dict[int, int], cluster_id: str = "job") -> str:
    """The topology of the same processes against a plain in-memory coordinator, with no kill."""
    with LocalCoordinator("--cluster-id", cluster_id, num_processes=NUM) as coordinator:
        children = [discover_process(coordinator.address, "--process-id", str(pid), "--transfer-bind",
                                     f"127.0.0.1:{ports[pid]}", devices=2) for pid in range(NUM)]
        outputs = [finish(c) for c in children]
    assert all(code == 0 for code, _, _ in outputs), outputs
    return json.loads(outputs[0][1])["fingerprint"]


@pytest.fixture
def replicas(etcd):
    r = Replicas(etcd)
    yield r
    r.close()


def discover_in_thread(client: ifrt.Client) -> dict:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("topology", client.discover()))
    thread.start()
    result["thread"] = thread
    return result


def finish_all(client_result: dict, workers: list[Worker]) -> set[str]:
    client_result["thread"].join(90)
    fingerprints = {client_result["topology"].fingerprint}
    for w in workers:
        line = w.expect("topology", timeout=90)
        assert line["generation"] == 1
        fingerprints.add(line["topology"])
    return fingerprints


def test_leader_killed_before_any_registration(replicas, ports):
    expected = reference_fingerprint(ports)
    replicas.kill_leader()
    workers = [start_worker(replicas, pid, ports) for pid in (1, 2)]
    with client0(replicas, ports) as client:
        assert finish_all(discover_in_thread(client), workers) == {expected}
    for w in workers:
        w.stop()


def test_leader_killed_mid_registration(replicas, ports):
    expected = reference_fingerprint(ports)
    first = start_worker(replicas, 1, ports)
    replicas.leader.wait_for_log("registered process 1")
    dead = replicas.kill_leader()
    assert "registered process 1" not in replicas.leader.log  # it learnt process 1 from the journal, not a retry
    second = start_worker(replicas, 2, ports)
    with client0(replicas, ports) as client:
        assert finish_all(discover_in_thread(client), [first, second]) == {expected}
    assert "replayed 1 journal entries" in replicas.leader.log, (replicas.leader.log, dead.log)
    for w in (first, second):
        w.stop()


def test_leader_killed_after_publication(replicas, ports):
    expected = reference_fingerprint(ports)
    workers = [start_worker(replicas, 1, ports, "--kv-set", "nccl/id=abc"), start_worker(replicas, 2, ports)]
    with client0(replicas, ports) as client:
        lost, restored = threading.Event(), threading.Event()
        client.on_event(lambda e: (lost if isinstance(e, ifrt.events.CoordinatorLost) else restored).set()
                        if isinstance(e, ifrt.events.CoordinatorLost | ifrt.events.CoordinatorRestored) else None)
        assert finish_all(discover_in_thread(client), workers) == {expected}
        workers[0].expect("kv_set")
        assert client.wait_attached(10)
        replicas.kill_leader()
        assert lost.wait(20) and restored.wait(30)
        assert client.kv_get("nccl/id", timeout=30) == b"abc"  # acknowledged before the kill, so kept
        assert client.topology.fingerprint == expected and client.topology.generation == 1
        # Deliberately let time pass: one second beyond the grace the new leader gave everyone to re-attach.
        time.sleep(float(HEARTBEAT) + 1)
        assert "failed" not in replicas.leader.log
        for w in workers:
            assert [line for line in list(w.lines.queue) if line.get("event") == "ProcessFailed"] == []
    for w in workers:
        w.stop()


def test_leader_killed_during_a_barrier(replicas, ports):
    expected = reference_fingerprint(ports)
    workers = [start_worker(replicas, 1, ports, "--barrier", "step-1"),
               start_worker(replicas, 2, ports, "--barrier", "step-1", "--barrier-when-told")]
    with client0(replicas, ports) as client:
        assert finish_all(discover_in_thread(client), workers) == {expected}
        outcome: list = []

        def arrive():
            try:
                client.barrier("step-1", timeout=90)
                outcome.append("ok")
            except ifrt.IfrtError as e:
                outcome.append(e)

        thread = threading.Thread(target=arrive)
        thread.start()
        # The leader holds the barrier, which cannot complete: process 2 has not been told to arrive.
        seen = barrier_started_for(replicas.leader.address, client, "step-1")
        assert "barrier 'step-1' was started for processes [0, 1, 2]" in seen
        dead = replicas.kill_leader()
        assert dead.process.returncode == -signal.SIGKILL and thread.is_alive() and outcome == []
        workers[1].tell("arrive")  # process 2 arrives only now, at the standby that took over
        workers[1].expect("arriving", timeout=30)
        thread.join(90)
        assert outcome == ["ok"]  # the call started on the dead leader completed on the standby
        for w in workers:
            assert w.expect("barrier", timeout=60)["barrier"] == "ok"
    for w in workers:
        w.stop()


def test_one_etcd_member_down_of_three(etcd3, ports):
    expected = reference_fingerprint(ports)
    leader = etcd3.leader(timeout=5)
    etcd3.kill(leader if leader is not None else 0)
    replicas = Replicas(etcd3)
    try:
        workers = [start_worker(replicas, pid, ports) for pid in (1, 2)]
        with client0(replicas, ports) as client:
            assert finish_all(discover_in_thread(client), workers) == {expected}
        for w in workers:
            w.stop()
    finally:
        replicas.close()


def test_etcd_outage_is_reported_then_survived(etcd, ports):
    expected = reference_fingerprint(ports)
    coordinator = LocalCoordinator("--store", etcd.url, "--leader-ttl", LEADER_TTL, "--cluster-id", "job",
                                   num_processes=NUM)
    try:
        coordinator.wait_for_log("serving:")
        first = Worker(coordinator.address, 1, NUM, transfer_port=ports[1])
        coordinator.wait_for_log("registered process 1")
        etcd.stop_all()
        second = Worker(coordinator.address, 2, NUM, transfer_port=ports[2])
        coordinator.wait_for_log("stepping down: ")
        # the registration's write fails first, or (on a loaded machine, the registration later) the lease expires
        assert re.search(r"stepping down: (the store failed: cannot write the journal to etcd|leadership lost)",
                         coordinator.log), coordinator.log
        coordinator.wait_for_log("etcd is unreachable")
        wait_health(coordinator.address, "NOT_SERVING")
        etcd.restart_all()
        client = ifrt.Client(coordinator.address, process_id=0, num_processes=NUM, timeout=90,
                             transfer_bind=f"127.0.0.1:{ports[0]}")
        with client:
            assert finish_all(discover_in_thread(client), [first, second]) == {expected}
        assert health(coordinator.address, COORDINATOR_SERVICE) == "SERVING"
        for w in (first, second):
            w.stop()
    finally:
        coordinator.close()


def test_clusters_with_different_ids_share_one_etcd(etcd):
    a = LocalCoordinator("--store", etcd.url, "--cluster-id", "job-a", num_processes=1)
    b = LocalCoordinator("--store", etcd.url, "--cluster-id", "job-b", num_processes=1)
    try:
        a.wait_for_log("serving:")
        b.wait_for_log("serving:")  # each cluster has its own leader
        outputs = [finish(discover_process(c.address, "--process-id", "0")) for c in (a, b)]
        assert all(code == 0 for code, _, _ in outputs), outputs
        topologies = [json.loads(out) for _, out, _ in outputs]
        assert [t["cluster_id"] for t in topologies] == ["job-a", "job-b"]
    finally:
        a.close()
        b.close()


def test_health_says_who_serves(replicas):
    standby = next(c for c in replicas.all if c is not replicas.leader)
    wait_health(replicas.leader.address, "SERVING")
    wait_health(standby.address, "NOT_SERVING")
    replicas.kill_leader()
    wait_health(standby.address, "SERVING")


def test_a_standby_names_the_leader(replicas):
    standby = next(c for c in replicas.all if c is not replicas.leader)
    standby.wait_for_log(f"standing by: the coordinator at {replicas.leader.address} leads")
    request = pb.RegisterRequest(client_uid="u", hostname="h", process_id=0, plugin="cpu").SerializeToString()
    with grpc.insecure_channel(standby.address) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/ifrt.topology.v1.Coordinator/Register")(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"the coordinator at {replicas.leader.address} leads" in info.value.details()
