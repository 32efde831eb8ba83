"""Where hosts sit in the network, with real coordinator processes: each source of a position reaches every process,
ids follow the network (then hostnames in natural order) whatever the arrival order, explicit ids stay as given, and
every bad position is refused by name with nothing registered."""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from coordinator.local import LocalCoordinator
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.topology import Topology
from tests.helpers import BIN, discover_process, finish, ifrt_status, register_request, status_json

AWS = "topology.k8s.aws/network-node-layer-"


def register_in_order(address: str, requests: list[pb.RegisterRequest]) -> list[pb.RegisterResponse]:
    """Registers ``requests`` one after the other in this order (each answered before the next is sent), then waits
    for the topology with every one of them (the same client uids: retries of the same processes)."""
    with grpc.insecure_channel(address) as channel:
        stub = CoordinatorStub(channel)
        for request in requests:
            stub.Register(pb.RegisterRequest(**_fields(request), wait_ms=0), timeout=30)

        def wait(request: pb.RegisterRequest) -> pb.RegisterResponse:
            while not (answer := stub.Register(pb.RegisterRequest(**_fields(request), wait_ms=30_000),
                                               timeout=60)).fingerprint:
                pass
            return answer

        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(wait, requests))


def _fields(request: pb.RegisterRequest) -> dict:
    return {field.name: value for field, value in request.ListFields() if field.name != "wait_ms"}


def host(name: str, network: tuple[str, ...] = (), **fields) -> pb.RegisterRequest:
    """A process of ``name`` (its uid and transfer endpoint named after it) with ``network``, ids assigned."""
    return register_request(client_uid=f"uid-{name}", hostname=name, network=network, **fields)


def decoded(answer: pb.RegisterResponse) -> Topology:
    return Topology(wire.decompress(answer.encoding, answer.topology), answer.process_id)


def test_hostnames_get_ids_in_natural_order(start_coordinator):
    names = [f"node{i}" for i in range(1, 13)]
    arrival = names[:]
    random.Random(31).shuffle(arrival)
    coordinator = start_coordinator(num_processes=12)
    answers = register_in_order(coordinator.address, [host(n) for n in arrival])
    ids = {decoded(a).processes[a.process_id].hostname: a.process_id for a in answers}
    assert ids == {f"node{i}": i - 1 for i in range(1, 13)}  # node2 before node10, not as text (node10 = 1)


# Eight hosts in two spines, racks of unequal size; their names say nothing of where they sit, and the hostname
# order is the reverse of the network's.
FABRIC = {
    "h8": ("spine1", "rack1"), "h7": ("spine1", "rack1"), "h6": ("spine1", "rack2"),
    "h5": ("spine1", "rack10"), "h4": ("spine1", "rack10"), "h3": ("spine2", "rack1"),
    "h2": ("spine2", "rack1"), "h1": ("spine2", "rack3"),
}
NETWORK_ORDER = ["h7", "h8", "h6", "h4", "h5", "h2", "h3", "h1"]  # rack2 before rack10; within a rack by hostname


def test_ids_follow_the_network_in_any_arrival_order_with_the_same_bytes_everywhere(start_coordinator):
    published = set()
    for seed in range(3):
        arrival = list(FABRIC)
        random.Random(seed).shuffle(arrival)
        coordinator = start_coordinator(num_processes=len(FABRIC))
        answers = register_in_order(coordinator.address, [host(n, FABRIC[n]) for n in arrival])

        assert len({a.topology for a in answers}) == 1 and len({a.fingerprint for a in answers}) == 1
        topology = decoded(answers[0])
        assert topology.fingerprint == answers[0].fingerprint
        assert [p.hostname for p in topology.processes] == NETWORK_ORDER
        assert all(p.network == FABRIC[p.hostname] for p in topology.processes)
        assert {arrival[i]: a.process_id for i, a in enumerate(answers)} == {n: NETWORK_ORDER.index(n)
                                                                              for n in FABRIC}
        published.add((answers[0].topology, answers[0].fingerprint))

        # ifrt status names each process's domain.
        processes = status_json(coordinator.address)["processes"]
        assert {p["host"]: tuple(p["network"]) for p in processes} == FABRIC
        text = ifrt_status("--coordinator", coordinator.address).stdout
        row = next((line for line in text.splitlines() if line.split()[:2] == ["3", "h4"]), text)
        assert "spine1/rack10" in row, text
        coordinator.close()
    assert len(published) == 1  # the same bytes and fingerprint whatever the arrival order


