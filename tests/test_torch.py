"""ifrt.torch: torch.distributed started from the topology, in real PyTorch processes (CPU, gloo) against a real
coordinator; the start-up exchange and device meshes on their own."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import helpers
from tests.helpers import json_answers, survivor_of_a_doomed_peer, together
from tests.requirements import require

if importlib.util.find_spec("torch") is None:
    require("torch", "pip install 'ifrt-topology[torch]' (scripts/test.sh installs a CPU build)")

import numpy as np
import torch.distributed as dist

import ifrt
import ifrt.torch
from coordinator.local import LocalCoordinator
from ifrt import wire
from ifrt.interfaces import interface_of
from ifrt.mesh import Mesh
from ifrt.records import Device, Process, TopologyContent
from ifrt.topology import Topology

WORKER = Path(__file__).with_name("torch_worker.py")
TIMEOUT = 120
LAUNCH_ORDER = (2, 0, 3, 1)
"""Local ranks in the order the processes start: the ranks follow local ranks, not arrival."""


def start_workers(address: str, local_ranks: tuple[int, ...]) -> list[subprocess.Popen]:
    """One torch process per local rank, one CPU device each, ids assigned by the coordinator."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "GLOO_", "NCCL_", "MASTER_"))}
    base.update(IFRT_COORDINATOR=address, IFRT_CPU_DEVICE_COUNT="1", OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, str(WORKER)], env=dict(base, IFRT_LOCAL_RANK=str(rank)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in local_ranks]


def results(workers: list[subprocess.Popen]) -> list[dict]:
    """Each worker's JSON answer (its last stdout line), in start order; fails naming a worker that failed."""
    return json_answers(workers, TIMEOUT)


@pytest.mark.slow
def test_four_processes_get_ranks_from_ifrt_and_compute_on_its_mesh(start_coordinator):
    coordinator = start_coordinator(num_processes=4, log_level="WARNING")
    answers = results(start_workers(coordinator.address, LAUNCH_ORDER))

    assert [a["process_id"] for a in answers] == list(LAUNCH_ORDER)  # ids by local rank on this host
    for a in answers:
        assert a["rank"] == a["process_id"] and a["world_size"] == 4 and a["backend"] == "gloo"
        assert a["same_topology_again"]
        assert a["all_reduce"] == 1 + 2 + 3 + 4
        assert a["all_gather"] == [0, 10, 20, 30]
        assert a["ifrt_mesh_processes"] == [[3, 2], [1, 0]]
        assert a["device_mesh"] == a["ifrt_mesh_processes"]  # the ifrt mesh's order reaches torch
        assert a["mesh_dim_names"] == ["dp", "tp"]
        assert a["tp_sum"] == (5 if a["rank"] in (2, 3) else 1)  # its "tp" group is its row of the ifrt mesh
    assert len({a["store_prefix"] for a in answers}) == 1
    assert answers[0]["store_prefix"].startswith("ifrt/torch/g1/")


@pytest.mark.slow
def test_the_same_job_run_again_against_the_daemon_starts_a_new_run_of_it(start_coordinator):
    """The README's daemon outlives the job: its second launch (each process a new one, the first all gone) forms
    generation 1 of the job's next run, its own, instead of restarting the old processes one by one. A job of two
    processes (how four get their ranks is the test above)."""
    coordinator = start_coordinator(num_processes=2)
    first = results(start_workers(coordinator.address, (1, 0)))
    second = results(start_workers(coordinator.address, (1, 0)))
    for answers in (first, second):
        assert [a["process_id"] for a in answers] == [1, 0]
        assert {a["all_reduce"] for a in answers} == {1 + 2}
        assert len({a["store_prefix"] for a in answers}) == 1
        assert answers[0]["store_prefix"].startswith("ifrt/torch/g1/")  # generation 1 of its own run
    assert "run 2 starts" in coordinator.log and " restarted (incarnation" not in coordinator.log


def test_a_default_group_that_exists_already_is_refused_saying_what_to_do():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ifrt.torch.BackendAlreadyInitialized, match=r"remove the other torch\.distributed"):
            ifrt.torch.init_process_group(coordinator="127.0.0.1:1", timeout=5)
    finally:
        dist.destroy_process_group()
    assert not ifrt.torch.is_initialized()


