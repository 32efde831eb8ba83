"""Meshes that follow the network: devices ordered by network path, slice, hostname in natural order, whatever the
process ids; ``Mesh.describe()`` names the level each axis crosses; torch's DeviceMesh keeps the order."""

from __future__ import annotations

import random

import pytest

from ifrt.ids import LOCAL_ID_BITS
from ifrt.mesh import describe_axes, domains, network_lines, ring_links
from tests.network_topologies import network_topology


def hosts_of(mesh) -> list[str]:
    """The hostname of each device, in mesh order (flattened)."""
    return [mesh.topology.process(d.process_id).hostname for d in mesh.device_records()]


def test_hostnames_are_ordered_naturally_whatever_the_ids():
    names = [f"node{i}" for i in range(1, 13)]
    by_text = sorted(names)  # node1, node10, node11, node12, node2, ...: the ids a text order would give
    topology = network_topology([(pid, name, ()) for pid, name in enumerate(by_text)], devices_per_host=1)
    mesh = topology.mesh((3, 4), ("data", "model"))
    assert hosts_of(mesh) == names


@pytest.mark.parametrize("seed", range(5))
def test_explicit_ids_out_of_network_order_still_give_a_mesh_in_network_order(seed):
    racks = {"r1": ["node7", "node66"], "r2": ["node8", "node9"], "r10": ["node1", "node2"]}
    hosts = [(rack, name) for rack, names in racks.items() for name in names]
    ids = list(range(len(hosts)))
    random.Random(seed).shuffle(ids)  # a launcher's ids, in no network order
    topology = network_topology([(pid, name, ("spine0", rack)) for pid, (rack, name) in zip(ids, hosts, strict=True)])
    mesh = topology.mesh((3, 4), ("data", "model"))
    # racks naturally (r1 < r2 < r10), hosts naturally within each (node7 < node66), a host's devices adjacent
    assert hosts_of(mesh) == [h for h in ["node7", "node66", "node8", "node9", "node1", "node2"] for _ in (0, 1)]
    assert [d.local_id for d in mesh.device_records()] == [0, 1] * 6


def test_processes_without_a_position_come_first_as_xla_sorts_an_empty_path():
    topology = network_topology([(0, "b", ("s", "r1")), (1, "a", ()), (2, "c", ("s",))], devices_per_host=1)
    assert hosts_of(topology.mesh((3,), ("x",))) == ["a", "c", "b"]


def uniform() -> list[tuple[int, str, tuple[str, ...]]]:
    """2 blocks of 2 racks of 2 hosts (2 devices each), ids in reverse."""
    names = [(f"b{b}", f"r{r}", f"node{8 * b + 2 * r + h}") for b in range(2) for r in range(2) for h in range(2)]
    return [(len(names) - 1 - i, host, ("spine", block, f"{block}-{rack}")) for i, (block, rack, host)
            in enumerate(names)]


def test_each_axis_is_described_by_the_smallest_domain_that_holds_it():
    mesh = network_topology(uniform()).mesh((2, 2, 2, 2), ("data", "fsdp", "pipe", "tensor"))
    assert describe_axes(mesh) == [
        "axis 'data' (2) crosses tier-1 switches in every ring (8 links), spans the whole job",
        "axis 'fsdp' (2) crosses leaf switches in every ring (8 links), stays within each tier-1 switch",
        "axis 'pipe' (2) crosses hosts in every ring (8 links), stays within each leaf switch",
        "axis 'tensor' (2) stays within each host",
    ]
    assert mesh.describe() == "\n".join(describe_axes(mesh))


def test_an_axis_that_unequal_racks_cannot_hold_says_where_and_what_would():
    # rack r1 has 3 hosts, rack r2 one: the second ring of 4 devices has 2 in each
    topology = network_topology([(0, "h1", ("r1",)), (1, "h2", ("r1",)), (2, "h3", ("r1",)), (3, "h4", ("r2",))])
    mesh = topology.mesh((2, 4), ("data", "fsdp"))
    lines = describe_axes(mesh)
    assert lines[1] == ("axis 'fsdp' (4) crosses leaf switches in 1 of its 2 rings (2 links across leaf switches), "
                        "spans the whole job: leaf switch 'r1' holds 2 of its devices, leaf switch 'r2' holds 2; leaf "
                        "switches hold 2 to 6 devices: the axis span 4 devices; a span that divides 2 keeps every ring "
                        "within its leaf switch (or give the leaf switches equal numbers of hosts)")
    found = domains(mesh)
    assert found.names == ("host", "leaf switch")
    assert ring_links(mesh, 1, found.keys[1]) == (2, 1)


def test_torch_device_mesh_ranks_keep_the_network_order():
    import ifrt.torch

    ids = [3, 0, 2, 1]  # explicit ids: rack r2's hosts got the low ones
    topology = network_topology([(pid, f"node{i}", (f"r{1 + i // 2}",)) for i, pid in enumerate(ids)],
                                devices_per_host=1)
    mesh = topology.mesh((2, 2), ("dp", "tp"))
    assert ifrt.torch.mesh_ranks(mesh) == [[3, 0], [2, 1]]
    assert (mesh.devices >> LOCAL_ID_BITS).tolist() == [[3, 0], [2, 1]]


