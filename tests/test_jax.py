"""ifrt.jax: JAX started from the topology, in real JAX processes (CPU, gloo) against a real coordinator."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import json_answers, survivor_of_a_doomed_peer, together
from tests.requirements import require
from tests.workers import start_jax_workers

if importlib.util.find_spec("jax") is None:
    require("jax", "pip install 'ifrt-topology[jax]' (scripts/test.sh installs it)")

import ifrt
import ifrt.jax
from ifrt import wire
from ifrt.records import Device, Process, TopologyContent
from ifrt.topology import Topology

TIMEOUT = 90
OLD_JAX_PYTHON_ENV = "IFRT_TEST_JAX04_PYTHON"  # scripts/test.sh makes .venv-jax04: jax 0.4.30, grpcio, protobuf


def results(workers: list[subprocess.Popen]) -> list[dict]:
    """Each worker's JSON answer (its last stdout line), in start order; fails naming a worker that failed."""
    return json_answers(workers, TIMEOUT)


@pytest.mark.slow
def test_four_processes_start_jax_with_assigned_ids_and_compute_across_them(start_coordinator):
    coordinator = start_coordinator(num_processes=4, log_level="WARNING")
    answers = sorted(results(start_jax_workers(coordinator.address, 4, "mesh")), key=lambda a: a["process_id"])

    assert [a["process_id"] for a in answers] == [0, 1, 2, 3]
    assert [a["jax_process_index"] for a in answers] == [0, 1, 2, 3]
    assert len({a["fingerprint"] for a in answers}) == 1
    assert all(a["same_topology_again"] for a in answers)
    for a in answers:
        # the topology's order reaches JAX: same shape and axes, one process's devices adjacent on "model"
        assert a["axis_names"] == ["data", "model"]
        assert a["ifrt_mesh"] == [[0, 1, 1 << 17, 1 << 17 | 1], [2 << 17, 2 << 17 | 1, 3 << 17, 3 << 17 | 1]]
        assert a["jax_mesh_processes"] == [[0, 0, 1, 1], [2, 2, 3, 3]]
        assert a["submesh_ids"] == [a["jax_mesh_ids"][1]]
        # a mesh in an order other than the ids' (a network order) reaches JAX as it is
        assert a["reversed_jax_processes"] == a["reversed_ifrt_processes"] == [[3, 3, 2, 2], [1, 1, 0, 0]]
        # a sum over "model" crosses processes: every process's shards equal numpy's result
        assert a["result_matches_reference"] and a["addressable_shards"] == 2


def check_ids_match(answers: list[dict]) -> bool:
    """Asserts JAX's device for each ifrt id is the one of the same (process, local order); returns whether the
    JAX ids also equal ifrt's."""
    a = answers[0]
    ifrt_ids = [i for row in a["ifrt_mesh"] for i in row]
    jax_ids = [i for row in a["jax_mesh_ids"] for i in row]
    jax_processes = [p for row in a["jax_mesh_processes"] for p in row]
    local_ids = {b["process_id"]: b["jax_local_ids"] for b in answers}
    for ifrt_id, jax_id, jax_process in zip(ifrt_ids, jax_ids, jax_processes, strict=True):
        process_id, local_id = ifrt.split_global_id(ifrt_id)
        assert jax_process == process_id
        assert jax_id == local_ids[process_id][local_id]  # the local_id-th of that process's devices, by JAX id
    jax_packs_like_ifrt = local_ids[1][0] == 1 << 17  # JAX 0.4.x on CPU; JAX 0.10 starts process 1 at 1 << 11
    assert (jax_ids == ifrt_ids) == jax_packs_like_ifrt
    assert jax_ids[0] == ifrt_ids[0] == 0  # process 0's first device: both numberings agree whatever the version
    return jax_ids == ifrt_ids


