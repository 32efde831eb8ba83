import json

import numpy as np
import pytest

from ifrt import Topology, TopologyError, wire
from ifrt.records import TopologyContent
from tests.helpers import content


def topology(process_id=1, **kwargs):
    return Topology(wire.encode(content(**kwargs)), process_id)


def test_views_of_one_process():
    t = topology(process_id=2, num_processes=4, devices_per_process=2)
    assert (t.process_id, t.num_processes, t.generation, t.cluster_id) == (2, 4, 1, "job")
    assert [d.id for d in t.local_devices] == [2 << 17, 2 << 17 | 1]
    assert all(d.process_id == 2 for d in t.local_devices)
    assert [p.process_id for p in t.processes] == [0, 1, 2, 3]
    assert t.process(3).hostname == "host3"
    assert t.device(3 << 17 | 1).local_id == 1
    assert t.global_ids.dtype == np.int64
    assert t.global_ids.tolist() == [0, 1, 131072, 131073, 262144, 262145, 393216, 393217]


def test_fingerprint_is_sha256_of_canonical_bytes_and_same_for_every_process():
    a, b = topology(process_id=0), topology(process_id=3)
    assert a.fingerprint == b.fingerprint == wire.fingerprint(a.canonical_bytes)
    assert a.canonical_bytes == b.canonical_bytes
    assert a != b


def test_dict_round_trip_is_exact():
    t = topology(attributes=True)
    again = Topology.from_dict(json.loads(t.to_json()))
    assert again == t
    assert again.fingerprint == t.fingerprint
    assert again.to_dict() == t.to_dict()


def test_dict_has_the_documented_fields():
    d = topology(attributes=True).to_dict()
    assert {"process_id", "num_processes", "generation", "fingerprint", "devices", "processes"} <= set(d)
    assert set(d["devices"][0]) == {"id", "process_id", "local_id", "platform", "kind", "slice_index", "attributes",
                                    "plugin", "coordinates"}
    assert set(d["processes"][0]) == {"process_id", "hostname", "address", "network"}


def test_edited_dict_no_longer_matches_its_fingerprint():
    d = topology().to_dict()
    d["devices"][0]["kind"] = "something-else"
    with pytest.raises(TopologyError, match="fingerprint mismatch"):
        Topology.from_dict(d)


def test_malformed_dict_is_a_topology_error():
    d = topology().to_dict()
    del d["devices"][0]["local_id"]
    with pytest.raises(TopologyError, match="malformed"):
        Topology.from_dict(d)


def test_unknown_ids_name_themselves():
    t = topology()
    with pytest.raises(KeyError, match="12345"):
        t.device(12345)
    with pytest.raises(TopologyError, match="process id 9 is not in the topology"):
        Topology(t.canonical_bytes, 9)


def test_local_devices_are_the_processes_own_and_empty_without_any():
    c = content(num_processes=3, devices_per_process=4)
    without_1 = TopologyContent(c.cluster_id, c.generation, 3, c.processes,
                                tuple(d for d in c.devices if d.process_id != 1))
    canonical = wire.encode(without_1)
    assert Topology(canonical, 1).local_devices == ()
    assert [d.id for d in Topology(canonical, 2).local_devices] == [2 << 17 | i for i in range(4)]
    assert Topology(canonical, 0).local_devices == tuple(d for d in without_1.devices if d.process_id == 0)
