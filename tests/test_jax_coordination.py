"""JAX's coordination served by ifrt (ifrt/jax/xla_standin/): no process is special, and a failover is not JAX's.

Real JAX processes (jaxlib 0.10 in the suite's interpreter, 0.4.30 in IFRT_TEST_JAX04_PYTHON: the two service names
XLA's protocol has had) against a real coordinator, or real replicas on a real etcd.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coordinator.local import LocalCoordinator
from ifrt.errors import PeerFailed
from tests.helpers import finish
from tests.replicas import Replicas
from tests.requirements import jax_python
from tests.workers import start_jax_workers

pytest.importorskip("jax")

STEPS_WORKER = Path(__file__).with_name("jax_steps_worker.py")
JAXLIBS = ["0.10", "0.4.30"]


def wait_for_step(workers: list[subprocess.Popen], step: int, timeout: float = 60) -> None:
    """Reads each worker's ``step <n>`` lines until every one has passed ``step``."""
    reached = [-1] * len(workers)
    deadline = time.monotonic() + timeout
    while min(reached) < step:
        assert time.monotonic() < deadline, f"steps reached {reached}, waited for {step}"
        ready, _, _ = select.select([w.stdout for w in workers], [], [], 0.5)
        for i, w in enumerate(workers):
            if w.stdout in ready:
                line = w.stdout.readline()
                assert line, f"worker {i} ended early: {finish(w, timeout=5)}"
                if line.startswith("step "):
                    reached[i] = int(line.split()[1])


@pytest.mark.parametrize("jaxlib", JAXLIBS)
def test_process_0_killed_every_other_process_ends_naming_it_in_ifrts_words(jaxlib):
    python = jax_python(jaxlib)
    # jaxlib 0.4.30's CPU collectives abort their process from C++ on a broken peer connection (cpu_runtime.cc), so
    # there the kill falls between steps; jaxlib 0.10's raise, and the kill falls in the middle of computing.
    interval = "0.05" if jaxlib == "0.10" else "1"
    with LocalCoordinator("--heartbeat-timeout", "4", num_processes=4) as coordinator:
        workers = start_jax_workers(coordinator.address, 4, "", devices=1, python=python, worker=STEPS_WORKER,
                                    extra_env={p: {"INTERVAL": interval} for p in range(4)})
        try:
            wait_for_step(workers, 2)
            killed = time.monotonic()
            workers[0].kill()
            ends = [(finish(w, timeout=30), time.monotonic() - killed) for w in workers[1:]]
        finally:
            for w in workers:
                w.kill()
    for (code, _, err), after in ends:
        assert code == PeerFailed.exit_code, err[-3000:]
        assert "ifrt: JAX job failed: process 0 (" in err, err[-3000:]
        assert "Terminating process" not in err and "detected fatal errors" not in err, err[-3000:]
        assert after < 10, f"ended {after:.1f} s after the kill"  # the benchmark measures it: 0.5 s grace here


def test_a_leader_failover_mid_job_is_invisible_to_jax(etcd):
    with Replicas(etcd, num_processes=2) as replicas:
        workers = start_jax_workers(replicas.addresses, 2, "", devices=1, worker=STEPS_WORKER,
                                    extra_env={p: {"STEPS": "60", "INTERVAL": "0.1"} for p in range(2)})
        try:
            wait_for_step(workers, 10)
            replicas.kill_leader()
            outputs = [finish(w, timeout=90) for w in workers]
        finally:
            for w in workers:
                w.kill()
    for code, out, err in outputs:
        assert code == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["steps"] == 60 and result["service_here"] is False
        assert result["committed"] == 60  # every step's vote, across the failover, kept it


@pytest.mark.parametrize("jaxlib", JAXLIBS)
def test_a_local_topology_unlike_ifrts_is_refused_in_every_process_naming_both(start_coordinator, jaxlib):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    workers = start_jax_workers(coordinator.address, 2, "", devices=1, python=jax_python(jaxlib),
                                worker=STEPS_WORKER, extra_env={p: {"SCENARIO": "refuse"} for p in range(2)})
    answers = {}
    for w in workers:
        code, out, err = finish(w, timeout=60)
        assert code == 0, err[-3000:]
        answer = json.loads(out.strip().splitlines()[-1])
        answers[answer["process_id"]] = answer
    for answer in answers.values():
        assert "INVALID_ARGUMENT" in answer["error"], answer
        assert "JAX's local topology gives process 1" in answer["error"], answer
        assert "3 devices [TFRT_CPU_0, TFRT_CPU_1, TFRT_CPU_2]" in answer["error"], answer
        assert "ifrt's topology (generation 1) 1 device [cpu:0]" in answer["error"], answer
    assert answers[0]["after_s"] < 15  # the waiting process hears of it at once, not at its 30 s timeout


