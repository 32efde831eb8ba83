"""torchrun's ``--rdzv-backend ifrt`` ranks nodes in network order: network path level by level, then hostname in
natural order, then address; what an agent publishes is checked like any position."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from ifrt.errors import InvalidArgument
from ifrt.torchrun import HostKey, agent_position, host_entry, node_ranks
from tests.test_torchrun import finish_all, results, torchrun  # noqa: F401 (torchrun is a fixture)


def test_node_ranks_follow_the_network_then_natural_hostnames():
    hosts = {"a": HostKey("node10", "10.0.0.1", ("spine", "rack2")), "b": HostKey("node2", "10.0.0.2", ("spine",
             "rack10")), "c": HostKey("node9", "10.0.0.3", ("spine", "rack2")), "d": HostKey("node1", "10.0.0.4")}
    # no position first (XLA's empty path), then rack2 before rack10, node9 before node10 inside rack2
    assert node_ranks(hosts) == {"d": 0, "c": 1, "a": 2, "b": 3}


def test_an_agent_reads_its_position_from_ifrt_network_nodes_and_refuses_a_bad_one():
    assert agent_position({"IFRT_NETWORK_NODES": "spine1, block2,rack7"}) == ("spine1", "block2", "rack7")
    assert agent_position({}) == ()
    with pytest.raises(InvalidArgument, match=r"IFRT_NETWORK_NODES: level 1 of the network path .* is empty"):
        agent_position({"IFRT_NETWORK_NODES": "spine1,,rack7"})
    with pytest.raises(InvalidArgument, match="IFRT_NETWORK_NODES: a network path of 9 levels"):
        agent_position({"IFRT_NETWORK_NODES": ",".join(f"l{i}" for i in range(9))})


def test_a_published_position_is_read_back_and_a_bad_one_refused_naming_the_key():
    key = "torchrun/job/hosts/n1"
    entry = {"hostname": "node7", "address": "10.0.0.7", "network": ["spine", "rack3"]}
    assert host_entry(key, json.dumps(entry).encode()) == HostKey("node7", "10.0.0.7", ("spine", "rack3"))
    old = {"hostname": "node7", "address": "10.0.0.7"}  # an agent of a version without positions
    assert host_entry(key, json.dumps(old).encode()) == HostKey("node7", "10.0.0.7")
    for bad in ({**entry, "network": "spine,rack3"}, {**entry, "network": [1]}, {**entry, "extra": 1}):
        with pytest.raises(RendezvousStateError, match=f"refused the node's host at '{key}'"):
            host_entry(key, json.dumps(bad).encode())
    with pytest.raises(RendezvousStateError, match=r"refused the node.s host: .*level 0 of the network path"):
        host_entry(key, json.dumps({**entry, "network": [" ", "rack3"]}).encode())


def test_agents_in_two_racks_get_node_ranks_in_rack_order_not_address_order(start_coordinator, torchrun,  # noqa: F811
                                                                            tmp_path):
    coordinator = start_coordinator(num_processes=4)
    # by address 127.0.0.9 would be node 0 (ifrt's order without positions); its rack, rack10, comes after rack2
    placed = {"127.0.0.9": "spine,rack10", "127.0.0.10": "spine,rack2"}
    agents = [torchrun(coordinator.address, "racks", addr, ifrt_env={"IFRT_NETWORK_NODES": rack})
              for addr, rack in placed.items()]
    finish_all(agents)
    reports = results(tmp_path)
    assert {r["node_addr"]: r["GROUP_RANK"] for r in reports} == {"127.0.0.10": "0", "127.0.0.9": "1"}
    assert {r["MASTER_ADDR"] for r in reports} == {"127.0.0.10"}
