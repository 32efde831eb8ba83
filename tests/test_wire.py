import random
import re
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ifrt import global_device_id, wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import TopologyError
from ifrt.records import Device, LocalDevice, Process, TopologyContent
from tests.helpers import content


def test_decode_inverts_encode():
    c = content(attributes=True)
    assert wire.decode(wire.encode(c)) == c


def test_encoding_is_canonical_whatever_the_input_order():
    c = content(attributes=True)
    shuffled = list(c.devices)
    random.Random(7).shuffle(shuffled)
    reordered = TopologyContent(c.cluster_id, c.generation, c.num_processes, c.processes[::-1], tuple(shuffled))
    assert wire.encode(reordered) == wire.encode(c)


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4),
       st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4))
def test_attributes_round_trip(a, b):
    c = TopologyContent("", 3, 1, (Process(0, "h"),),
                        (Device(0, 0, 0, "cpu", "cpu", 0, a), Device(1, 0, 1, "cpu", "cpu", 0, b)))
    assert wire.decode(wire.encode(c)) == c


def test_global_ids_and_repeated_strings_are_not_sent_per_device():
    small, large = content(4, 8), content(64, 8)
    per_device = (len(wire.encode(large)) - len(wire.encode(small))) / (len(large.devices) - len(small.devices))
    assert per_device < 6  # columns of deltas and runs, mostly 2 coordinates; no global id, no kind string
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


def one_process(**devices) -> pb.Topology:
    """A hand-made topology of one process with one device; ``devices`` replaces device columns."""
    message = pb.Topology(strings=["", "cpu"], processes=pb.ProcessColumns(
        process_ids=pb.IntColumn(deltas=[0]), hostname_shared=pb.IntColumn(deltas=[0]), hostname_suffixes=["h"],
        address_shared=pb.IntColumn(deltas=[0]), address_suffixes=[""], device_counts=pb.IntColumn(deltas=[1]),
        plugins=pb.IntColumn(deltas=[0]), coordinate_ranks=pb.IntColumn(deltas=[0])))
    columns = {"local_ids": [0], "platforms": [1], "kinds": [1], "slice_indices": [0], **devices}
    for name, deltas in columns.items():
        getattr(message.devices, name).deltas.extend(deltas)
    return message


def test_a_hand_made_topology_decodes():
    (device,) = wire.decode(one_process().SerializeToString()).devices
    assert device == Device(0, 0, 0, "cpu", "cpu")


@pytest.mark.parametrize(("message", "error"), [
    (one_process(platforms=[5]), "platforms holds 5..5: expected 0 <= value < 2"),
    (one_process(kinds=[1, 0]), "kinds has 2 entries: expected 1"),
    (one_process(local_ids=[1 << 17]), "local_ids holds 131072..131072"),
    (pb.Topology(strings=["x"]), 'the string table does not start with ""'),
])
def test_malformed_bytes_are_a_topology_error(message, error):
    with pytest.raises(TopologyError, match="do not parse"):
        wire.decode(b"\xff\xff\xff")
    with pytest.raises(TopologyError, match=re.escape(f"topology bytes are inconsistent: {error}")):
        wire.decode(message.SerializeToString())


def edited(c: TopologyContent, edit) -> bytes:
    message = pb.Topology.FromString(wire.encode(c))
    edit(message)
    return message.SerializeToString()


@pytest.mark.parametrize(("edit", "error"), [
    (lambda m: m.processes.process_ids.runs.__setitem__(0, 3), "process_ids has 2 runs of 6 entries in all"),
    (lambda m: m.processes.process_ids.runs.extend([1]), "process_ids has 2 runs of 5 entries in all"),
    (lambda m: m.processes.process_ids.deltas.__setitem__(1, 0), "process ids are not strictly increasing"),
    (lambda m: m.devices.local_ids.deltas.append(0), "local_ids has 9 entries: expected 8"),
    (lambda m: m.devices.local_ids.deltas.__setitem__(slice(1, 3), [0, 0]), "local ids are not strictly increasing"),
    (lambda m: m.processes.hostname_shared.deltas.__setitem__(1, 9), "hostnames shares 9 characters with a text"),
    (lambda m: m.devices.attributes[0].values.deltas.__setitem__(0, 99), "attribute 'memory' holds"),
    (lambda m: m.processes.coordinate_ranks.deltas.__setitem__(0, 3), "coordinate_ranks holds 3..3"),
])
def test_edited_columns_are_a_topology_error(edit, error):
    with pytest.raises(TopologyError, match=re.escape(error)):
        wire.decode(edited(content(4, 2, attributes=True), edit))


def test_more_devices_than_the_limit_are_refused_before_any_is_made(monkeypatch):
    canonical = wire.encode(content(4, 2))
    monkeypatch.setattr(wire, "MAX_DEVICES", 7)
    with pytest.raises(TopologyError, match="device_counts add up to 8 devices: expected at most 7"):
        wire.decode(canonical)


