"""Where a process's network position comes from: each source's parser, table-tested, and the order they are tried."""

from __future__ import annotations

import pytest

from ifrt import network_sources as ns
from ifrt.errors import InvalidArgument
from ifrt.settings import network_position, resolve

NVIDIA = "network.topology.nvidia.com/"
AWS = "topology.k8s.aws/network-node-layer-"
GCE = "cloud.google.com/gce-topology-"
OCI = "oci.oraclecloud.com/host."


@pytest.mark.parametrize(("value", "path"), [
    ("", ()),
    ("  ", ()),
    ("rack7", ("rack7",)),
    ("spine1,block2,rack7", ("spine1", "block2", "rack7")),
    (" spine1 , block2 ", ("spine1", "block2")),
])
def test_nodes_are_comma_separated_root_first(value, path):
    assert ns.parse_nodes(value, "IFRT_NETWORK_NODES") == path


@pytest.mark.parametrize(("value", "said"), [
    ("spine1,,rack7", "level 1 of the network path"),
    ("spine1, ", "level 1"),
    (",".join(f"l{i}" for i in range(9)), "9 levels"),
    ("spine1," + "r" * 256, "256 bytes"),
])
def test_bad_nodes_are_refused_by_name(value, said):
    with pytest.raises(InvalidArgument, match="IFRT_NETWORK_NODES") as e:
        ns.parse_nodes(value, "IFRT_NETWORK_NODES")
    assert said in str(e.value)


@pytest.mark.parametrize(("address", "pattern", "path"), [
    ("root.sw1.rack3.node7", "switch.switch.switch.node", ("root", "sw1", "rack3")),  # topology/tree
    ("block3.node7", "block.node", ("block3",)),  # topology/block
    ("node7", "node", ()),  # no switch above the node
    ("s1.s2.node7", "switch.switch.NODE", ("s1", "s2")),
])
def test_slurm_gives_the_switch_levels_and_drops_the_node(address, pattern, path):
    assert ns.parse_slurm(address, pattern) == path


def test_a_slurm_pattern_of_another_length_is_refused_naming_both_variables():
    with pytest.raises(InvalidArgument) as e:
        ns.parse_slurm("root.sw1.node7", "switch.switch.switch.node")
    said = str(e.value)
    assert "SLURM_TOPOLOGY_ADDR='root.sw1.node7' has 3 levels" in said
    assert "SLURM_TOPOLOGY_ADDR_PATTERN='switch.switch.switch.node' has 4" in said


def test_a_slurm_address_with_an_empty_level_is_refused():
    with pytest.raises(InvalidArgument, match=r"SLURM_TOPOLOGY_ADDR.*level 1 .* is empty"):
        ns.parse_slurm("root..node7", "switch.switch.node")


def test_labels_are_key_value_lines_as_kubectl_or_a_shell_writes_them():
    text = "# node labels\n\nkubernetes.io/hostname=node7\n  topology.k8s.aws/network-node-layer-1 = nn-1 \n" \
           "quoted=\"a b\"\nempty=\n"
    assert ns.parse_labels(text, "f") == {"kubernetes.io/hostname": "node7", f"{AWS}1": "nn-1", "quoted": "a b",
                                          "empty": ""}
    with pytest.raises(InvalidArgument, match="f line 2 is 'no equals sign': expected key=value"):
        ns.parse_labels("a=b\nno equals sign\n", "f")


@pytest.mark.parametrize(("labels", "path", "family"), [
    ({f"{NVIDIA}core": "core1", f"{NVIDIA}spine": "spine2", f"{NVIDIA}leaf": "leaf3",
      f"{NVIDIA}accelerator": "nvl1"}, ("core1", "spine2", "leaf3"), "nvidia-topograph"),
    ({f"{NVIDIA}spine": "spine2", f"{NVIDIA}leaf": "leaf3"}, ("spine2", "leaf3"), "nvidia-topograph"),
    ({f"{AWS}1": "nn-a", f"{AWS}2": "nn-b", f"{AWS}3": "nn-c"}, ("nn-a", "nn-b", "nn-c"), "aws"),
    ({f"{GCE}block": "b1", f"{GCE}subblock": "sb2", f"{GCE}host": "h3"}, ("b1", "sb2"), "gce"),
    ({f"{OCI}network_block_id": "ocid1.block", f"{OCI}rack_id": "ocid1.rack"}, ("ocid1.block", "ocid1.rack"), "oci"),
    # Two families on one node: the earlier in LABEL_FAMILIES wins.
    ({f"{AWS}1": "nn-a", f"{NVIDIA}leaf": "leaf1"}, ("leaf1",), "nvidia-topograph"),
    ({"kubernetes.io/hostname": "node7", "topology.kubernetes.io/zone": "us-east-1a"}, None, None),
])
def test_each_label_family_gives_its_levels_root_first(labels, path, family):
    found = ns.from_labels(labels, "labels")
    assert found == (None if path is None else (path, family))


