"""A coordinator that outlives its job, with real processes and a real coordinator process: a re-run starts a new run
of the job with one generation of its own processes, a second job is refused by name while the first is live, a
killed process still takes its id back, and a process that left waits for the next run."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import time

import grpc
import pytest

import ifrt
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.errors import ERROR_TRAILER
from ifrt.protocol import SECRET_METADATA
from tests.helpers import clients, discover_process, finish, in_thread, register_request, status_json
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


DOUBLE_LAUNCHED = """
import json, sys, time, ifrt
from ifrt import events
seen = []
client = ifrt.Client(timeout=30)
client.on_event(seen.append)
topology = client.discover()
time.sleep(float(sys.argv[1]))
evicted = [str(e) for e in seen if isinstance(e, (events.ProcessFailed, events.CoordinatorLost))
           and getattr(e, "process_id", topology.process_id) == topology.process_id]
print(json.dumps({"process_id": topology.process_id, "fingerprint": topology.fingerprint, "evicted": evicted}))
client.close()
"""


def test_a_job_launched_twice_at_once_forms_one_run_and_evicts_nobody(start_coordinator):
    """A scheduler's retry or a second press of enter: two launches of one 4-process job at the same moment. Each id
    goes to one process, which keeps it; the other launch's process is refused by name (ProcessIdTaken), never taken
    for a restart of a live process that was answered and is attaching its session."""
    rng = random.Random(39)
    for _ in range(4):
        coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, num_processes=4)
        env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        env.update(IFRT_COORDINATOR=coordinator.address, IFRT_NUM_PROCESSES="4", IFRT_CPU_DEVICE_COUNT="1")
        launched = []
        for rank in [r for _launch in range(2) for r in range(4)]:
            time.sleep(rng.uniform(0, 0.03))
            launched.append(subprocess.Popen([sys.executable, "-c", DOUBLE_LAUNCHED, "3"], text=True,
                                             env={**env, "IFRT_LOCAL_RANK": str(rank)},
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        results = [finish(child, 60) for child in launched]
        held = [json.loads(out) for code, out, _ in results if code == 0]
        refused = [err for code, _, err in results if code != 0]
        assert sorted(h["process_id"] for h in held) == [0, 1, 2, 3], results
        assert len({h["fingerprint"] for h in held}) == 1, held  # one run, one topology
        assert [h["evicted"] for h in held] == [[]] * 4, held
        assert len(refused) == 4 and all("ProcessIdTaken" in err for err in refused), refused
        assert "replaced by a restarted process" not in coordinator.log
        coordinator.close()


def test_runs_and_attempts_are_typed_fields_and_event_numbers_never_go_back(start_coordinator):
    """Each run's answers and attach events say which run and attempt they belong to, its events number on from the
    run before, and a session opened for an ended run is refused as stale (it registers again)."""
    coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, num_processes=1)
    channel = grpc.insecure_channel(coordinator.address)
    stub = CoordinatorStub(channel)

    def register(uid: str) -> pb.RegisterResponse:
        request = register_request(0, client_uid=uid, num_processes=1)
        return stub.Register(request, metadata=((SECRET_METADATA, uid),), timeout=30)

    def session(uid: str, run: int, since: int) -> pb.SessionEvent:
        opening = pb.SessionRequest(open=pb.SessionOpen(client_uid=uid, since_event=since, run=run))
        call = stub.Session(iter([opening]), metadata=((SECRET_METADATA, uid),), timeout=10)
        first = next(call)
        call.cancel()
        return first

    first = register("run-1")
    assert (first.run, first.attempt, first.event_position) == (1, 0, 1)
    assert session("run-1", 1, first.event_position).attached.run == 1
    requests: queue.Queue = queue.Queue()  # a session of run 1 kept open past its process's leave
    opening = pb.SessionRequest(open=pb.SessionOpen(client_uid="run-1", since_event=first.event_position, run=1))
    requests.put(opening)
    kept = stub.Session(iter(requests.get, None), metadata=((SECRET_METADATA, "run-1"),), timeout=30)
    assert next(kept).attached.run == 1
    stub.Leave(pb.LeaveRequest(client_uid="run-1"), metadata=((SECRET_METADATA, "run-1"),), timeout=10)  # event 2
    second = register("run-2")
    shutdown = next(e for e in kept if e.WhichOneof("kind") == "shutdown").shutdown
    assert (shutdown.ended_run, shutdown.next_run, shutdown.ended_attempt, shutdown.next_attempt) == (1, 2, 0, 0)
    requests.put(None)
    assert (second.run, second.attempt) == (2, 0)
    assert second.event_position > 2  # run 2's events go on from run 1's last: a position never goes back
    attached = session("run-2", 2, second.event_position).attached
    assert (attached.run, attached.attempt, attached.generation) == (2, 0, 1)
    with pytest.raises(grpc.RpcError) as refused:
        session("run-2", 1, second.event_position)  # opened as if for the ended run
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(refused.value.trailing_metadata())[ERROR_TRAILER] == "StaleSession"
    assert "run 1 of attempt 0 of the job, which ended: the job is in run 2" in refused.value.details()
    channel.close()


def test_a_restart_of_a_process_killed_before_its_session_attached_waits_and_takes_its_id(start_coordinator):
    """Killed between its answer and its session: its restart is neither refused nor taken for a second launch's
    eviction of a live process; it waits until the coordinator declares the old one failed, then takes its id."""
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2)
    channel = grpc.insecure_channel(coordinator.address)
    stub = CoordinatorStub(channel)

    def register(uid: str) -> pb.RegisterResponse:
        request = register_request(0, client_uid=uid, num_processes=2, opens_session=True, wait_ms=20_000)
        return stub.Register(request, metadata=((SECRET_METADATA, uid),), timeout=30)

    answered = in_thread(lambda: register("killed-before-attaching"))  # it never opens its session (killed then)
    with ifrt.Client(coordinator.address, process_id=1, num_processes=2, transfer=False, timeout=30) as survivor:
        survivor.discover()
        first = answered.get(timeout=30)
        started = time.monotonic()
        again = register("its-restart")
        waited = time.monotonic() - started
        assert (again.process_id, again.fingerprint, again.run) == (0, first.fingerprint, first.run)  # same run
        assert 0.5 < waited < 20  # held until the old one was declared failed (about the 1 s heartbeat timeout)
        coordinator.wait_for_log("waiting for process 0")
        coordinator.wait_for_log("restarted")
    channel.close()
