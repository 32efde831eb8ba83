"""ifrt.jax where XLA's own network variable is set: JAX's process indices stay ifrt's, in real JAX processes."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.helpers import json_answers
from tests.requirements import require
from tests.workers import start_jax_workers

if importlib.util.find_spec("jax") is None:
    require("jax", "pip install 'ifrt-topology[jax]' (scripts/test.sh installs it)")

import ifrt.jax
from ifrt import wire
from ifrt.records import Device, Process, TopologyContent
from ifrt.topology import Topology

TIMEOUT = 120
XLA_VAR = "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES"
POSITIONS = ["s1,rack10", "s1,rack9", "s0,rack3", "s1,rack10"]
"""By local rank. Compared as text (as XLA compares them) rack10 comes before rack9; ifrt compares naturally."""


def run_job(start_coordinator, env_by_rank: dict[int, dict[str, str]]) -> list[dict]:
    coordinator = start_coordinator(num_processes=len(POSITIONS), log_level="WARNING")
    return json_answers(start_jax_workers(coordinator.address, len(POSITIONS), "network", extra_env=env_by_rank),
                        TIMEOUT)


def assert_jax_agrees(answers: list[dict]) -> None:
    """Every process's JAX index is its ifrt id, and a computation across all of them is right."""
    assert [a["jax_process_index"] for a in answers] == [a["process_id"] for a in answers]
    assert len({a["fingerprint"] for a in answers}) == 1
    for a in answers:
        assert a["result_matches_reference"] and a["addressable_shards"] == 2


@pytest.mark.slow
def test_jax_keeps_assigned_ids_when_xla_network_variable_is_set(start_coordinator):
    answers = run_job(start_coordinator, {rank: {XLA_VAR: p} for rank, p in enumerate(POSITIONS)})

    assert_jax_agrees(answers)
    # ifrt's ids follow the network in natural order: rack3, then rack9, then the two processes of rack10
    assert [a["process_id"] for a in answers] == [2, 1, 0, 3]
    assert [",".join(a["network"]) for a in answers] == POSITIONS  # XLA's variable is still ifrt's source
    assert [a["xla_network_nodes"] for a in answers] == POSITIONS  # and the user's value is there afterwards


@pytest.mark.slow
def test_jax_keeps_launcher_ids_when_xla_network_variable_is_set(start_coordinator):
    answers = run_job(start_coordinator, {rank: {XLA_VAR: p, "IFRT_PROCESS_ID": str(rank)}
                                          for rank, p in enumerate(POSITIONS)})

    assert_jax_agrees(answers)
    assert [a["process_id"] for a in answers] == [0, 1, 2, 3]  # the launcher's ids, against the network
    assert [",".join(a["network"]) for a in answers] == POSITIONS
    assert [a["xla_network_nodes"] for a in answers] == POSITIONS


@pytest.mark.slow
def test_jax_keeps_ids_when_processes_take_their_position_from_different_variables(start_coordinator):
    # two processes say where they are with XLA's variable, two with ifrt's: JAX must not see only half of them
    env = {rank: {XLA_VAR if rank % 2 else "IFRT_NETWORK_NODES": p} for rank, p in enumerate(POSITIONS)}
    answers = run_job(start_coordinator, env)

    assert_jax_agrees(answers)
    assert [a["process_id"] for a in answers] == [2, 1, 0, 3]
    assert [a["xla_network_nodes"] for a in answers] == [None, POSITIONS[1], None, POSITIONS[3]]


# XLA's network nodes from the topology, on plain values.
def topology_at(*networks: str, process_id: int = 0) -> Topology:
    """A topology of one CPU device per process at these network paths (comma-separated), seen by ``process_id``."""
    processes = tuple(Process(p, f"h{p}", "", network=tuple(n.split(",")) if n else ())
                      for p, n in enumerate(networks))
    devices = tuple(Device(p << 17, p, 0, "cpu", "cpu") for p in range(len(networks)))
    return Topology(wire.encode(TopologyContent("", 1, len(networks), processes, devices)), process_id)


def xla_order(nodes: dict[int, tuple[str, ...]]) -> list[int]:
    """Process ids in the order XLA sorts them: network nodes compared as text, level by level, stable on ids."""
    return sorted(nodes, key=lambda p: (nodes[p], p))


def test_xla_network_nodes_sort_as_text_in_ifrts_order_and_keep_shared_switches():
    # ids in ifrt's order: the empty path first (XLA sorts it first too), then rack3, rack9, rack10, rack10
    names = ["", "s0,rack3", "s1,rack9", "s1,rack10", "s1,rack10", "s1,rack10,row2", "s10,rack1", "s10,rack1"]
    nodes = ifrt.jax.xla_network_nodes(topology_at(*names))

    assert nodes is not None and xla_order(nodes) == list(range(len(names)))
    assert sorted(names) != names  # as text, the original names would have been reordered
    assert nodes[0] == () and [len(n) for n in nodes.values()] == [len(n.split(",")) if n else 0 for n in names]
    assert nodes[3] == nodes[4] and nodes[6] == nodes[7]  # one rack, one name
    assert nodes[5][:2] == nodes[3] and nodes[2][0] == nodes[3][0] != nodes[1][0] != nodes[6][0]  # shared switches


def test_no_xla_network_nodes_where_ids_go_against_the_network():
    assert ifrt.jax.xla_network_nodes(topology_at("s1,rack10", "s1,rack9", "s0,rack3")) is None
    assert ifrt.jax.xla_network_nodes(topology_at("", "")) is None  # nothing to tell XLA


def test_xla_sees_ranked_names_while_jax_starts_and_the_users_value_afterwards(monkeypatch, caplog):
    monkeypatch.setenv(XLA_VAR, "s1,rack10")
    caplog.set_level("INFO", logger="ifrt.jax")
    topology = topology_at("s0,rack3", "s1,rack9", "s1,rack10", "s1,rack10", process_id=2)  # process 2's view
    with ifrt.jax.network_for_xla(topology):
        assert os.environ[XLA_VAR] == "1,2"  # spine s1 is the second of two, rack10 the third rack
    assert os.environ[XLA_VAR] == "s1,rack10"
    (record,) = caplog.records
    assert f"{XLA_VAR}=1,2 while JAX starts" in record.getMessage() and "'s1,rack10'" in record.getMessage()

    caplog.clear()
    against = topology_at("s1,rack10", "s1,rack9", "s0,rack3")  # launcher ids
    with ifrt.jax.network_for_xla(against):
        assert XLA_VAR not in os.environ
    assert os.environ[XLA_VAR] == "s1,rack10"
    (record,) = caplog.records
    assert "hidden from JAX" in record.getMessage() and "do not follow the network" in record.getMessage()
