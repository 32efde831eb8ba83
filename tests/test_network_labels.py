"""The node label families as their platforms write them: NVIDIA topograph's (1.0's ``fabric.topograph.run/tier-N``,
the ``network.topology.nvidia.com`` leaf/spine/core before it and the block/spine/datacenter before that, its
accelerator domain), AWS's four network node layers; every input is the platforms' own documented example."""

from __future__ import annotations

import logging

import pytest

import ifrt
from ifrt import network_sources as ns
from ifrt.errors import InvalidArgument
from ifrt.settings import resolve
from tests.helpers import together

NVIDIA = "network.topology.nvidia.com/"
TIER = "fabric.topograph.run/tier-"
DOMAIN = "accelerator.topograph.run/domain"
AWS = "topology.k8s.aws/network-node-layer-"

# topograph's documented example (docs/engines/k8s.md): a node in NVLink domain nvl1 hangs off switch s1, which hangs
# off s2, which hangs off s3. Root first, its position is s3/s2/s1.
EXAMPLE = {"accelerator": "nvl1", "tier-0": "s1", "tier-1": "s2", "tier-2": "s3"}


@pytest.mark.parametrize(("labels", "path"), [
    # the three-tier fabric of the example
    ({f"{NVIDIA}accelerator": "nvl1", f"{NVIDIA}leaf": "s1", f"{NVIDIA}spine": "s2", f"{NVIDIA}core": "s3"},
     ("s3", "s2", "s1")),
    # a two-tier fabric (no core: the reference says core is "present in large three-tier fabrics")
    ({f"{NVIDIA}accelerator": "nvl1", f"{NVIDIA}leaf": "s1", f"{NVIDIA}spine": "s2"}, ("s2", "s1")),
    # a single tier (topograph's LLDP providers see the directly connected leaf only)
    ({f"{NVIDIA}leaf": "s1"}, ("s1",)),
    # topograph before leaf/spine/core (v0.1.0's docs/engines/k8s.md): block, spine, datacenter
    ({f"{NVIDIA}accelerator": "nvl1", f"{NVIDIA}block": "s1", f"{NVIDIA}spine": "s2", f"{NVIDIA}datacenter": "s3"},
     ("s3", "s2", "s1")),
    ({f"{NVIDIA}block": "s1", f"{NVIDIA}spine": "s2"}, ("s2", "s1")),
])
def test_topographs_leaf_spine_core_labels_of_any_depth_give_the_path_root_first(labels, path):
    assert ns.from_labels(labels, "labels") == (path, "nvidia-topograph")


@pytest.mark.parametrize(("labels", "path"), [
    ({f"{TIER}0": "s1", f"{TIER}1": "s2", f"{TIER}2": "s3"}, ("s3", "s2", "s1")),
    ({f"{TIER}0": "s1", f"{TIER}1": "s2"}, ("s2", "s1")),  # only the present tiers are written
    ({f"{TIER}0": "s1"}, ("s1",)),
])
def test_topograph_1_0s_fabric_tiers_give_the_path_root_first_with_tier_0_the_leaf(labels, path):
    assert ns.from_labels({**labels, DOMAIN: "nvl1"}, "labels") == (path, "topograph")


@pytest.mark.parametrize(("labels", "present", "missing"), [
    ({f"{TIER}0": "s1", f"{TIER}2": "s3"}, f"{TIER}2", f"{TIER}1"),
    ({f"{TIER}1": "s2"}, f"{TIER}1", f"{TIER}0"),
    ({f"{NVIDIA}leaf": "s1", f"{NVIDIA}core": "s3"}, f"{NVIDIA}core", f"{NVIDIA}spine"),
    ({f"{NVIDIA}spine": "s2", f"{NVIDIA}core": "s3"}, f"{NVIDIA}spine", f"{NVIDIA}leaf"),
    ({f"{AWS}1": "nn-e50490a237cb0f01a", f"{AWS}3": "nn-3"}, f"{AWS}3", f"{AWS}2"),
])
def test_a_gap_between_present_levels_is_refused_naming_the_missing_label(labels, present, missing):
    with pytest.raises(InvalidArgument, match=f"labels: the node has {present} but not {missing}"):
        ns.from_labels(labels, "labels")


