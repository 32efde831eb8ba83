import random
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ifrt import global_device_id, wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import TopologyError
from ifrt.records import Device, Process


def content(num_processes=4, devices_per_process=8, attributes=False, kind="tpu-v5e"):
    processes = tuple(Process(p, f"host{p}", f"10.0.0.{p}:9000") for p in range(num_processes))
    devices = tuple(
        Device(global_device_id(p, i), p, i, "tpu", kind, p // 2,
               {"uuid": f"dev-{p}-{i}", "memory": "16G"} if attributes else {}, "sim", (i // 2, i % 2))
        for p in range(num_processes) for i in range(devices_per_process))
    return wire.TopologyContent("job", 1, num_processes, processes, devices)


def test_decode_inverts_encode():
    c = content(attributes=True)
    assert wire.decode(wire.encode(c)) == c


def test_encoding_is_canonical_whatever_the_input_order():
    c = content(attributes=True)
    shuffled = list(c.devices)
    random.Random(7).shuffle(shuffled)
    reordered = wire.TopologyContent(c.cluster_id, c.generation, c.num_processes, c.processes[::-1], tuple(shuffled))
    assert wire.encode(reordered) == wire.encode(c)


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4),
       st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4))
def test_attributes_round_trip(a, b):
    c = wire.TopologyContent("", 3, 1, (Process(0, "h"),),
                             (Device(0, 0, 0, "cpu", "cpu", 0, a), Device(1, 0, 1, "cpu", "cpu", 0, b)))
    assert wire.decode(wire.encode(c)) == c


def test_global_ids_and_repeated_strings_are_not_sent_per_device():
    small, large = content(4, 8), content(64, 8)
    per_device = (len(wire.encode(large)) - len(wire.encode(small))) / (len(large.devices) - len(small.devices))
    assert per_device < 15  # local id, 3 small indices, 2 coordinates; no global id, no kind string
    assert wire.encode(large).count(b"tpu-v5e") == 1


def test_compression_round_trips_and_is_used_for_large_topologies():
    canonical = wire.encode(content(512, 8))
    encoding, payload = wire.compress(canonical)
    assert encoding == pb.ENCODING_ZLIB and len(payload) < len(canonical) / 2
    assert wire.decompress(encoding, payload) == canonical
    small = wire.encode(content(1, 1))
    assert wire.compress(small) == (pb.ENCODING_RAW, small)


def test_corrupt_compressed_payload_is_a_topology_error():
    encoding, payload = wire.compress(wire.encode(content(512, 8)))
    with pytest.raises(TopologyError, match="truncated"):
        wire.decompress(encoding, payload[: len(payload) // 2])
    with pytest.raises(TopologyError, match="corrupt"):
        wire.decompress(encoding, b"not zlib at all")
    with pytest.raises(TopologyError, match="unknown topology encoding 7"):
        wire.decompress(7, payload)


def test_inflating_past_the_limit_is_refused(monkeypatch):
    monkeypatch.setattr(wire, "MAX_TOPOLOGY_BYTES", 1000)
    with pytest.raises(TopologyError, match="inflates past 1000"):
        wire.decompress(pb.ENCODING_ZLIB, zlib.compress(b"\0" * 100_000))


def test_malformed_bytes_are_a_topology_error():
    with pytest.raises(TopologyError, match="do not parse"):
        wire.decode(b"\xff\xff\xff")
    bad_index = pb.Topology(strings=[""], processes=[pb.ProcessEntry(process_id=0, local_ids=[0], platforms=[5],
                                                                     kinds=[0], slice_indices=[0])])
    with pytest.raises(TopologyError, match="inconsistent"):
        wire.decode(bad_index.SerializeToString())


@pytest.mark.parametrize(("devices", "message"), [
    ((Device(5, 0, 4, "cpu", "cpu"),), "is not process_id 0 << 17"),
    ((Device(0, 0, 0, "cpu", "cpu"), Device(0, 0, 0, "cpu", "cpu")), "local device id twice"),
    ((Device(1 << 17, 1, 0, "cpu", "cpu"),), "not in the topology"),
    ((Device(0, 0, 0, "cpu", "cpu", coordinates=(0,)), Device(1, 0, 1, "cpu", "cpu")), "coordinate ranks"),
])
def test_inconsistent_content_is_refused(devices, message):
    with pytest.raises(TopologyError, match=message):
        wire.encode(wire.TopologyContent("", 1, 1, (Process(0, "h"),), devices))