def test_the_old_name_replica_still_works_warning_it_is_now_healing():
    assert ifrt.torch.Replica.attempt is ifrt.torch.Healing.try_step and issubclass(ifrt.torch.Replica,
                                                                                    ifrt.torch.Healing)
    with pytest.warns(DeprecationWarning, match=r"ifrt.torch.Replica is now ifrt.torch.Healing \(and "
                                                r"Replica.attempt\(\) Healing.try_step\(\)\)"), \
            pytest.raises(RuntimeError, match=r"call ifrt.torch.init_process_group\(\) first"):
        ifrt.torch.Replica({})  # as before: it needs a started group


def test_importing_ifrt_does_not_import_torch_until_ifrt_torch_is_used():
    probe = ("import sys, ifrt\n"
             "before = 'torch' in sys.modules\n"
             "store = ifrt.torch.Store\n"
             "print(before, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]


# The start-up exchange, with clients in this process.

def clients(address: str, n: int) -> list[ifrt.Client]:
    """``n`` processes without transfer endpoints as Clients in this test, discovered together."""
    return helpers.clients(address, n, transfer=False, timeout=30)


def exchange(members: list[ifrt.Client], deadline_s: float = 30) -> list[str | Exception]:
    """Each member's StartupExchange result (the c10d prefix) or error, run together."""
    return together(members, lambda c: ifrt.torch.StartupExchange(c, c.topology, time.monotonic() + deadline_s).run(),
                    timeout=deadline_s + 10)


def test_a_restarted_start_against_a_durable_journal_never_reads_the_previous_starts_c10d_keys(etcd):
    args = ("--store", etcd.url, "--cluster-id", "torch-restart", "--leader-ttl", "2")
    first_coordinator = LocalCoordinator(*args, num_processes=2)
    try:
        first = clients(first_coordinator.address, 2)
        old, same = exchange(first)
        assert old == same
        first[1].kv_set(f"{old}0//cpu//0/1", b"127.0.0.1:40001")  # what gloo leaves behind: a peer's address
        generation = first[0].topology.generation
    finally:
        first_coordinator.stop(signal.SIGKILL)  # the whole job dies; its journal stays in etcd
        first_coordinator.close()
    for c in first:  # died with it: nobody left (a job whose processes all left ends its run; the next starts empty)
        c.close()

    with LocalCoordinator(*args, num_processes=2) as again:
        second = clients(again.address, 2)  # the same processes: same ids and generation, the old keys still there
        assert second[0].topology.generation == generation
        assert second[1].kv_try_get(f"{old}0//cpu//0/1") == b"127.0.0.1:40001"
        (alone,) = exchange(second[1:], deadline_s=1.5)  # process 0 has not begun: only the old records exist
        assert isinstance(alone, ifrt.DiscoveryTimeout) and "previous start" in str(alone)
        new, seen = exchange(second)
        assert new == seen != old
        assert second[1].kv_dir(old) == {}  # process 0 of the new start removed the old start's keys
        for c in second:
            c.close()


def test_process_0_writes_its_start_in_one_call_and_hears_the_answers_pushed(start_coordinator):
    coordinator = start_coordinator("--metrics-port", "0", num_processes=3)
    members = clients(coordinator.address, 3)
    with members[0], members[1], members[2]:
        before = helpers.rpc_calls(coordinator)
        prefixes = exchange(members)
        calls = {m: n - before.get(m, 0.0) for m, n in helpers.rpc_calls(coordinator).items()
                 if n != before.get(m, 0.0)}
    assert len(set(prefixes)) == 1 and all(isinstance(p, str) for p in prefixes), prefixes
    # its record: one compare-and-set on the generation's first start (no read first); the answers: pushed to it,
    # read once after the coordinator watched them (no read of each, nor of those still missing)
    assert calls.get("KeyValueCompareSet") == 1 and calls.get("KeyValueDir") == 1, calls
    assert "KeyValueTryGet" not in calls and "KeyValueMultiGet" not in calls, calls


def test_a_process_that_dies_during_start_up_ends_the_start_naming_it(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")
    with survivor_of_a_doomed_peer(coordinator.address) as (leader, topology):
        started = time.monotonic()
        with pytest.raises(ifrt.BarrierFailed, match=r"start-up cannot complete: process 1 \(.*\) failed"):
            ifrt.torch.StartupExchange(leader, topology, time.monotonic() + 30).run()
        assert time.monotonic() - started < 15  # the heartbeat timeout and a recheck, not the 30 s deadline


def test_a_start_up_that_times_out_names_the_processes_that_did_not_answer(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    first, second = clients(coordinator.address, 2)
    with first, second, pytest.raises(ifrt.DiscoveryTimeout, match=r"processes did not answer: 1 \("):
        ifrt.torch.StartupExchange(first, first.topology, time.monotonic() + 1.5).run()


def test_a_leader_that_waits_for_several_answers_names_only_the_processes_that_did_not_answer(start_coordinator):
    coordinator = start_coordinator(num_processes=3, log_level="WARNING")
    leader, silent, answering = clients(coordinator.address, 3)
    with leader, silent, answering:
        _, failed = together([answering, leader], lambda c: ifrt.torch.StartupExchange(
            c, c.topology, time.monotonic() + 1.5).run())  # process 2 answers at once, process 1 never
        assert isinstance(failed, ifrt.DiscoveryTimeout), failed
        assert "processes did not answer: 1 (" in str(failed) and "2 (" not in str(failed), failed


def test_a_follower_that_joined_an_ended_start_takes_the_next_one_at_once(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    leader, follower = clients(coordinator.address, 2)
    with leader, follower:
        old, _ = exchange([leader, follower])
        prefix = f"ifrt/torch/g{leader.topology.generation}"
        old_nonce = json.loads(leader.kv_try_get(f"{prefix}/start"))["nonce"]
        leader.kv_delete(f"{prefix}/{old_nonce}/", prefix=True)  # as a new start's process 0 does first
        result: list = []
        thread = threading.Thread(target=lambda: result.append(ifrt.torch.StartupExchange(
            follower, follower.topology, time.monotonic() + 30).run()))
        thread.start()  # it reads the ended start's record and answers it: a confirmation that never comes
        helpers.poll_until(lambda: leader.kv_try_get(f"{prefix}/{old_nonce}/join/1"), bool, timeout=30,
                           what="the follower's answer to the ended start")
        began = time.monotonic()
        new = ifrt.torch.StartupExchange(leader, leader.topology, time.monotonic() + 30).run()
        thread.join(30)
        assert result == [new] and new != old
        took = time.monotonic() - began
        assert took < 0.6, took  # not a whole recheck (1 s) on the ended start's confirmation


# Device meshes and interfaces, on plain values.

def two_processes_of(devices: int) -> Topology:
    processes = (Process(0, "a", ""), Process(1, "b", ""))
    records = tuple(Device(p << 17 | i, p, i, "cpu", "cpu") for p in (0, 1) for i in range(devices))
    return Topology(wire.encode(TopologyContent("", 1, 2, processes, records)), 0)


def test_mesh_ranks_follow_the_ifrt_mesh_order():
    topology = two_processes_of(1)
    mesh = topology.mesh((2, 1), ("dp", "tp"), devices=[1 << 17, 0])
    assert ifrt.torch.mesh_ranks(mesh) == [[1], [0]]


def test_a_mesh_with_several_devices_of_one_process_is_refused_saying_why():
    topology = two_processes_of(2)
    with pytest.raises(ValueError, match=r"holds 2 devices of process 0 \(global ids \[0, 1\]\) and 1 more "
                                         r"processes hold several: a torch DeviceMesh has one entry per rank"):
        ifrt.torch.mesh_ranks(topology.mesh((2, 2), ("dp", "tp")))
    firsts = Mesh(np.array([0, 1 << 17]), ("dp",), topology)  # one device per process is fine
    assert ifrt.torch.mesh_ranks(firsts) == [0, 1]


def test_the_socket_interface_is_the_one_holding_the_advertised_address():
    interfaces = [("lo", "127.0.0.1"), ("eth0", "10.0.0.5"), ("eth0", "fe80::1"), ("ib0", "192.168.1.2")]
    assert interface_of("10.0.0.5", interfaces) == "eth0"
    assert interface_of("fe80::0001", interfaces) == "eth0"
    assert interface_of("10.9.9.9", interfaces) is None
    assert interface_of("127.0.0.1") == "lo"  # this host's own table


@pytest.mark.slow
def test_the_ddp_example_matches_its_single_process_reference():
    example = Path(__file__).resolve().parents[1] / "examples" / "torch_ddp.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    done = subprocess.run([sys.executable, str(example), "--processes", "2"], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch: outputs match reference (max |difference|" in done.stdout
    assert "rank 1 of 2" in done.stdout


def test_a_healing_says_which_processes_broke_a_collective_and_not_to_call_recover_which_it_does_itself():
    try:
        try:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")
        except RuntimeError as cause:
            raise ifrt.CollectiveFailed("a collective of process 0 failed because processes failed: 3 (exit -9); "
                                        "call ifrt.torch.recover() to re-form the group", (3,)) from cause
    except ifrt.CollectiveFailed as e:
        said = ifrt.torch._broken(e)
    assert said == ("a collective failed because process 3 failed (RuntimeError: Connection closed by peer "
                    "[127.0.0.1]:4242)")
