"""Every limit on what callers send: a flag, a clear error naming the value, the limit and the flag, and nothing
changed by a refused request. Pure checks first, then the flags against a real daemon."""

from __future__ import annotations

import grpc
import pytest

import ifrt
from coordinator.core import journal
from coordinator.core.barriers import Barriers
from coordinator.core.cluster import ClusterConfig
from coordinator.core.kv import KeyValueStore
from coordinator.core.limits import Limits
from coordinator.core.registration import from_request
from coordinator.core.state import ClusterState
from ifrt import Client
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import InvalidArgument, KeyExists
from tests.helpers import admit, device, reg, register_request, run_coordinator

REGISTER = "/ifrt.topology.v1.Coordinator/Register"


def test_defaults_are_the_documented_limits():
    assert Limits() == Limits(request_bytes=16777216, devices_per_process=131072, attributes_per_device=64,
                              string_bytes=1024, kv_value_bytes=1048576, kv_keys=1048576, kv_key_bytes=1024,
                              barrier_name_bytes=1024, concurrent_streams=4096, barriers=1048576,
                              watches_per_session=1024, session_backlog_bytes=67108864, health_name_bytes=256,
                              health_watches_per_connection=4, health_watches=1024, first_message_seconds=10,
                              connection_idle_seconds=30, connections=0, kv_bytes=134217728,
                              reply_bytes=16777216, answers_per_caller=64, answer_bytes=16777216,
                              barrier_bytes=67108864, sessions_per_process=2, backlog_bytes=268435456,
                              registration_bytes=268435456, watch_bytes=33554432, pending_reply_bytes=134217728)
    assert ClusterConfig(num_processes=1).limits == Limits()


@pytest.mark.parametrize(("fields", "message"), [
    ({"devices_per_process": 131073}, "--max-devices-per-process 131073 is out of range: expected at most 131072 "
                                      "(2**17)"),
    ({"attributes_per_device": 0}, "--max-attributes 0 is out of range: expected an integer >= 1"),
    ({"kv_keys": -1}, "--kv-max-keys -1 is out of range: expected an integer >= 1"),
    ({"concurrent_streams": -1}, "--max-concurrent-streams -1 is out of range: expected an integer >= 0"),
])
def test_a_limit_out_of_range_is_refused_naming_its_flag(fields, message):
    with pytest.raises(InvalidArgument) as info:
        Limits(**fields)
    assert message in str(info.value)


def test_the_daemon_refuses_to_raise_devices_per_process_past_the_id_layout():
    result = run_coordinator("--num-processes", "1", "--max-devices-per-process", "131073")
    assert result.returncode == 2
    assert ("ifrt-coordinator: --max-devices-per-process 131073 is out of range: expected at most 131072 (2**17)"
            in result.stderr)


# Registration.

SMALL = Limits(devices_per_process=2, attributes_per_device=1, string_bytes=8)

OVER_LIMIT_REGISTRATIONS = {
    "devices": (register_request(devices=[device(0), device(1), device(2)]),
                "3 devices in one process: expected at most 2 (the coordinator's --max-devices-per-process)"),
    "attributes": (register_request(devices=[device(attributes={"a": "1", "b": "2"})]),
                   "device #0 (local id 0) has 2 attributes: expected at most 1 (the coordinator's --max-attributes)"),
    "attribute key": (register_request(devices=[device(attributes={"k" * 9: "1"})]),
                      "device #0 (local id 0) attribute key is 9 bytes long: expected at most 8 (the coordinator's "
                      "--max-string-bytes)"),
    "attribute value": (register_request(devices=[device(attributes={"k": "é" * 5})]),
                        "device #0 (local id 0) attribute 'k' is 10 bytes long: expected at most 8 (the "
                        "coordinator's --max-string-bytes)"),
    "hostname": (pb.RegisterRequest(client_uid="uid", hostname="h" * 9, devices=[device()]),
                 "hostname is 9 bytes long: expected at most 8 (the coordinator's --max-string-bytes)"),
    "platform": (register_request(devices=[pb.LocalDevice(local_id=0, platform="p" * 9)]),
                 "device #0 (local id 0) platform is 9 bytes long: expected at most 8 (the coordinator's "
                 "--max-string-bytes)"),
}


@pytest.mark.parametrize("case", list(OVER_LIMIT_REGISTRATIONS))
def test_a_registration_over_a_limit_names_the_value_the_limit_and_the_flag(case):
    request, message = OVER_LIMIT_REGISTRATIONS[case]
    with pytest.raises(InvalidArgument) as info:
        from_request(request, "10.0.0.1", SMALL)
    assert str(info.value) == message


