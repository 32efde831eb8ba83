"""Same events, same bytes: a journal replayed under any hash seed, in any replica, publishes one topology.

Orders that reach the wire must be total; set or dict iteration (which follows ``PYTHONHASHSEED`` for strings)
must never break a tie. Each replay runs in an interpreter of its own hash seed (one per seed, for the module).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.core import journal
from coordinator.core.assignment import assign_process_ids
from coordinator.core.registration import Registration
from ifrt.network import natural_key, path_key
from ifrt.records import LocalDevice

SEEDS = ("0", "1", "2", "3", "4", "5")
REPLAY = """
import json, sys
from coordinator.core import journal
from coordinator.core.cluster import ClusterConfig
from coordinator.core.state import ClusterState
from ifrt import wire
for line in sys.stdin:
    out = []
    for scenario in json.loads(line):
        state = ClusterState(ClusterConfig(num_processes=scenario["n"], cluster_id="job"))
        for entry in scenario["journal"]:
            state.replay(journal.decode(entry.encode()))
        out.append(wire.encode(state.topology).hex() if state.topology else None)
    print(json.dumps(out), flush=True)
"""
"""Reads lists of scenarios, a JSON line each, and answers each with a line: the topology (hex) of each scenario's
journal replayed into a fresh ClusterState."""
REPLAY_TIMEOUT_S = 120


def registration(uid: str, *, host: str = "node", ip: str = "10.0.0.1", rank: int = 0,
                 slices: tuple[str, ...] = ("",), pid: int | None = None,
                 network: tuple[str, ...] = ()) -> Registration:
    devices = tuple(LocalDevice(i, "cpu", "cpu", slice_key=key) for i, key in enumerate(slices))
    return Registration(uid, "", 0, pid, host, ip, rank, f"{host}:9000", devices, "cpu", network=network)


@pytest.fixture(scope="module")
def replayed_under_each_seed() -> Iterator[Callable[[list[dict]], dict[str, list[str | None]]]]:
    """``replayed_under_each_seed(scenarios)``: the canonical topology bytes (hex) of each scenario, replayed in an
    interpreter of each hash seed (started once for the module: a replay starts from a fresh ClusterState)."""
    interpreters = {seed: subprocess.Popen([sys.executable, "-c", REPLAY], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           env={**os.environ, "PYTHONHASHSEED": seed}) for seed in SEEDS}

    def replayed(scenarios: list[dict]) -> dict[str, list[str | None]]:
        request = json.dumps(scenarios) + "\n"
        for interpreter in interpreters.values():
            interpreter.stdin.write(request)
            interpreter.stdin.flush()
        results = {}
        for seed, interpreter in interpreters.items():
            answered = select.select([interpreter.stdout], [], [], REPLAY_TIMEOUT_S)[0]
            line = interpreter.stdout.readline() if answered else ""
            if not line:
                interpreter.kill()
                pytest.fail(f"the replay under hash seed {seed} did not answer within {REPLAY_TIMEOUT_S}s:\n"
                            f"{interpreter.communicate()[1][-3000:]}")
            results[seed] = json.loads(line)
        return results

    yield replayed
    for interpreter in interpreters.values():
        interpreter.stdin.close()
    for interpreter in interpreters.values():
        try:
            interpreter.wait(timeout=30)
        except subprocess.TimeoutExpired:
            interpreter.kill()
            interpreter.wait()


def journal_of(registrations: list[Registration]) -> list[str]:
    return [journal.encode(journal.Registered(r, float(i))).decode() for i, r in enumerate(registrations)]


def test_slice_keys_equal_as_numbers_are_numbered_the_same_under_every_hash_seed(replayed_under_each_seed):
    keys = ("slice-1", "slice-01", "slice-001", "slice-10", "slice-2", "slice-0001")
    regs = [registration(f"u{i}", host=f"h{i}", slices=(key,)) for i, key in enumerate(keys)]
    results = replayed_under_each_seed([{"n": len(regs), "journal": journal_of(regs)}])
    assert len({json.dumps(r) for r in results.values()}) == 1, results
    from ifrt import wire

    topology = wire.decode(bytes.fromhex(results["0"][0]))
    by_key = {keys[int(p.hostname[1:])]: topology.devices[p.process_id].slice_index for p in topology.processes}
    # Natural order, and among keys equal as numbers, the text order: "slice-0001" < "slice-001" < ... .
    assert by_key == {"slice-0001": 0, "slice-001": 1, "slice-01": 2, "slice-1": 3, "slice-2": 4, "slice-10": 5}


hosts = st.sampled_from(["a", "b", "node", "node-10", "node-2", "node-02", "node10"])
addresses = st.sampled_from(["10.0.0.2", "10.0.0.10", "10.0.0.9", "::1", "fe80::2", "192.168.1.1", "host.local"])
slice_keys = st.sampled_from(["", "s", "slice-1", "slice-01", "slice-001", "slice-2", "slice-10", "x-1-2", "x-01-2"])
levels = st.sampled_from(["spine1", "spine10", "spine2", "rack1", "rack01", "rack9", "rack10", "b"])
networks = st.lists(levels, max_size=3).map(tuple)
processes = st.lists(st.tuples(hosts, addresses, st.integers(0, 3), st.lists(slice_keys, min_size=1, max_size=3),
                               networks),
                     min_size=1, max_size=8, unique_by=lambda p: (p[0], p[1], p[2]))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(processes, st.randoms(use_true_random=False)), min_size=5, max_size=10))
def test_any_journal_replays_to_the_same_bytes_under_every_hash_seed(replayed_under_each_seed, cases):
    scenarios = []
    for spec, rnd in cases:
        regs = [registration(f"u{i}", host=h, ip=ip, rank=rank, slices=tuple(keys), network=network)
                for i, (h, ip, rank, keys, network) in enumerate(spec)]
        rnd.shuffle(regs)  # arrival order is part of the events, and must not matter either
        scenarios.append({"n": len(regs), "journal": journal_of(regs)})
    results = replayed_under_each_seed(scenarios)
    assert len({json.dumps(r) for r in results.values()}) == 1, results
    assert all(r is not None for r in results["0"])


def test_assigned_ids_sort_host_addresses_as_addresses():
    addresses = ["fe80::2", "10.0.0.10", "::1", "10.0.0.2", "10.0.0.9", "192.168.1.1", "host.local"]
    regs = [registration(f"u-{a}", ip=a) for a in addresses]
    ids = assign_process_ids(regs)
    order = sorted(addresses, key=lambda a: ids[f"u-{a}"])
    assert order == ["10.0.0.2", "10.0.0.9", "10.0.0.10", "192.168.1.1", "::1", "fe80::2", "host.local"]


def test_hostname_still_comes_before_the_address():
    regs = [registration("u1", host="b", ip="10.0.0.1"), registration("u2", host="a", ip="10.0.0.9")]
    assert assign_process_ids(regs) == {"u2": 0, "u1": 1}


@settings(max_examples=200, deadline=None)
@given(processes, st.randoms(use_true_random=False))
def test_assigned_ids_follow_the_network_then_slice_then_natural_hostname_in_any_arrival_order(spec, rnd):
    regs = [registration(f"u{i}", host=h, ip=ip, rank=rank, slices=tuple(keys), network=network)
            for i, (h, ip, rank, keys, network) in enumerate(spec)]
    ids = assign_process_ids(regs)
    shuffled = regs[:]
    rnd.shuffle(shuffled)
    assert assign_process_ids(shuffled) == ids
    ordered = sorted(regs, key=lambda r: ids[r.client_uid])
    assert sorted(ids.values()) == list(range(len(regs)))
    for a, b in pairwise(ordered):  # each neighbour pair in order: network first, then slice, then host
        assert path_key(a.network) <= path_key(b.network)
        if a.network == b.network:
            assert natural_key(a.devices[0].slice_key) <= natural_key(b.devices[0].slice_key)
            if a.devices[0].slice_key == b.devices[0].slice_key:
                assert natural_key(a.hostname) <= natural_key(b.hostname)


def test_consecutive_ids_share_the_smallest_domain():
    racks = {("s1", "rack10"): ["n1", "n2"], ("s1", "rack2"): ["n3", "n4"], ("s2", "rack1"): ["n5"], (): ["n6"]}
    regs = [registration(f"u-{h}", host=h, network=path) for path, names in racks.items() for h in names]
    ids = assign_process_ids(regs)
    assert sorted(ids, key=ids.get) == ["u-n6", "u-n3", "u-n4", "u-n1", "u-n2", "u-n5"]


def test_explicit_ids_are_kept_whatever_the_network():
    regs = [registration("u1", host="a", pid=0, network=("s2",)), registration("u2", host="b", pid=1, network=("s1",))]
    assert assign_process_ids(regs) == {"u1": 0, "u2": 1}
