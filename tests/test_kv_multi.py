"""KeyValueMultiGet and KeyValueMultiSet: several keys in one call, under the limits of one key each, all or
nothing; on the store's rules alone and through a real coordinator."""

from __future__ import annotations

import grpc
import pytest

import ifrt
from coordinator.core.kv import KeyValueStore, cost
from coordinator.core.limits import Limits
from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.errors import ResourceExhausted

# The store's rules.


def test_a_batch_is_checked_as_the_entries_before_it_would_leave_the_store_and_changes_nothing():
    store = KeyValueStore(Limits(kv_keys=3))
    store.set("a", b"1")
    store.check_many([("a", b"1"), ("b", b"2"), ("b", b"3"), ("c", b"4")], allow_overwrite=True)  # b counts once
    with pytest.raises(ifrt.InvalidArgument, match=r"key 'd' would be key number 4 of the store: expected at most 3 "
                                                   r"keys \(the coordinator's --kv-max-keys\)"):
        store.check_many([("b", b"2"), ("c", b"3"), ("d", b"4")], allow_overwrite=False)
    with pytest.raises(ifrt.KeyExists, match=r"key 'b' already holds another value"):
        store.check_many([("b", b"2"), ("b", b"3")], allow_overwrite=False)  # the first entry's value counts
    with pytest.raises(ifrt.InvalidArgument, match=r"key of 0 bytes"):
        store.check_many([("b", b"2"), ("", b"3")], allow_overwrite=True)
    assert store.dir("") == [("a", b"1")] and store.held == cost("a", b"1")


# Through a coordinator.

@pytest.fixture(scope="module")
def coordinator():
    with LocalCoordinator("--kv-max-keys", "3", "--max-reply-bytes", "2048", num_processes=1,
                          log_level="WARNING") as started:
        yield started


@pytest.fixture
def client(coordinator):
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=30) as made:
        made.discover()
        yield made
        made.kv_delete("", prefix=True)


def test_a_multi_set_past_the_key_limit_stores_nothing_and_names_the_key_and_the_flag(client):
    client.kv_set("held", b"1")
    with pytest.raises(ifrt.InvalidArgument, match=r"key 'd' would be key number 4 .*--kv-max-keys"):
        client.kv_multi_set([("b", b"2"), ("c", b"3"), ("d", b"4")])
    with pytest.raises(ifrt.KeyExists, match=r"key 'held' already holds another value"):
        client.kv_multi_set([("b", b"2"), ("held", b"other")])
    assert client.kv_dir("") == {"held": b"1"}
    client.kv_multi_set([("b", b"2"), ("held", b"other")], allow_overwrite=True)
    assert client.kv_multi_get(["held", "b", "absent"]) == [b"other", b"2", None]


def test_a_multi_get_of_a_bad_key_or_past_the_reply_limit_is_refused_saying_why(client):
    with pytest.raises(ifrt.InvalidArgument, match=r"key of 0 bytes: expected 1 to \d+ bytes"):
        client.kv_multi_get(["fine", ""])
    client.kv_multi_set([("a", b"x" * 900), ("b", b"y" * 900)])
    assert client.kv_multi_get(["a", "b"]) == [b"x" * 900, b"y" * 900]
    with pytest.raises(ResourceExhausted, match=r"the values of 3 keys \(\d+ bytes\).*--max-reply-bytes"):
        client.kv_multi_get(["a", "b", "a"])


def test_a_caller_that_is_no_process_may_use_only_the_agents_keys(coordinator, client):
    client.kv_set("job/secret", b"s")
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = CoordinatorStub(channel)
        for call in (lambda: stub.KeyValueMultiGet(pb.KeyValueMultiGetRequest(
                         client_uid="stranger", keys=["torchrun/x", "job/secret"]), timeout=10),
                     lambda: stub.KeyValueMultiSet(pb.KeyValueMultiSetRequest(client_uid="stranger", entries=[
                         pb.KeyValueEntry(key="torchrun/x", value=b"1"),
                         pb.KeyValueEntry(key="job/secret", value=b"taken")]), timeout=10)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        stub.KeyValueMultiSet(pb.KeyValueMultiSetRequest(client_uid="stranger", entries=[
            pb.KeyValueEntry(key="torchrun/x", value=b"1")]), timeout=10)
    assert client.kv_multi_get(["job/secret", "torchrun/x"]) == [b"s", b"1"]