def test_a_registration_at_every_limit_is_accepted():
    request = register_request(hostname="h" * 8, devices=[device(0, attributes={"k" * 8: "é" * 4}),
                                                         device(131071, attributes={"k": "v"})])
    r = from_request(request, "10.0.0.1", SMALL)
    assert [d.local_id for d in r.devices] == [0, 131071]
    assert r.devices[0].attributes == {"kkkkkkkk": "éééé"}


def test_a_device_list_accepted_under_some_limits_is_checked_again_under_others():
    # Equal device lists are checked once and shared, but only under the limits they were checked with.
    request = register_request(devices=[device(1, attributes={"a": "1", "b": "2"}), device(0)])
    limits = Limits()
    first, again = (from_request(request, "10.0.0.1", limits) for _ in range(2))
    assert again.devices is first.devices and [d.local_id for d in first.devices] == [0, 1]
    with pytest.raises(InvalidArgument, match="device #0 \\(local id 1\\) has 2 attributes: expected at most 1"):
        from_request(request, "10.0.0.1", SMALL)


def test_lowering_devices_per_process_keeps_the_local_id_bound():
    # Fewer devices per process does not narrow the ids: a process may list any local ids below 2**17.
    r = from_request(register_request(devices=[device(131071)]), "10.0.0.1", Limits(devices_per_process=1))
    assert [d.local_id for d in r.devices] == [131071]
    with pytest.raises(InvalidArgument, match="local device id 131072 is out of range: expected 0 <= local_id < "
                                              "131072"):
        from_request(register_request(devices=[device(131072)]), "10.0.0.1")


def test_an_overlong_client_uid_is_not_echoed():
    with pytest.raises(InvalidArgument) as info:
        from_request(pb.RegisterRequest(client_uid="u" * 100_000, hostname="h"), "10.0.0.1")
    assert str(info.value) == "client_uid of 100000 characters is invalid: expected 1 to 128 characters"


# Key-values and barriers.

def test_a_new_key_past_the_key_count_is_refused_and_stores_nothing():
    kv = KeyValueStore(Limits(kv_keys=2))
    assert kv.set("a", b"1") and kv.set("b", b"2")
    with pytest.raises(InvalidArgument) as info:
        kv.set("c", b"3")
    assert str(info.value) == ("key 'c' would be key number 3 of the store: expected at most 2 keys (the "
                               "coordinator's --kv-max-keys)")
    assert kv.dir("") == [("a", b"1"), ("b", b"2")]
    assert kv.set("a", b"changed", allow_overwrite=True)  # an existing key is no new key
    assert kv.dir("") == [("a", b"changed"), ("b", b"2")]


def test_an_overlong_key_or_value_is_refused_naming_the_flag():
    kv = KeyValueStore(Limits(kv_key_bytes=4, kv_value_bytes=3))
    with pytest.raises(InvalidArgument) as info:
        kv.set("ééé", b"1")
    assert str(info.value) == "key of 6 bytes: expected 1 to 4 bytes (the coordinator's --kv-max-key-bytes)"
    with pytest.raises(InvalidArgument) as info:
        kv.set("k", b"1234")
    assert str(info.value) == ("value for key 'k' is 4 bytes: expected at most 3 (the coordinator's "
                               "--kv-max-value-bytes)")
    assert kv.dir("") == []
    assert kv.set("éé", b"123")


def test_an_overlong_barrier_name_is_refused_and_starts_no_barrier():
    barriers = Barriers(Limits(barrier_name_bytes=8))
    with pytest.raises(InvalidArgument) as info:
        barriers.arrive("n" * 9, 0, frozenset({0, 1}), 10.0, 0.0, {})
    assert str(info.value) == ("barrier name 'nnnnnnnnn' is 9 bytes long: expected at most 8 (the coordinator's "
                               "--max-barrier-name-bytes)")
    assert barriers.get("n" * 9) is None
    barrier, effects = barriers.arrive("n" * 8, 0, frozenset({0, 1}), 10.0, 0.0, {})
    assert (barrier.arrived, effects) == ({0}, [])


