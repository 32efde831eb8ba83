"""A coordinator that outlives its job, with real processes and a real coordinator process: a re-run starts a new run
of the job with one generation of its own processes, a second job is refused by name while the first is live, a
killed process still takes its id back, and a process that left waits for the next run."""

from __future__ import annotations

import queue
import time

from tests.helpers import clients, discover_process, finish, status_json
from tests.replicas import Replicas

HEARTBEAT_TIMEOUT = "2"


def drained(worker) -> list[dict]:
    """Every line the worker printed so far that no ``expect`` read."""
    lines = []
    while True:
        try:
            lines.append(worker.lines.get_nowait())
        except queue.Empty:
            return lines


def run_of(workers, address: str, n: int, devices: int, **options) -> list:
    """``n`` processes (explicit ids) of ``devices`` devices each; each one's topology line, once all have it."""
    started = [workers(address, pid, n, devices=devices, transfer_port=0, **options) for pid in range(n)]
    return started, [w.expect("topology", timeout=60) for w in started]


def test_a_rerun_against_the_same_daemon_forms_one_generation_of_its_own_processes(start_coordinator, workers):
    coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, num_processes=4)
    first, lines = run_of(workers, coordinator.address, 4, devices=2)
    assert len({line["topology"] for line in lines}) == 1
    for w in first:
        w.stop()  # the job ends: each process leaves
        w.expect("closed")
    _, lines = run_of(workers, coordinator.address, 4, devices=3)  # the re-run, as a job's next launch
    assert len({(line["topology"], line["generation"]) for line in lines}) == 1, lines  # same bytes everywhere
    assert {line["generation"] for line in lines} == {1}
    assert [line["process_id"] for line in lines] == [0, 1, 2, 3]
    coordinator.wait_for_log("run 2 starts")
    assert " restarted (incarnation" not in coordinator.log  # no new process was taken for a restart of an old one
    assert coordinator.log.count("published generation 1: 4 processes, 12 devices") == 1
    assert "published generation 2" not in coordinator.log


def test_a_second_job_is_refused_by_name_while_the_first_is_live(start_coordinator, workers):
    coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, num_processes=2)
    first = [workers(coordinator.address, None, 2, env={"IFRT_LOCAL_RANK": str(rank)}) for rank in range(2)]
    lines = [w.expect("topology", timeout=60) for w in first]
    for w in first:
        w.expect("attached")
    second = [discover_process(coordinator.address, "--num-processes", "2", env={"IFRT_LOCAL_RANK": str(rank)},
                               timeout=30) for rank in range(2)]
    started = time.monotonic()
    for child in second:
        code, out, err = finish(child, 60)
        assert code == 1 and out == "", err
        assert "ProcessIdTaken" in err and "held by a live process on " in err, err
        assert "is another job using this coordinator? give it its own --cluster-id or coordinator" in err, err
    assert time.monotonic() - started < 20  # refused at once, not after the 30 s timeout
    for w, line in zip(first, lines, strict=True):  # the first job is untouched: no event reached it
        assert not [seen for seen in drained(w) if "event" in seen]
        assert line["generation"] == 1
    assert "published generation 2" not in coordinator.log


def test_a_killed_process_restarted_takes_its_id_back_in_the_same_run(start_coordinator, workers):
    coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, num_processes=3)
    started, _ = run_of(workers, coordinator.address, 3, devices=2)
    for w in started:
        w.expect("attached")
    started[1].kill9()
    started[0].expect("event", event="ProcessFailed", process_id=1)
    again = workers(coordinator.address, 1, 3, devices=2, transfer_port=0)
    line = again.expect("topology", timeout=60)
    assert (line["process_id"], line["generation"]) == (1, 2)  # its new address: the next generation of this run
    assert started[0].expect("event", event="TopologyChanged")["fingerprint"] == line["topology"]
    assert started[2].expect("event", event="ProcessRestarted", process_id=1)
    assert "run 2 starts" not in coordinator.log


def test_a_process_that_left_waits_for_the_next_run(start_coordinator, workers):
    coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, num_processes=3)
    started, _ = run_of(workers, coordinator.address, 3, devices=2)
    started[1].stop()  # leaves on purpose
    started[1].expect("closed")
    started[0].expect("event", event="ProcessLeft", process_id=1)
    back = workers(coordinator.address, 1, 3, devices=2, transfer_port=0)
    coordinator.wait_for_log("a registration waits for the next run: waiting for run 1 of the job to end")
    assert "2 of its processes are still live: 0 (" in coordinator.log and ", 2 (" in coordinator.log
    time.sleep(2.0)
    assert not [seen for seen in drained(back) if "topology" in seen]  # not published beside those it left
    for w in (started[0], started[2]):
        w.stop()
    coordinator.wait_for_log("every process of run 1 of the job left or failed")
    rest = [workers(coordinator.address, pid, 3, devices=2, transfer_port=0) for pid in (0, 2)]
    lines = [w.expect("topology", timeout=60) for w in (rest[0], back, rest[1])]
    assert len({line["topology"] for line in lines}) == 1 and {line["generation"] for line in lines} == {1}
    assert [line["process_id"] for line in lines] == [0, 1, 2]
    assert "run 2 starts" in coordinator.log


def test_a_new_run_and_its_keys_survive_a_failover(etcd):
    """The start of a run is journaled: the replica that takes over serves the same run, none of the run before."""
    with Replicas(etcd, num_processes=2, cluster_id="reruns") as replicas:
        old = clients(replicas.addresses, 2)
        old[0].kv_set("nccl/id", b"run-1")
        for c in old:
            c.close()  # the job ends
        new = clients(replicas.addresses, 2)  # the re-run: the next run of the job
        try:
            assert new[0].kv_try_get("nccl/id") is None
            new[0].kv_set("nccl/id", b"run-2")
            fingerprint = new[0].topology.fingerprint
            replicas.kill_leader()
            assert new[1].kv_get("nccl/id", timeout=30) == b"run-2"  # served by the new leader, from the journal
            assert "run 2 starts" not in replicas.leader.log  # replayed, not decided again
            status = status_json(replicas.addresses)
            assert (status["generation"], status["fingerprint"]) == (1, fingerprint)
        finally:
            for c in new:
                c.close()