def test_awss_fourth_layer_the_most_selective_is_the_leaf():
    # EKS's "Place distributed AI/ML workloads with network topology labels": layer-1 is the top (its example value
    # nn-e50490a237cb0f01a); layer-4 is present only on instance types whose topology has four layers, and there it
    # is the bottom.
    labels = {f"{AWS}1": "nn-e50490a237cb0f01a", f"{AWS}2": "nn-2a7cf1d7d3b6f0e11", f"{AWS}3": "nn-3b8d02e8e4c701f22",
              f"{AWS}4": "nn-4c9e13f9f5d812033"}
    assert ns.from_labels(labels, "labels") == (("nn-e50490a237cb0f01a", "nn-2a7cf1d7d3b6f0e11",
                                                  "nn-3b8d02e8e4c701f22", "nn-4c9e13f9f5d812033"), "aws")


@pytest.mark.parametrize(("labels", "domain"), [
    ({DOMAIN: "nvl1", f"{TIER}0": "s1"}, "nvl1"),
    ({f"{NVIDIA}accelerator": "nvl1", f"{NVIDIA}leaf": "s1"}, "nvl1"),
    # the NVL partition as Fabric Manager names it, <ClusterUUID>.<CliqueID>, without any fabric label
    ({"nvidia.com/gpu.clique": "7f3c2a10-5b4e-4d6a-9c1e-2b8f0e6d4a91.1"}, "7f3c2a10-5b4e-4d6a-9c1e-2b8f0e6d4a91.1"),
    ({"kubernetes.io/hostname": "node7"}, ""),
])
def test_the_accelerator_domain_is_read_as_the_hosts_nvlink_partition(labels, domain):
    assert ns.accelerator_domain(labels, "labels")[0] == domain


def test_settings_carry_the_accelerator_domain_from_the_labels_file(tmp_path):
    path = tmp_path / "labels"
    path.write_text(f"{DOMAIN}=nvl1\n{TIER}0=s1\n{TIER}1=s2\n")
    settings = resolve("c:1", environ={"IFRT_NODE_LABELS_FILE": str(path)})
    assert (settings.network, settings.accelerator_domain) == (("s2", "s1"), "nvl1")
    assert settings.network_source == f"IFRT_NODE_LABELS_FILE={str(path)!r} (topograph labels)"


def test_conflicting_sources_are_named_and_warned_once(tmp_path, caplog):
    path = tmp_path / "labels"
    path.write_text(f"{NVIDIA}leaf=s1\n{NVIDIA}spine=s2\n")
    env = {"IFRT_NETWORK_NODES": "spine9,rack3", "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES": "spine9,rack3",
           "IFRT_NODE_LABELS_FILE": str(path)}
    position = ns.choose(None, env, path.read_text())
    assert position.path == ("spine9", "rack3") and position.source == "IFRT_NETWORK_NODES"
    origin = f"IFRT_NODE_LABELS_FILE={str(path)!r} (nvidia-topograph labels)"
    assert position.conflicts == (f"s2/s1 from {origin}",)  # XLA's agrees: no conflict
    with caplog.at_level(logging.WARNING, logger="ifrt.network"):
        for _ in range(3):
            resolve("c:1", environ=env)
    warned = [r.getMessage() for r in caplog.records if r.name == "ifrt.network"]
    assert len(warned) == 1, warned
    assert "spine9/rack3 from IFRT_NETWORK_NODES" in warned[0] and f"s2/s1 from {origin}" in warned[0]


@pytest.mark.parametrize(("value", "character"), [
    ("spine1,rack\u202e7", "U+202E RIGHT-TO-LEFT OVERRIDE"),
    ("spine1,rack\u200f7", "U+200F RIGHT-TO-LEFT MARK"),
    ("spine1,ra\x1b[2Jck7", "U+001B"),
    ("spine1,rack\u20287", "U+2028 LINE SEPARATOR"),
])
def test_control_characters_and_bidi_marks_are_refused_naming_the_source_and_character(value, character):
    with pytest.raises(InvalidArgument, match="IFRT_NETWORK_NODES: level 1 of the network path") as e:
        ns.choose(None, {"IFRT_NETWORK_NODES": value}, None)
    assert character in str(e.value)


def test_a_control_character_in_a_label_is_refused_naming_the_labels_file():
    with pytest.raises(InvalidArgument, match=r"IFRT_NODE_LABELS_FILE='/l' \(aws labels\).*U\+0007"):
        ns.choose(None, {"IFRT_NODE_LABELS_FILE": "/l"}, f"{AWS}1=nn-a\n{AWS}2=nn\x07b\n")


@pytest.mark.parametrize(("value", "path"), [
    ("s1,rack3,", ("s1", "rack3")),  # XLA splits with absl::SkipWhitespace: empty pieces are dropped
    ("spine,pod,rack", ("spine", "pod", "rack")),  # XLA's own test (topology_util_test.cc)
    (",s1,, ,rack3", ("s1", "rack3")),
    (" , ", ()),
])
def test_xlas_variable_is_read_as_xla_splits_it(value, path):
    assert ns.choose(None, {"XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES": value}, None).path == path