def test_a_label_family_with_a_level_missing_in_between_is_refused():
    with pytest.raises(InvalidArgument, match=f"has {AWS}3 but not {AWS}2"):
        ns.from_labels({f"{AWS}1": "a", f"{AWS}3": "c"}, "labels")


def test_the_first_source_that_gives_a_position_wins():
    labels = f"{AWS}1=nn-a\n"
    env = {"IFRT_NETWORK_NODES": "i1,i2", "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES": "x1",
           "SLURM_TOPOLOGY_ADDR": "s1.node7", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.node",
           "IFRT_NODE_LABELS_FILE": "/labels"}
    later = ["i1/i2 from IFRT_NETWORK_NODES", "x1 from XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES",
             "s1 from SLURM_TOPOLOGY_ADDR with SLURM_TOPOLOGY_ADDR_PATTERN",
             "nn-a from IFRT_NODE_LABELS_FILE='/labels' (aws labels)"]  # each later source, named as a conflict
    assert ns.choose(["g1", "g2"], env, labels) == ns.Position(("g1", "g2"), "network=", tuple(later))
    assert ns.choose("g1,g2", env, labels) == ns.Position(("g1", "g2"), "network=", tuple(later))
    assert ns.choose(None, env, labels) == ns.Position(("i1", "i2"), "IFRT_NETWORK_NODES", tuple(later[1:]))
    del env["IFRT_NETWORK_NODES"]
    assert ns.choose(None, env, labels) == ns.Position(("x1",), "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES",
                                                        tuple(later[2:]))
    del env["XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES"]
    assert ns.choose(None, env, labels).source == "SLURM_TOPOLOGY_ADDR with SLURM_TOPOLOGY_ADDR_PATTERN"
    del env["SLURM_TOPOLOGY_ADDR"]
    assert ns.choose(None, env, labels) == ns.Position(("nn-a",), "IFRT_NODE_LABELS_FILE='/labels' (aws labels)")
    assert ns.choose("nn-a", env, labels) == ns.Position(("nn-a",), "network=")  # agreeing sources: no conflict
    assert ns.choose(None, env, "other=1\n") == ns.Position((), "")
    assert ns.choose(None, {}, None) == ns.Position((), "")


def test_a_broken_later_source_is_named_not_fatal_where_an_earlier_one_gives_the_position():
    # an operator overrides a node whose labels skip a level: the job runs, and the broken labels are named
    position = ns.choose(None, {"IFRT_NETWORK_NODES": "s1,r1", "IFRT_NODE_LABELS_FILE": "/l"}, f"{AWS}1=a\n{AWS}3=c\n")
    assert position.path == ("s1", "r1")
    assert position.conflicts == (f"IFRT_NODE_LABELS_FILE='/l' (aws labels) is not used: IFRT_NODE_LABELS_FILE='/l': "
                                  f"the node has {AWS}3 but not {AWS}2: expected every level of the aws labels from "
                                  f"the root ({AWS}1) down to the lowest one present (the path would silently skip a "
                                  "switch)",)
    with pytest.raises(InvalidArgument, match=f"has {AWS}3 but not {AWS}2"):
        ns.choose(None, {"IFRT_NODE_LABELS_FILE": "/l"}, f"{AWS}1=a\n{AWS}3=c\n")


def test_a_bad_network_argument_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="network=: level 1 of the network path"):
        ns.choose(["spine1", ""], {}, None)


def test_settings_read_the_labels_file(tmp_path):
    path = tmp_path / "labels"
    path.write_text(f"{GCE}block=b1\n{GCE}subblock=sb2\n{GCE}host=h3\n")
    settings = resolve("c:1", environ={"IFRT_NODE_LABELS_FILE": str(path)})
    assert settings.network == ("b1", "sb2")
    assert settings.network_source == f"IFRT_NODE_LABELS_FILE={str(path)!r} (gce labels)"
    assert resolve("c:1", network="a,b", environ={}).network == ("a", "b")
    assert resolve("c:1", environ={}).network == ()


def test_a_labels_file_that_cannot_be_read_is_refused_naming_its_path(tmp_path):
    missing = tmp_path / "no-such-file"
    with pytest.raises(InvalidArgument, match=f"IFRT_NODE_LABELS_FILE='{missing}' cannot be read"):
        network_position(None, {"IFRT_NODE_LABELS_FILE": str(missing)})
    with pytest.raises(InvalidArgument, match=r"IFRT_NODE_LABELS_FILE=.* cannot be read"):
        network_position(None, {"IFRT_NODE_LABELS_FILE": str(tmp_path)})  # a directory