def test_columns_are_delta_and_run_length_coded():
    message = pb.Topology.FromString(wire.encode(content(64, 8)))
    # Process ids 0, 1, 2, ...: one run of delta 1. Every process has 8 devices: one run of 8.
    assert (list(message.processes.process_ids.deltas), list(message.processes.process_ids.runs)) == ([0, 1], [1, 63])
    assert (list(message.processes.device_counts.deltas), list(message.processes.device_counts.runs)) == ([8, 0],
                                                                                                           [1, 63])
    assert list(message.devices.kinds.runs) == [1, 511]  # one kind: its index, then no change
    # Local ids 0..7 over and over: start, then steps of 1 and one step back per process.
    assert list(message.devices.local_ids.deltas[:4]) == [0, 1, -7, 1]
    assert list(message.devices.local_ids.runs[:4]) == [1, 7, 1, 7]
    # Columns without runs of 2 or more are sent without run lengths.
    c = TopologyContent("", 1, 1, (Process(0, "h"),), tuple(
        Device(i, 0, i, "cpu", "cpu", slice_index=i * i) for i in range(4)))
    slices = pb.Topology.FromString(wire.encode(c)).devices.slice_indices
    assert (list(slices.deltas), list(slices.runs)) == ([0, 1, 3, 5], [])


@given(st.lists(st.text(max_size=6, alphabet="ab\0é🙂"), max_size=8),
       st.lists(st.text(max_size=80, alphabet="ab"), max_size=4))
def test_hostnames_and_addresses_round_trip(hostnames, long_addresses):
    count = max(len(hostnames), len(long_addresses))
    hostnames = hostnames + [""] * (count - len(hostnames))
    addresses = long_addresses + ["x"] * (count - len(long_addresses))  # past FRONT_CODING_WIDTH: the slow path
    processes = tuple(Process(p, h, a) for p, (h, a) in enumerate(zip(hostnames, addresses, strict=True)))
    c = TopologyContent("", 1, count, processes, ())
    assert wire.decode(wire.encode(c)) == c


def test_front_coding_sends_what_neighbours_do_not_share():
    processes = tuple(Process(p, f"gpu-node-{p:04d}.cluster.internal", f"10.0.{p}.7:8477") for p in range(3))
    message = pb.Topology.FromString(wire.encode(TopologyContent("", 1, 3, processes, ())))
    assert list(message.processes.hostname_suffixes) == ["gpu-node-0000.cluster.internal", "1.cluster.internal",
                                                         "2.cluster.internal"]
    assert list(message.processes.address_suffixes) == ["10.0.0.7:8477", "1.7:8477", "2.7:8477"]


def test_processes_of_different_coordinate_ranks_and_without_devices_round_trip():
    processes = (Process(0, "a"), Process(1, "b"), Process(2, "c"), Process(5, "d"))
    devices = (Device(0, 0, 0, "cpu", "cpu", plugin="cpu"),
               Device(global_device_id(1, 3), 1, 3, "tpu", "v4", 1, {"core_on_chip": "0"}, "jax", (1, 2, 3)),
               Device(global_device_id(1, 4), 1, 4, "tpu", "v4", 1, {}, "jax", (-1, 0, 7)),
               Device(global_device_id(5, 0), 5, 0, "gpu", "h100", 0, {"m": ""}, "cuda", (4,)))
    c = TopologyContent("job", 2, 4, processes, devices)
    assert wire.decode(wire.encode(c)) == c


def test_decoded_devices_are_ordinary_records_sharing_equal_attributes():
    decoded = wire.decode(wire.encode(content(4, 8, attributes=True))).devices
    assert decoded[0] == Device(0, 0, 0, "tpu", "tpu-v5e", 0, {"uuid": "dev-0-0", "memory": "16G"}, "sim", (0, 0))
    assert type(decoded[0].attributes) is type(Device(0, 0, 0, "x", "x").attributes)
    plain = wire.decode(wire.encode(content(4, 8))).devices
    assert len({id(d.attributes) for d in plain}) == 1  # one mapping for all: nothing per device to hold
    assert [d.coordinates for d in decoded[:3]] == [(0, 0), (0, 1), (1, 0)]
    assert all(type(x) is int for d in decoded for x in (d.id, d.local_id, d.slice_index, *d.coordinates))


def test_an_absent_attribute_differs_from_an_empty_one():
    devices = (Device(0, 0, 0, "cpu", "cpu", 0, {"a": ""}), Device(1, 0, 1, "cpu", "cpu", 0, {}))
    c = TopologyContent("", 1, 1, (Process(0, "h"),), devices)
    assert [dict(d.attributes) for d in wire.decode(wire.encode(c)).devices] == [{"a": ""}, {}]


def test_many_attributes_distinct_on_every_device_round_trip():
    # 12 keys of 50 distinct values each: 50**12 combinations do not fit an int64, the decoder renumbers.
    devices = tuple(Device(i, 0, i, "cpu", "cpu", 0, {f"k{j:02d}": f"{(i * (j + 1)) % 50}" for j in range(12)})
                    for i in range(100))
    c = TopologyContent("", 1, 1, (Process(0, "h"),), devices)
    assert wire.decode(wire.encode(c)) == c


def address(rng: random.Random) -> str:
    return f"10.128.{rng.randrange(256)}.{rng.randrange(256)}:{rng.randrange(32768, 61000)}"