def topology_of(paths: dict[str, tuple[str, ...]]):
    """A published topology of one single-device process per host of ``paths``, in this order."""
    from ifrt import wire
    from ifrt.records import Device, Process, TopologyContent
    from ifrt.topology import Topology

    processes = tuple(Process(i, host, "", path) for i, (host, path) in enumerate(paths.items()))
    devices = tuple(Device(i << 17, i, 0, "cpu", "cpu") for i in range(len(paths)))
    return Topology(wire.encode(TopologyContent("", 1, len(paths), processes, devices)), 0)


def test_describe_names_levels_by_their_place_not_as_racks():
    from ifrt.mesh import network_lines

    # topograph's two-tier example: leaves s1 and s3 under spine s2, two hosts on each
    topology = topology_of({"h1": ("s2", "s1"), "h2": ("s2", "s1"), "h3": ("s2", "s3"), "h4": ("s2", "s3")})
    lines = topology.mesh((2, 2), ("data", "fsdp")).describe().splitlines()
    assert lines == ["axis 'data' (2) crosses leaf switches in every ring (2 links), spans the whole job",
                     "axis 'fsdp' (2) crosses hosts in every ring (2 links), stays within each leaf switch"]
    assert network_lines(topology)[:2] == [
        "2 leaf switches of 2 devices each: a mesh's inner axes stay within each leaf switch where together they span "
        "a divisor of 2 devices",
        "1 tier-1 switch of 4 devices each: a mesh's inner axes stay within each tier-1 switch where together they "
        "span a divisor of 4 devices"]


def test_hosts_without_a_position_and_paths_of_mixed_depth_are_named():
    from ifrt.mesh import network_lines

    lines = network_lines(topology_of({"h1": ("s2", "s1"), "h2": (), "h3": ("s3", "s2", "s1"), "h4": ()}))
    assert lines[0].startswith("2 hosts have no network position (h2, h4): they sort before every placed host and "
                               "take the lowest ids"), lines
    assert lines[1].startswith("network paths of mixed depth (2 to 3 levels)"), lines
    assert not any("no network position" in line or "mixed depth" in line
                   for line in network_lines(topology_of({"h1": ("s2", "s1"), "h2": ("s2", "s3")})))


def test_a_host_without_a_position_is_said_where_positions_are_resolved():
    import subprocess
    import sys

    # a process of its own: the line is said once per process
    code = ("import logging; logging.basicConfig(level=logging.INFO); from ifrt.settings import network_position; "
            "network_position(None, {'SLURM_TOPOLOGY_ADDR': 'node7'}); network_position(None, {})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("this host has no network position") == 1, run.stderr


def test_the_coordinator_names_hosts_without_a_position_beside_hosts_with_one(start_coordinator):
    # Reproduced: a host with no position was ordered before every placed host, and nothing said so.
    coordinator = start_coordinator(num_processes=2)

    def discover(i: int):
        with ifrt.Client(coordinator.address, process_id=i, num_processes=2, timeout=60, transfer=False,
                         network=("spine", "rack1") if i else ()) as client:
            return client.discover()

    topologies = together(range(2), discover, timeout=90)
    assert [p.network for p in topologies[0].processes] == [(), ("spine", "rack1")]
    coordinator.wait_for_log("generation 1: 1 processes have no network position")
    said = next(line for line in coordinator.log.splitlines() if "no network position" in line)
    assert "order: 0 on " in said and "1 on " not in said


def test_the_nvlink_partition_of_the_node_labels_is_the_slice_of_devices_that_name_none(start_coordinator, tmp_path):
    coordinator = start_coordinator(num_processes=3)
    domains = ["5c1b0e2a.1", "5c1b0e2a.2", "5c1b0e2a.1"]  # hosts 0 and 2 share an NVLink partition

    def discover(i: int):
        labels = tmp_path / f"labels-{i}"
        labels.write_text(f"accelerator.topograph.run/domain={domains[i]}\n")
        with ifrt.Client(coordinator.address, process_id=i, num_processes=3, timeout=60, transfer=False,
                         environ={"IFRT_NODE_LABELS_FILE": str(labels)}) as client:
            return client.discover()

    topology = together(range(3), discover, timeout=90)[0]
    slices = {d.process_id: d.slice_index for d in topology.devices}
    assert slices[0] == slices[2] != slices[1]