def test_explicit_ids_stay_as_given(start_coordinator):
    given = {"h1": 0, "h5": 1, "h8": 2, "h3": 3}  # not in network order
    coordinator = start_coordinator(num_processes=4)
    answers = register_in_order(coordinator.address, [host(n, FABRIC[n], process_id=pid) for n, pid in given.items()])
    topology = decoded(answers[0])
    assert {p.hostname: p.process_id for p in topology.processes} == given
    assert [p.network for p in topology.processes] == [FABRIC[n] for n in given]


def test_a_process_without_a_position_sorts_first_and_depths_may_mix(start_coordinator):
    paths = {"a": ("spine1", "rack2"), "b": (), "c": ("spine1",), "d": ("spine1", "rack1", "half2")}
    coordinator = start_coordinator(num_processes=4)
    answers = register_in_order(coordinator.address, [host(n, p) for n, p in paths.items()])
    assert [p.hostname for p in decoded(answers[0]).processes] == ["b", "c", "d", "a"]


def labels(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_each_source_gives_every_process_its_position_in_ifrt_discover_json(start_coordinator, tmp_path):
    sources = [
        ({"IFRT_NETWORK_NODES": "spine1,block2,rack7"}, ["spine1", "block2", "rack7"]),
        ({"XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES": "xspine,xrack"}, ["xspine", "xrack"]),
        ({"SLURM_TOPOLOGY_ADDR": "root.sw1.rack3.node7", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.switch.node"},
         ["root", "sw1", "rack3"]),
        ({"IFRT_NODE_LABELS_FILE": labels(tmp_path, "nvidia", "network.topology.nvidia.com/core=c1\n"
                                          "network.topology.nvidia.com/spine=s2\nnetwork.topology.nvidia.com/leaf=l3\n"
                                          "network.topology.nvidia.com/accelerator=nvl72-1\n")}, ["c1", "s2", "l3"]),
        ({"IFRT_NODE_LABELS_FILE": labels(tmp_path, "aws", f"{AWS}1=nn-1\n{AWS}2=nn-2\n{AWS}3=nn-3\n")},
         ["nn-1", "nn-2", "nn-3"]),
        ({"IFRT_NODE_LABELS_FILE": labels(tmp_path, "gce", "cloud.google.com/gce-topology-block=b1\n"
                                          "cloud.google.com/gce-topology-subblock=sb1\n"
                                          "cloud.google.com/gce-topology-host=host9\n")}, ["b1", "sb1"]),
        ({"IFRT_NODE_LABELS_FILE": labels(tmp_path, "oci", "oci.oraclecloud.com/host.network_block_id=blk\n"
                                          "oci.oraclecloud.com/host.rack_id=rck\n")}, ["blk", "rck"]),
        ({}, []),
    ]
    n = len(sources)
    coordinator = start_coordinator(num_processes=n)
    children = [discover_process(coordinator.address, "--process-id", str(pid), "--num-processes", str(n), env=env)
                for pid, (env, _) in enumerate(sources)]
    results = [finish(child) for child in children]
    assert [code for code, _, _ in results] == [0] * n, [err[-2000:] for _, _, err in results]
    answers = [json.loads(out) for _, out, _ in results]
    expected = [path for _, path in sources]
    for answer in answers:
        assert [p["network"] for p in answer["processes"]] == expected
        assert Topology.from_dict(answer).fingerprint == answer["fingerprint"]  # to_dict/from_dict carry it
    assert len({a["fingerprint"] for a in answers}) == 1


def test_ifrt_env_shows_the_position_and_its_source(tmp_path):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "SLURM_", "XLA_"))}
    env = {**clean, "IFRT_COORDINATOR": "127.0.0.1:1",
           "IFRT_NODE_LABELS_FILE": labels(tmp_path, "aws", f"{AWS}1=nn-1\n{AWS}2=nn-2\n")}
    shown = subprocess.run([str(BIN / "ifrt"), "env"], capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "warning" not in shown.stdout, shown.stdout
    assert f"network: nn-1/nn-2 (from IFRT_NODE_LABELS_FILE={env['IFRT_NODE_LABELS_FILE']!r} (aws labels))" in \
        shown.stdout, shown.stdout
    as_json = subprocess.run([str(BIN / "ifrt"), "env", "--json"], capture_output=True, text=True, timeout=60,
                             env={**env, "IFRT_NETWORK_NODES": "s1,r1"})
    settings = json.loads(as_json.stdout)["settings"]
    assert (settings["network"], settings["network_source"]) == (["s1", "r1"], "IFRT_NETWORK_NODES")


def test_ifrt_env_names_sources_that_disagree(tmp_path):
    # A node labelled by topograph (its documented two-tier example: leaf s1 under spine s2) where the job also sets
    # IFRT_NETWORK_NODES: the variable wins, and ifrt env says the labels give another path.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "SLURM_", "XLA_"))}
    path = labels(tmp_path, "topograph", "network.topology.nvidia.com/leaf=s1\nnetwork.topology.nvidia.com/spine=s2\n"
                  "accelerator.topograph.run/domain=nvl1\n")
    env = {**clean, "IFRT_COORDINATOR": "127.0.0.1:1", "IFRT_NETWORK_NODES": "spine9,rack3",
           "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES": "spine9,rack3,", "IFRT_NODE_LABELS_FILE": path}
    shown = subprocess.run([str(BIN / "ifrt"), "env"], capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "network: spine9/rack3 (from IFRT_NETWORK_NODES)" in shown.stdout, shown.stdout
    warned = [line for line in shown.stdout.splitlines() if line.startswith("warning: network sources disagree")]
    assert warned == [f"warning: network sources disagree: s2/s1 from IFRT_NODE_LABELS_FILE={path!r} "
                      "(nvidia-topograph labels); IFRT_NETWORK_NODES is used"], shown.stdout  # XLA's agrees
    assert "accelerator_domain: nvl1" in shown.stdout, shown.stdout
    as_json = subprocess.run([str(BIN / "ifrt"), "env", "--json"], capture_output=True, text=True, timeout=60, env=env)
    settings = json.loads(as_json.stdout)["settings"]
    assert settings["network_conflicts"] == [f"s2/s1 from IFRT_NODE_LABELS_FILE={path!r} (nvidia-topograph labels)"]


BAD_PATHS = {
    "9 levels": ([f"level{i}" for i in range(9)], "the network path of node1 has 9 levels: expected at most 8"),
    "an empty level": (["spine1", "", "rack1"], "the network path of node1: level 1 of the network path"),
    "a blank level": (["spine1", "  "], "level 1 of the network path ['spine1', '  '] is empty"),
    "a level over 255 bytes": (["spine1", "r" * 256], "level 1 of the network path is 256 bytes long: expected "
                                                      "at most 255"),
    "a bidi override": (["spine1", "rack\u202e7"], "level 1 of the network path ('rack\\u202e7') holds U+202E "
                                                    "RIGHT-TO-LEFT OVERRIDE"),
}


@pytest.mark.parametrize("case", list(BAD_PATHS))
def test_a_bad_network_path_is_refused_by_name_and_nothing_is_registered(start_coordinator, case):
    path, said = BAD_PATHS[case]
    coordinator = start_coordinator(num_processes=2)
    with grpc.insecure_channel(coordinator.address) as channel, pytest.raises(grpc.RpcError) as refused:
        CoordinatorStub(channel).Register(host("node1", tuple(path), wait_ms=0), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert said in refused.value.details()
    status = status_json(coordinator.address)
    assert status["registered"] == 0 and status["processes"] == []
    # The same process with a good path gets in, and the job completes without any trace of the refused one.
    answers = register_in_order(coordinator.address, [host("node1", ("spine1",)), host("node2", ("spine1",))])
    assert [p.network for p in decoded(answers[0]).processes] == [("spine1",), ("spine1",)]


@pytest.fixture(scope="module")
def untouched() -> Iterator[LocalCoordinator]:
    """A coordinator of 2 processes that the processes below never reach: each checks nothing registered."""
    with LocalCoordinator(num_processes=2) as coordinator:
        yield coordinator


@pytest.mark.parametrize(("env", "said"), [
    ({"IFRT_NODE_LABELS_FILE": "/nonexistent/ifrt-node-labels"},
     "IFRT_NODE_LABELS_FILE='/nonexistent/ifrt-node-labels' cannot be read"),
    ({"SLURM_TOPOLOGY_ADDR": "root.sw1.node7", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.switch.node"},
     "SLURM_TOPOLOGY_ADDR='root.sw1.node7' has 3 levels but SLURM_TOPOLOGY_ADDR_PATTERN="
     "'switch.switch.switch.node' has 4"),
    ({"IFRT_NETWORK_NODES": "spine1,,rack1"}, "IFRT_NETWORK_NODES: level 1 of the network path"),
])
def test_a_bad_source_stops_the_process_by_name_before_it_registers(untouched, env, said):
    coordinator = untouched
    code, _, err = finish(discover_process(coordinator.address, env=env, timeout=30))
    assert code == 1 and said in err, err
    status = status_json(coordinator.address)
    assert status["registered"] == 0 and status["processes"] == []


def test_ifrt_discovers_table_names_each_processes_domain():
    from ifrt import render
    from ifrt.records import Device, Process, TopologyContent

    processes = (Process(0, "node1", "", ("spine1", "block2", "rack7")), Process(1, "node2", "", ()))
    devices = (Device(0, 0, 0, "cpu", "cpu"), Device(1 << 17, 1, 0, "cpu", "cpu"))
    table = render.table(Topology(wire.encode(TopologyContent("", 1, 2, processes, devices)), 0)).splitlines()
    assert table[0].split() == ["process", "host", "network", "global", "id", "local", "id", "platform", "kind",
                                "slice"]
    assert table[2].split()[:3] == ["0", "node1", "spine1/block2/rack7"]
    assert table[3].split()[:3] == ["1", "node2", "-"]
    without = (Process(0, "node1"),)
    plain = render.table(Topology(wire.encode(TopologyContent("", 1, 1, without, devices[:1])), 0))
    assert "network" not in plain


def test_the_network_option_of_client_orders_ids_before_the_local_rank(start_coordinator):
    import ifrt
    from tests.helpers import together

    coordinator = start_coordinator(num_processes=2)
    options = [{"local_rank": 0, "network": ["spine1", "rack10"]}, {"local_rank": 1, "network": "spine1,rack9"}]

    def discover(o: dict) -> Topology:
        with ifrt.Client(coordinator.address, timeout=60, **o) as client:
            return client.discover()

    first, second = together(options, discover)
    assert (first.process_id, second.process_id) == (1, 0)  # rack9 before rack10, whatever the local ranks say
    assert [p.network for p in first.processes] == [("spine1", "rack9"), ("spine1", "rack10")]
    assert first.canonical_bytes == second.canonical_bytes