def test_errors_quote_little_of_a_callers_text():
    # A status message travels as metadata, which gRPC clients refuse beyond 8 KiB: an error about a long key or a
    # large barrier quotes its start and its size, not all of it.
    kv = KeyValueStore()
    kv.set("k" * 1000, b"1")
    with pytest.raises(KeyExists) as info:
        kv.set("k" * 1000, b"2")
    assert str(info.value) == (f"key '{'k' * 64}'... (1000 characters) already holds another value (1 bytes): pass "
                               "allow_overwrite=True to replace it")
    barriers = Barriers()
    barriers.arrive("step", 0, frozenset(range(100)), 10.0, 0.0, {})
    with pytest.raises(InvalidArgument) as info:
        barriers.arrive("step", 1, frozenset(range(99)), 10.0, 0.0, {})
    assert str(info.value) == ("barrier 'step' was started for processes [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, "
                               "13, 14, 15, ...] (100 processes); this call names [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, "
                               "11, 12, 13, 14, 15, ...] (99 processes): use a new name for other participants")


def published_cluster(limits: Limits) -> ClusterState:
    s = ClusterState(ClusterConfig(num_processes=2, limits=limits))
    admit(s, reg("p0", 0, host="h0"), 0.0)
    admit(s, reg("p1", 1, host="h1"), 0.0)
    s.take_journal()
    return s


def test_a_refused_key_value_set_journals_nothing():
    s = published_cluster(Limits(kv_keys=1))
    assert s.current.keys.set("p0", "first", b"1", allow_overwrite=False)
    assert s.take_journal() == [journal.KeySet("first", b"1")]
    with pytest.raises(InvalidArgument, match="expected at most 1 keys"):
        s.current.keys.set("p1", "second", b"2", allow_overwrite=False)
    assert s.take_journal() == []
    assert s.current.keys.dir("p1", "") == [("first", b"1")]


def test_a_journal_replays_under_lower_limits_than_it_was_written_with():
    # An operator who lowers a limit and restarts against a durable store keeps what was accepted before.
    before = published_cluster(Limits())
    before.current.keys.set("p0", "a", b"1", allow_overwrite=False)
    before.current.keys.set("p0", "bb", b"22", allow_overwrite=False)
    entries = [journal.Registered(reg("p0", 0, host="h0"), 0.0), journal.Registered(reg("p1", 1, host="h1"), 0.0),
               *before.take_journal()]
    after = ClusterState(ClusterConfig(num_processes=2, limits=Limits(kv_keys=1, kv_value_bytes=1)))
    for entry in entries:
        after.replay(entry)
    assert after.current.keys.dir("p1", "") == [("a", b"1"), ("bb", b"22")]
    with pytest.raises(InvalidArgument, match="expected at most 1 keys"):  # new keys obey the lower limit
        after.current.keys.set("p1", "c", b"3", allow_overwrite=False)


# The flags, against a real daemon.

def test_registration_limit_flags_reach_the_daemon(start_coordinator, monkeypatch, default_client_closed):
    coordinator = start_coordinator("--max-devices-per-process", "2", "--max-attributes", "1",
                                    "--max-string-bytes", "64", num_processes=1)
    with grpc.insecure_channel(coordinator.address) as channel:
        register = channel.unary_unary(REGISTER)
        with pytest.raises(grpc.RpcError) as info:
            register(register_request(devices=[device(attributes={"a": "1", "b": "2"})]).SerializeToString(),
                     timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == ("device #0 (local id 0) has 2 attributes: expected at most 1 (the "
                                        "coordinator's --max-attributes)")
        with pytest.raises(grpc.RpcError) as info:
            register(register_request(hostname="h" * 65).SerializeToString(), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == ("hostname is 65 bytes long: expected at most 64 (the coordinator's "
                                        "--max-string-bytes)")
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "3")
    with pytest.raises(ifrt.InvalidArgument) as refused:
        ifrt.discover(coordinator.address, process_id=0, timeout=30)
    assert ("3 devices in one process: expected at most 2 (the coordinator's --max-devices-per-process)"
            in str(refused.value))
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "2")  # within every limit: admitted, as if nothing came before
    topology = ifrt.discover(coordinator.address, process_id=0, timeout=30)
    assert (topology.generation, [d.local_id for d in topology.devices]) == (1, [0, 1])