@pytest.mark.slow
def test_jax_device_ids_match_ifrt_ids_by_process_and_local_order(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    check_ids_match(results(start_jax_workers(coordinator.address, 2, "mesh")))


@pytest.mark.slow
def test_jax_0_4_device_ids_equal_ifrt_ids(start_coordinator):
    python = os.environ.get(OLD_JAX_PYTHON_ENV)
    if not python:
        require("jax 0.4.x", f"set {OLD_JAX_PYTHON_ENV} to a Python with jax 0.4.x (which numbers CPU devices as "
                "ifrt does); scripts/test.sh makes one in .venv-jax04")
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    # one device per process: JAX 0.4.30's CPU collectives do not support more across processes
    assert check_ids_match(results(start_jax_workers(coordinator.address, 2, "mesh", devices=1, python=python)))


@pytest.mark.slow
def test_a_process_whose_jax_sees_other_devices_fails_everywhere_within_seconds(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    # process 1 registers only device 0 with ifrt; on CPU its JAX still creates both devices
    answers = results(start_jax_workers(coordinator.address, 2, "narrowed", extra_env={1: {"NARROW": "0"}}))
    for a in answers:
        assert a["error"] == "TopologyError"
        assert "process 1 (" in a["message"] and "process 0 (" not in a["message"]
        assert "ifrt's topology has 1 device [cpu:0] but its JAX will have 2 devices [cpu:0, cpu:1]" in a["message"]
        assert a["seconds"] < 10


@pytest.mark.slow
def test_jax_plugin_leaves_jax_distributed_free_to_start(start_coordinator):
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    (a,) = results(start_jax_workers(coordinator.address, 1, "plugin-then-jax"))
    assert a["distributed"]
    assert a["ifrt"] == [["cpu", "cpu", 0], ["cpu", "cpu", 1]]
    assert a["jax"] == [["cpu", "cpu"], ["cpu", "cpu"]]


@pytest.mark.slow
def test_a_token_protected_coordinator_admits_initialize_with_token(start_coordinator, tmp_path):
    (tmp_path / "token").write_text("jax-job-token-7c2e")
    (tmp_path / "token").chmod(0o600)
    coordinator = start_coordinator("--token-file", str(tmp_path / "token"), num_processes=2, log_level="WARNING")
    # No IFRT_TOKEN or IFRT_TOKEN_FILE: without the argument the coordinator answers UNAUTHENTICATED.
    token = {"TEST_CLUSTER_TOKEN": "jax-job-token-7c2e"}
    answers = results(start_jax_workers(coordinator.address, 2, "token", extra_env={0: token, 1: token}))
    assert [(a["process_id"], a["jax_process_index"]) for a in answers] == [(0, 0), (1, 1)]


@pytest.mark.slow
def test_initialize_after_a_jax_computation_says_what_to_do():
    (a,) = results(start_jax_workers("127.0.0.1:1", 1, "backend-first"))
    assert a["error"] == "BackendAlreadyInitialized"
    assert "call ifrt.jax.initialize() before any JAX computation" in a["message"]


# The start-up exchange, with plain ifrt clients standing in for JAX processes.
def test_a_restarted_job_never_takes_the_previous_starts_address(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    view = [{"platform": "cpu", "kind": "cpu"}]

    def clients(**options: object) -> list[ifrt.Client]:
        made = [ifrt.Client(coordinator.address, process_id=p, num_processes=2, transfer=False, timeout=30,
                            **options) for p in (0, 1)]
        both = threading.Barrier(2, timeout=30)
        threads = [threading.Thread(target=lambda c=c: (c.discover(), both.wait())) for c in made]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        return made

    def exchange(members: list[ifrt.Client], deadline_s: float = 30) -> tuple[list, list[ifrt.jax.StartupExchange]]:
        runs = [ifrt.jax.StartupExchange(c, c.topology, time.monotonic() + deadline_s, reserve=True)
                for c in members]

        def run(exchange: ifrt.jax.StartupExchange) -> object:
            try:
                return exchange.run(view)
            finally:
                exchange.release_port()

        return together(runs, run, timeout=deadline_s + 10), runs

    # Processes that vanish without a goodbye (no session keeps them, none leaves), as a killed job's do: the
    # restarted ones take their ids back in the same run of the job. (A job whose processes all left starts a new
    # run instead, where nothing of the previous one is left: tests/test_runs.py.)
    first = clients(session=False)
    (address, same), (lead, follow) = exchange(first)
    assert address == same and "address" in address and follow.leader_nonce == lead.nonce
    assert lead.scope == follow.scope  # the stand-in's keys and barriers: one prefix per start, in every process
    generation = first[0].topology.generation

    second = clients()  # the same processes again: same ids, same topology, the old records still in the store
    for c in first:
        c.close()  # replaced already: its goodbye changes nothing
    assert second[0].topology.generation == generation
    (alone,), _ = exchange(second[1:], deadline_s=1.5)  # process 0 has not written yet: only old records exist
    assert isinstance(alone, ifrt.DiscoveryTimeout) and "previous start" in str(alone)
    (fresh, seen), (lead_again, follow_again) = exchange(second)
    assert fresh == seen and follow_again.leader_nonce == lead_again.nonce != lead.nonce
    assert fresh["address"] != address["address"] and lead_again.scope == follow_again.scope != lead.scope
    for c in second:
        c.close()


def test_a_process_that_dies_during_start_up_ends_the_others_wait(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")
    with survivor_of_a_doomed_peer(coordinator.address) as (leader, topology):
        started = time.monotonic()
        exchange = ifrt.jax.StartupExchange(leader, topology, time.monotonic() + 30, reserve=False)
        try:
            with pytest.raises(ifrt.BarrierFailed, match=r"JAX start-up cannot complete: process 1 \(.*\) failed"):
                exchange.run([{"platform": "cpu", "kind": "cpu"}])
        finally:
            exchange.release_port()
        assert time.monotonic() - started < 10  # the heartbeat timeout and a recheck, not the 30 s deadline


# Checks and matching, on plain values.
@dataclass(frozen=True)
class FakeJaxDevice:
    id: int
    process_index: int


def two_by_two(platform: str = "cpu") -> Topology:
    processes = (Process(0, "a", ""), Process(1, "b", ""))
    devices = tuple(Device(p << 17 | i, p, i, platform, platform) for p in (0, 1) for i in (0, 1))
    return Topology(wire.encode(TopologyContent("", 1, 2, processes, devices)), 0)


@pytest.mark.parametrize("shift", [17, 11])
def test_devices_are_matched_by_process_and_local_order_not_by_jax_numbering(shift):
    fakes = [FakeJaxDevice(p << shift | i, p) for p in (1, 0) for i in (1, 0)]  # any order JAX lists them in
    matched = ifrt.jax.match_devices(two_by_two(), fakes)
    assert {g: (d.process_index, d.id) for g, d in matched.items()} == {
        g: (g >> 17, (g >> 17) << shift | (g & 1)) for g in (0, 1, 1 << 17, 1 << 17 | 1)}
    assert all(d.id == g for g, d in matched.items()) == (shift == 17)


def test_device_mismatch_names_the_process_and_both_device_lists():
    cpu = {"platform": "cpu", "kind": "cpu"}
    views = {0: [cpu, cpu], 1: [{"platform": "cuda", "kind": "H100"}, {"platform": "cuda", "kind": "H100"}]}
    with pytest.raises(ifrt.TopologyError, match=r"process 1 \(b\): ifrt's topology has 2 devices \[cpu:0, cpu:1\] "
                       r"but its JAX has 2 devices \[cuda:0, cuda:1\]"):
        ifrt.jax.check_devices(two_by_two(), views)
    ifrt.jax.check_devices(two_by_two(), {0: [cpu, cpu], 1: [cpu, cpu]})


def test_gpus_the_cuda_plugin_registered_are_the_gpus_jax_has():
    gpu = {"platform": "gpu", "kind": "NVIDIA H100 80GB HBM3"}
    ifrt.jax.check_devices(two_by_two("cuda"), {0: [gpu, gpu], 1: [gpu, gpu]})  # JAX says gpu, the plugin cuda
    with pytest.raises(ifrt.TopologyError, match=r"ifrt's topology has 2 devices \[cuda:0, cuda:1\] but its JAX "
                       r"has 2 devices \[cpu:0, cpu:1\]"):
        ifrt.jax.check_devices(two_by_two("cuda"), {0: [gpu, gpu], 1: [{"platform": "cpu", "kind": "cpu"}] * 2})


@pytest.mark.slow
def test_pipeline_example_with_jax_stages_matches_its_reference():
    pipeline = Path(__file__).resolve().parents[1] / "examples" / "pipeline.py"
    command = [sys.executable, str(pipeline), "--runtime", "jax", "--processes", "2", "--microbatches", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT * 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: outputs match reference" in done.stdout and "jax runtime" in done.stdout
    assert "rows/s with 4 microbatches" in done.stdout


def test_the_collective_timeout_reaches_xla_unless_its_flags_name_one_and_a_bad_one_is_refused(monkeypatch):
    from ifrt.errors import InvalidArgument
    from ifrt.jax import _set_collective_timeout

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    _set_collective_timeout(2.4)
    assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2 "
                                       "--xla_cpu_collective_timeout_seconds=2")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=60")
    _set_collective_timeout(10)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_collective_timeout_seconds=60"  # the user's own wins
    monkeypatch.delenv("XLA_FLAGS")
    with pytest.raises(InvalidArgument, match="collective_timeout=0: expected a positive number of seconds"):
        _set_collective_timeout(0)
    assert "XLA_FLAGS" not in os.environ