def realistic(hosts: int, gpus: int, uuids: bool) -> TopologyContent:
    """GPU hosts as a cloud has them: random hostname suffixes, addresses and ports; a random UUID per GPU."""
    rng = random.Random(3)
    names = sorted({f"a3-{rng.getrandbits(20):05x}" for _ in range(hosts * 2)})[:hosts]
    processes = tuple(Process(p, name, address(rng))
                      for p, name in enumerate(names))
    devices = tuple(
        Device(global_device_id(p, i), p, i, "cuda", "NVIDIA H100 80GB HBM3", p,
               {"memory_bytes": "85520809984", **({"uuid": f"GPU-{rng.getrandbits(128):032x}"} if uuids else {})},
               "cuda") for p in range(hosts) for i in range(gpus))
    return TopologyContent("", 1, hosts, processes, devices)


def test_realistic_gpu_hosts_fit_in_4_bytes_a_device_unless_they_publish_uuids():
    def sent(c):
        return len(wire.compress(wire.encode(c))[1]) / len(c.devices)

    assert sent(realistic(512, 8, uuids=False)) < 4  # per host: a hostname, an address and a port
    assert sent(realistic(1024, 4, uuids=False)) < 4  # the same per host over half the devices
    assert sent(realistic(512, 8, uuids=True)) > 16  # 128 random bits a device do not compress


@pytest.mark.parametrize(("devices", "message"), [
    ((Device(5, 0, 4, "cpu", "cpu"),), "is not process_id 0 << 17"),
    ((Device(0, 0, 0, "cpu", "cpu"), Device(0, 0, 0, "cpu", "cpu")), "local device id twice"),
    ((Device(1 << 17, 1, 0, "cpu", "cpu"),), "not in the topology"),
    ((Device(0, 0, 0, "cpu", "cpu", coordinates=(0,)), Device(1, 0, 1, "cpu", "cpu")), "coordinate ranks"),
])
def test_inconsistent_content_is_refused(devices, message):
    with pytest.raises(TopologyError, match=message):
        wire.encode(TopologyContent("", 1, 1, (Process(0, "h"),), devices))


def test_a_registered_device_leaves_its_host_attributes_home_and_takes_the_default_slice():
    request = pb.RegisterRequest()
    wire.add_local_device(request, LocalDevice(3, "gpu", "h100", coordinates=(1, 2), attributes={"memory": "80"},
                                               host_attributes={"uuid": "GPU-5e1f"}), "7")
    wire.add_local_device(request, LocalDevice(4, "gpu", "h100", slice_key="nvl0"), "7")
    assert [(d.local_id, d.platform, d.kind, d.slice_key, list(d.coordinates), dict(d.attributes))
            for d in request.devices] == [(3, "gpu", "h100", "7", [1, 2], {"memory": "80"}),
                                          (4, "gpu", "h100", "nvl0", [], {})]
    assert b"GPU-5e1f" not in request.SerializeToString()


def networked(paths: list[tuple[str, ...]]) -> TopologyContent:
    processes = tuple(Process(i, f"node{i}", "", path) for i, path in enumerate(paths))
    return TopologyContent("c", 1, len(paths), processes, ())


def test_network_paths_round_trip_with_repeated_names_sent_once():
    paths = [("spine1", "rack1")] * 3 + [("spine1", "rack2"), (), ("spine2",), ("spine1", "rack1", "half1")]
    canonical = wire.encode(networked(paths))
    assert [p.network for p in wire.decode(canonical).processes] == paths
    message = pb.Topology.FromString(canonical)
    assert [s for s in message.strings if s.startswith(("spine", "rack", "half"))] == [
        "spine1", "rack1", "rack2", "spine2", "half1"]  # each name once in the string table


def test_a_topology_without_positions_carries_no_network_columns():
    message = pb.Topology.FromString(wire.encode(networked([(), ()])))
    assert not message.processes.HasField("network_depths") and not message.processes.HasField("network_levels")


@pytest.mark.parametrize(("edit", "error"), [
    (lambda m: m.processes.network_depths.deltas.__setitem__(0, 9),
     "network_depths holds 9..9: expected 0 <= value < 9"),
    (lambda m: m.processes.network_levels.deltas.__setitem__(0, 0), "network_levels holds 0.."),
    (lambda m: m.processes.network_levels.deltas.append(1), "network_levels has 2 runs of 2 entries"),
    (lambda m: m.processes.ClearField("network_depths"), "network_levels holds levels but network_depths is empty"),
])
def test_malformed_network_columns_are_a_topology_error(edit, error):
    message = pb.Topology.FromString(wire.encode(networked([("s1",), ("s2",)])))
    edit(message)
    with pytest.raises(TopologyError, match=re.escape(error)):
        wire.decode(message.SerializeToString())


def test_an_empty_level_or_too_deep_a_path_is_not_encoded():
    with pytest.raises(TopologyError, match="empty level"):
        wire.encode(networked([("s1", "")]))
    with pytest.raises(TopologyError, match="9 levels"):
        wire.encode(networked([tuple(f"l{i}" for i in range(9))]))