def test_a_temporary_directory_too_deep_for_a_socket_serves_jax_from_tmp(start_coordinator, tmp_path):
    import grpc

    import ifrt
    from ifrt._generated import xla_coordination_pb2 as xla_pb
    from ifrt.hostport import MAX_SOCKET_PATH
    from ifrt.jax.xla_standin.server import StandInServer
    from ifrt.jax.xla_standin.service import CoordinationStandIn

    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path))))  # room for no socket inside it
    deep.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = Path(tempfile.mkdtemp(prefix=f"ifrt-xla-p{gone.pid}-", dir="/tmp"))  # a SIGKILLed process's, left behind
    (left / "coordination.sock").touch()
    alive = Path(tempfile.mkdtemp(prefix="ifrt-xla-p1-", dir="/tmp"))  # pid 1's: it runs
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=30) as client:
        server = StandInServer(CoordinationStandIn(client, client.discover(), "test/deep"), within=str(deep))
        try:
            assert len(os.fsencode(server.path)) <= MAX_SOCKET_PATH
            assert server.path.startswith(f"/tmp/ifrt-xla-p{os.getpid()}-")
            assert oct(Path(server.path).parent.stat().st_mode & 0o777) == "0o700" and list(deep.iterdir()) == []
            assert not left.exists() and alive.exists()  # a gone process's directory removed, a live one's kept
            with grpc.insecure_channel(server.address) as channel:
                heartbeat = channel.unary_unary("/xla.coordination.CoordinationService/Heartbeat",
                                                request_serializer=xla_pb.HeartbeatRequest.SerializeToString,
                                                response_deserializer=xla_pb.HeartbeatResponse.FromString)
                incarnations = xla_pb.Incarnations(service_incarnation=server.standin.incarnation)
                heartbeat(xla_pb.HeartbeatRequest(incarnations=incarnations, source_task_id=0), timeout=10)
        finally:
            server.close()
            shutil.rmtree(alive, ignore_errors=True)
        assert not Path(server.path).parent.exists()


def test_the_stand_in_refuses_calls_for_another_task_or_start_and_stays_private(start_coordinator):
    import grpc

    import ifrt
    from ifrt._generated import tensorflow_coordination_pb2 as tf_pb
    from ifrt._generated import xla_coordination_pb2 as xla_pb
    from ifrt.jax.xla_standin.server import StandInServer
    from ifrt.jax.xla_standin.service import CoordinationStandIn

    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=30) as client:
        topology = client.discover()
        server = StandInServer(CoordinationStandIn(client, topology, "test/bad-input"))
        try:
            assert oct(Path(server.path).parent.stat().st_mode & 0o777) == "0o700"
            with grpc.insecure_channel(server.address) as channel:
                def call(service: str, method: str, request, response):
                    return channel.unary_unary(f"/{service}/{method}", response_deserializer=response.FromString,
                                               request_serializer=type(request).SerializeToString)(request, timeout=10)

                xla = "xla.coordination.CoordinationService"
                this_start = xla_pb.Incarnations(service_incarnation=server.standin.incarnation)
                with pytest.raises(grpc.RpcError) as other_task:
                    call(xla, "Heartbeat", xla_pb.HeartbeatRequest(incarnations=this_start, source_task_id=3),
                         xla_pb.HeartbeatResponse)
                assert other_task.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "task 3" in other_task.value.details() and "process 0 only" in other_task.value.details()
                with pytest.raises(grpc.RpcError) as other_start:
                    call(xla, "InsertKeyValue", xla_pb.InsertKeyValueRequest(
                        incarnations=xla_pb.Incarnations(service_incarnation=12345), kv={"key": "k", "value": b"v"}),
                        xla_pb.InsertKeyValueResponse)
                assert other_start.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "another start of the job" in other_start.value.details()
                assert client.kv_try_get("test/bad-input/kv/k") is None  # refused: nothing written
                with pytest.raises(grpc.RpcError) as service_only:
                    call("tensorflow.CoordinationService", "ReportErrorToTask", tf_pb.ReportErrorToTaskRequest(),
                         tf_pb.ReportErrorToTaskResponse)
                assert service_only.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "never the other way" in service_only.value.details()
                call(xla, "InsertKeyValue", xla_pb.InsertKeyValueRequest(incarnations=this_start,
                                                                         kv={"key": "k", "value": b"v"}),
                     xla_pb.InsertKeyValueResponse)
                with pytest.raises(grpc.RpcError) as again:
                    call(xla, "InsertKeyValue", xla_pb.InsertKeyValueRequest(incarnations=this_start,
                                                                             kv={"key": "k", "value": b"w"}),
                         xla_pb.InsertKeyValueResponse)
                assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
                assert client.kv_try_get("test/bad-input/kv/k") == b"v"
        finally:
            server.close()


def test_a_replacement_writes_again_what_its_previous_incarnation_wrote_and_no_one_else_may(start_coordinator):
    import ifrt
    from ifrt.jax.xla_standin.service import ALREADY_EXISTS, INVALID_ARGUMENT, CoordinationError, CoordinationStandIn

    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    clients = [ifrt.Client(coordinator.address, process_id=p, num_processes=2, transfer=False, timeout=30)
               for p in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            topologies = list(pool.map(lambda c: c.discover(), clients))
        first, other = (CoordinationStandIn(c, t, "test/replace", recoverable=True)
                        for c, t in zip(clients, topologies, strict=True))
        first.insert("cpu:gloo/0,1/0", b"old address", False, 10)
        with pytest.raises(CoordinationError) as someone_else:
            other.insert("cpu:gloo/0,1/0", b"not mine", False, 10)
        assert someone_else.value.code == ALREADY_EXISTS
        with pytest.raises(CoordinationError) as twice:
            first.insert("cpu:gloo/0,1/0", b"again", False, 10)
        assert twice.value.code == ALREADY_EXISTS
        assert first.try_get("cpu:gloo/0,1/0") == b"old address"

        replacement = CoordinationStandIn(clients[0], topologies[0], "test/replace", recoverable=True)
        replacement.insert("cpu:gloo/0,1/0", b"new address", False, 10)
        assert other.try_get("cpu:gloo/0,1/0") == b"new address"
        with pytest.raises(CoordinationError) as previous:  # the key is the replacement's now
            first.insert("cpu:gloo/0,1/0", b"stale", False, 10)
        assert previous.value.code == ALREADY_EXISTS
        assert other.try_get("cpu:gloo/0,1/0") == b"new address"

        with pytest.raises(CoordinationError) as part:
            other.alive_tasks(1, [1], 5)
        assert part.value.code == INVALID_ARGUMENT and "every process's devices" in part.value.message
    finally:
        for c in clients:
            c.close()