def test_key_value_and_barrier_limit_flags_reach_the_daemon(start_coordinator):
    coordinator = start_coordinator("--kv-max-keys", "1", "--kv-max-key-bytes", "8", "--kv-max-value-bytes", "4",
                                    "--max-barrier-name-bytes", "8", num_processes=1)
    with Client(coordinator.address, process_id=0, timeout=30) as client:
        client.discover()
        client.kv_set("key", b"1234")
        refused = {
            "key count": (lambda: client.kv_set("other", b"1"),
                          "key 'other' would be key number 2 of the store: expected at most 1 keys (the "
                          "coordinator's --kv-max-keys)"),
            "key length": (lambda: client.kv_set("k" * 9, b"1"),
                           "key of 9 bytes: expected 1 to 8 bytes (the coordinator's --kv-max-key-bytes)"),
            "value size": (lambda: client.kv_set("key", b"12345", allow_overwrite=True),
                           "value for key 'key' is 5 bytes: expected at most 4 (the coordinator's "
                           "--kv-max-value-bytes)"),
            "barrier name": (lambda: client.barrier("b" * 9, timeout=10),
                             "barrier name 'bbbbbbbbb' is 9 bytes long: expected at most 8 (the coordinator's "
                             "--max-barrier-name-bytes)"),
        }
        for case, (call, message) in refused.items():
            with pytest.raises(ifrt.InvalidArgument) as info:
                call()
            assert message in str(info.value), case
        assert client.kv_dir("") == {"key": b"1234"}
        client.barrier("b" * 8, timeout=10)


def test_max_concurrent_streams_holds_further_calls_of_one_connection(start_coordinator):
    # One Register call waits for the topology and holds the connection's only stream; a second call on the same
    # connection is not refused but waits for a free stream (here until its own deadline), while on a connection
    # of its own it is answered at once.
    coordinator = start_coordinator("--max-concurrent-streams", "1", num_processes=2)
    first = register_request(client_uid="waiter", process_id=0, wait_ms=20_000).SerializeToString()
    junk = b"\xff"
    with grpc.insecure_channel(coordinator.address) as channel:
        register = channel.unary_unary(REGISTER)
        with pytest.raises(grpc.RpcError) as info:  # the connection is up before the waiting call starts
            register(junk, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        waiting = register.future(first, timeout=30)
        coordinator.wait_for_log("registered process 0")
        with pytest.raises(grpc.RpcError) as info:
            register(junk, timeout=1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert info.value.trailing_metadata() in (None, ())  # never reached the coordinator: no answer of ours
        with grpc.insecure_channel(coordinator.address, options=[("grpc.use_local_subchannel_pool", 1)]) as own:
            with pytest.raises(grpc.RpcError) as info:
                own.unary_unary(REGISTER)(junk, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            own.unary_unary(REGISTER)(register_request(client_uid="second", process_id=1).SerializeToString(),
                                      timeout=10)
        answer = pb.RegisterResponse.FromString(waiting.result(timeout=30))
    assert (answer.process_id, answer.generation) == (0, 1)


# Entries a caller can make the coordinator keep.

def test_barriers_past_the_limit_are_refused_cancelled_ones_included():
    barriers = Barriers(Limits(barriers=2))
    barriers.arrive("first", 0, frozenset({0, 1}), 10.0, 0.0, {})
    assert barriers.cancel("never used", 0, frozenset(), "process 0")[0]
    with pytest.raises(InvalidArgument) as info:
        barriers.cancel("third", 0, frozenset(), "process 0")
    assert str(info.value) == ("barrier 'third' would be barrier number 3: expected at most 2 barriers (the "
                               "coordinator's --max-barriers)")
    with pytest.raises(InvalidArgument, match="expected at most 2 barriers"):
        barriers.arrive("third", 0, frozenset({0, 1}), 10.0, 0.0, {})
    assert barriers.get("third") is None
    assert barriers.cancel("first", 1, frozenset(), "process 1")[0]  # a barrier it keeps is no new entry


def test_a_get_of_a_key_no_set_could_store_is_refused():
    kv = KeyValueStore(Limits(kv_key_bytes=4))
    with pytest.raises(InvalidArgument) as info:
        kv.get("k" * 5)
    assert str(info.value) == "key of 5 bytes: expected 1 to 4 bytes (the coordinator's --kv-max-key-bytes)"
    assert kv.get("kkkk") is None


def test_an_overlong_request_or_call_id_is_refused_and_remembered_nowhere():
    s = published_cluster(Limits(string_bytes=8))
    with pytest.raises(InvalidArgument) as info:
        s.current.keys.increment("p0", "n", 1, "r" * 9)
    assert str(info.value) == ("request_id is 9 bytes long: expected at most 8 (the coordinator's "
                               "--max-string-bytes)")
    with pytest.raises(InvalidArgument, match="call_id is 9 bytes long"):
        s.current.live_processes("p0", "c" * 9, 10.0, 0.0)
    assert s.take_journal() == [] and s.current.keys.get("p0", "n") is None
    assert s.current.keys.increment("p0", "n", 1, "r" * 8)[0] == 1