def test_unequal_racks_are_packed_so_fewer_rings_cross_them():
    # racks of 1, 2 and 1 hosts; rings of 2: in plain network order (a b)(c d) both cross racks; packed, rack
    # r2's whole ring comes first and the leftovers of r1 and r3 share one
    topology = network_topology([(0, "a", ("r1",)), (1, "b", ("r2",)), (2, "c", ("r2",)), (3, "d", ("r3",))],
                                devices_per_host=1)
    mesh = topology.mesh((2, 2), ("data", "pair"))
    assert [hosts_of(mesh)[:2], hosts_of(mesh)[2:]] == [["b", "c"], ["a", "d"]]
    assert ring_links(mesh, 1, domains(mesh).keys[1]) == (1, 1)
    assert describe_axes(mesh)[1].startswith("axis 'pair' (2) crosses leaf switches in 1 of its 2 rings (1 links "
                                             "across leaf switches)")


def test_equal_racks_are_left_in_network_order():
    topology = network_topology(uniform())
    mesh = topology.mesh((8, 2), ("data", "tensor"))
    assert hosts_of(mesh)[::2] == [f"node{i}" for i in (0, 1, 2, 3, 8, 9, 10, 11)]


def test_network_lines_say_what_each_level_holds_and_describe_a_mesh():
    topology = network_topology([(0, "h1", ("s", "r1")), (1, "h2", ("s", "r1")), (2, "h3", ("s", "r1")),
                                 (3, "h4", ("s", "r2"))])
    assert network_lines(topology, (2, 4), ("data", "fsdp")) == [
        "2 leaf switches of 2 to 6 devices: a mesh's inner axes stay within each leaf switch where together they "
        "span a divisor of 2 devices",
        "1 tier-1 switch of 8 devices each: a mesh's inner axes stay within each tier-1 switch where together they "
        "span a divisor of 8 devices",
        *describe_axes(topology.mesh((2, 4), ("data", "fsdp"))),
    ]
    assert network_lines(network_topology([(0, "h1", ())])) == []


def test_explicit_ids_from_a_real_coordinator_keep_and_the_mesh_follows_the_network(monkeypatch):
    import threading

    import ifrt
    from coordinator.local import LocalCoordinator

    racks = ["rack10", "rack9", "rack2", "rack1"]  # process i's rack: the launcher's ids run against the network
    topologies: list = [None] * 4
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "2")
    with LocalCoordinator(num_processes=4) as coordinator:
        def run(i: int) -> None:
            with ifrt.Client(coordinator.address, process_id=i, num_processes=4, timeout=60, session=False,
                             transfer=False, network=("spine", racks[i])) as client:
                topologies[i] = client.discover()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert len({t.fingerprint for t in topologies}) == 1
    topology = topologies[0]
    assert [p.network for p in topology.processes] == [("spine", r) for r in racks]  # ids as given
    mesh = topology.mesh((4, 2), ("data", "tensor"))
    assert (mesh.devices >> LOCAL_ID_BITS).tolist() == [[3, 3], [2, 2], [1, 1], [0, 0]]  # rack1, rack2, rack9, rack10
    assert describe_axes(mesh) == ["axis 'data' (4) crosses leaf switches in every ring (8 links), spans the whole job",
                                   "axis 'tensor' (2) stays within each host"]


def test_ifrt_discover_says_where_each_axis_of_a_mesh_sits(start_coordinator):
    import os
    import subprocess

    from tests.helpers import BIN, finish

    coordinator = start_coordinator(num_processes=2)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    children = [subprocess.Popen([str(BIN / "ifrt"), "discover", "--coordinator", coordinator.address, "--timeout",
                                  "60", "--mesh", "2x2", "--axes", "data,tensor"],
                                 env={**clean, "IFRT_CPU_DEVICE_COUNT": "2", "IFRT_NETWORK_NODES": f"spine,{rack}",
                                      "IFRT_LOCAL_RANK": str(rank)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rank, rack in enumerate(("rack10", "rack9"))]
    for child in children:
        code, out, err = finish(child)
        assert code == 0, err
        assert out.splitlines()[-4:] == [
            "2 leaf switches of 2 devices each: a mesh's inner axes stay within each leaf switch where together they "
            "span a divisor of 2 devices",
            "1 tier-1 switch of 4 devices each: a mesh's inner axes stay within each tier-1 switch where together "
            "they span a divisor of 4 devices",
            "axis 'data' (2) crosses leaf switches in every ring (2 links), spans the whole job",
            "axis 'tensor' (2) stays within each host"], out


def test_a_bad_mesh_shape_is_refused_before_anything_registers():
    import subprocess

    from tests.helpers import BIN

    for shape in ("0x2", "2xfour", ""):
        result = subprocess.run([str(BIN / "ifrt"), "discover", "--coordinator", "127.0.0.1:1", "--mesh", shape],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert f"argument --mesh: {shape!r}: expected positive axis sizes joined by x, such as 64x16x8" in result.stderr
