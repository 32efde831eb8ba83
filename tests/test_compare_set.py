"""kv_compare_set: TCPStore's compare-and-set in the state machine, over gRPC on the memory and etcd stores, and
exactly once across a leader SIGKILL on etcd."""

from __future__ import annotations

import time
import uuid

import pytest

import ifrt
from coordinator.core import journal
from coordinator.core.effects import KeyChanged
from coordinator.core.limits import DEFAULT_LIMITS, Limits
from coordinator.core.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import InvalidArgument
from tests.helpers import COMPARE_SET_TABLE, clients, published
from tests.replicas import Replicas, kill_the_leader_midway


def with_value(before: bytes | None) -> ClusterState:
    s = published()
    if before is not None:
        s.current.keys.set("p0", "k", before, False)
    s.take_journal()
    return s


@pytest.mark.parametrize(("before", "expected", "desired", "answer", "after"), COMPARE_SET_TABLE)
def test_compare_set_semantics_in_the_state_machine(before, expected, desired, answer, after):
    s = with_value(before)
    value, effects = s.current.keys.compare_set("p1", "k", expected, desired, "call-1")
    assert (value, s.current.keys.get("p2", "k")) == (answer, after)
    changed = after != before
    assert effects == ([KeyChanged("k", after)] if changed else [])
    assert [type(e).__name__ for e in s.take_journal()] == (["KeySwapped"] if changed else [])


def test_a_retried_swap_is_answered_not_applied_again_even_after_a_replay():
    s = published()
    assert s.current.keys.compare_set("p0", "k", b"", b"A", "r1") == (b"A", [KeyChanged("k", b"A")])
    assert s.current.keys.compare_set("p1", "k", b"A", b"", "r2") == (b"", [KeyChanged("k", b"")])  # back to the start
    assert s.current.keys.compare_set("p0", "k", b"", b"A", "r1") == (b"A", [])  # p0's retry: answered as before
    assert s.current.keys.get("p2", "k") == b""
    raw = [journal.encode(e) for e in s.take_journal()]
    rebuilt = ClusterState(s.config)
    for r in raw:
        rebuilt.replay(journal.decode(r))
    assert rebuilt.current.keys.get("p2", "k") == b""
    assert rebuilt.current.keys.compare_set("p0", "k", b"", b"A", "r1") == (b"A", [])
    assert rebuilt.current.keys.compare_set("p0", "k", b"", b"A", "r3") == (b"A", [KeyChanged("k", b"A")])  # a new call


@pytest.mark.parametrize(("key", "desired", "message"), [
    ("", b"v", "key of 0 bytes: expected 1 to"),
    ("k" * (DEFAULT_LIMITS.kv_key_bytes + 1), b"v", f"expected 1 to {DEFAULT_LIMITS.kv_key_bytes} bytes"),
    ("k", b"v" * (DEFAULT_LIMITS.kv_value_bytes + 1), f"expected at most {DEFAULT_LIMITS.kv_value_bytes}"),
])
@pytest.mark.parametrize("matches", [True, False], ids=["compare matches", "compare fails"])
def test_bad_input_is_refused_whether_or_not_the_compare_matches_and_changes_nothing(key, desired, message, matches):
    s = with_value(b"old")
    with pytest.raises(InvalidArgument, match=message):
        s.current.keys.compare_set("p0", key, b"old" if matches else b"other", desired, "r1")
    assert s.current.keys.dir("p0", "") == [("k", b"old")]
    assert s.take_journal() == []


# Over the wire, on both stores the coordinator can journal to.

@pytest.fixture(params=["memory", "etcd"])
def pair(request, start_coordinator):
    args = () if request.param == "memory" else ("--store", request.getfixturevalue("etcd").url, "--cluster-id",
                                                 f"cas-{uuid.uuid4().hex[:8]}")
    coordinator = start_coordinator(*args, num_processes=2)
    made = clients(coordinator.address, 2)
    yield made
    for c in made:
        c.close()


def test_compare_set_semantics_over_grpc(pair):
    a, b = pair
    for i, case in enumerate(COMPARE_SET_TABLE):
        before, expected, desired, answer, after = case.values
        key = f"table/{i}"
        if before is not None:
            a.kv_set(key, before)
        assert b.kv_compare_set(key, expected, desired) == answer, case.id
        assert a.kv_try_get(key) == after, case.id
    with pytest.raises(ifrt.InvalidArgument, match="key of 0 bytes: expected 1 to"):
        a.kv_compare_set("", b"", b"v")


def test_a_raced_create_has_one_winner_and_everyone_reads_it(pair):
    a, b = pair
    answers = [c.kv_compare_set("leader", b"", name) for c, name in ((a, b"a"), (b, b"b"))]
    assert answers == [b"a", b"a"]  # the second caller is told who won


# Exactly once across a leader SIGKILL on etcd.

def test_a_retry_after_a_leader_sigkill_is_answered_not_applied_again(etcd):
    with Replicas(etcd, num_processes=2, cluster_id="swapping", heartbeat="30") as replicas:
        a, b = made = clients(replicas.addresses, 2)
        try:
            first = pb.KeyValueCompareSetRequest(client_uid=a.client_uid, key="k", expected=b"", desired=b"A",
                                                 request_id="retried-call")
            call = lambda: a._unary("KeyValueCompareSet", lambda _: first, time.monotonic() + 60)  # noqa: E731
            assert call().value == b"A"
            assert b.kv_compare_set("k", b"A", b"") == b""  # the key is back where the first call found it
            replicas.kill_leader()
            retried = call()  # as the client retries a call whose answer was lost with the leader
            assert (retried.found, retried.value) == (True, b"A")
            assert b.kv_try_get("k") == b""  # not swapped a second time
        finally:
            for c in made:
                c.close()


def test_compare_set_counters_of_four_processes_survive_a_leader_sigkill_exactly_once(etcd, coordination_workers):
    with Replicas(etcd, num_processes=5, cluster_id="counting", heartbeat="5") as replicas:
        swapping = [coordination_workers(replicas.addresses, i, 5, "swap", "counter", "150") for i in range(4)]
        swaps = lambda c: int((c.kv_try_get("counter") or b"0").split(b":")[0])  # noqa: E731
        with kill_the_leader_midway(replicas, 4, 5, lambda c: swaps(c) >= 200, "200 swaps before the kill") as client:
            won = [w.expect("swapped", timeout=300)["swapped"] for w in swapping]  # as each one's answers told it
            count = int(client.kv_get("counter", timeout=30).split(b":")[0])
            assert count == sum(won) == 600  # every step a process won is in the counter once: none lost, none doubled


OTHER_KEYS = [("set", "jax/address", b"x", False), ("get", "jax/address"), ("compare_set", "k", b"", b"x"),
              ("dir", "torch"), ("delete", "torchrun", True)]


@pytest.mark.parametrize("published_yet", [False, True], ids=["before publication", "after publication"])
def test_callers_that_are_no_process_may_use_the_agent_keys_only(published_yet):
    # torchrun's agents meet before any worker exists: they are no process of the topology.
    s = published() if published_yet else ClusterState(published().config)
    agent = "agent-" + uuid.uuid4().hex
    assert s.current.keys.compare_set(agent, "torchrun/job/state", b"", b"v1", "r1")[0] == b"v1"
    s.current.keys.set(agent, "torchrun/job/other", b"x", False)
    assert s.current.keys.get(agent, "torchrun/job/state") == b"v1"
    assert [k for k, _ in s.current.keys.dir(agent, "torchrun/job/")] == ["torchrun/job/other", "torchrun/job/state"]
    assert s.current.keys.delete(agent, "torchrun/job/other", False)[0] == 1
    for method, *args in OTHER_KEYS:
        with pytest.raises(ifrt.UnknownClient):
            getattr(s.current.keys, method)(agent, *args)


def test_retries_are_remembered_within_the_answer_bytes_over_all_callers():
    # Agents (any number of caller ids) and processes share --max-answer-bytes: the oldest calls are forgotten first.
    value = b"x" * 1000
    s = published(limits=Limits(answer_bytes=50 * 1400))
    first = "agent-first"
    s.current.keys.compare_set(first, "torchrun/k", b"", b"A", "r1")
    s.current.keys.compare_set("p0", "torchrun/k", b"A", b"B", "p0-r1")
    assert s.current.keys.compare_set(first, "torchrun/k", b"", b"A", "r1")[0] == b"A"  # a retry: answered
    for i in range(100):
        s.current.keys.compare_set(f"agent-{i}", f"torchrun/{i}", b"", value, "r1")
    assert s.current.kv.retries.held <= 50 * 1400
    # The first agent's answer is forgotten now: its retry is refused (it may have been applied), never applied again.
    s.take_journal()
    with pytest.raises(InvalidArgument, match=r"request_id 'r1' on key 'torchrun/k': an answer of this client's calls "
                                              r"with request_ids that are not increasing numbers was pushed out"):
        s.current.keys.compare_set(first, "torchrun/k", b"", b"A", "r1")
    assert s.current.keys.get("p1", "torchrun/k") == b"B" and s.take_journal() == []
    assert s.current.keys.compare_set("agent-99", "torchrun/99", b"", value, "r1") == (value, [])  # the newest: kept


def test_a_request_id_retried_on_another_key_is_another_call():
    # The same request id on another key was answered with the first key's value, and the second key never set.
    s = published()
    assert s.current.keys.compare_set("p0", "a", b"", b"A", "r1") == (b"A", [KeyChanged("a", b"A")])
    assert s.current.keys.compare_set("p0", "b", b"", b"B", "r1") == (b"B", [KeyChanged("b", b"B")])
    assert (s.current.keys.get("p1", "a"), s.current.keys.get("p1", "b")) == (b"A", b"B")
    assert s.current.keys.increment("p0", "n", 5, "r1") == (5, [KeyChanged("n", b"5")])
    assert s.current.keys.increment("p0", "m", 7, "r1") == (7, [KeyChanged("m", b"7")])
    # Retries of each are answered as each was, and applied nowhere
    assert s.current.keys.compare_set("p0", "b", b"", b"B", "r1") == (b"B", [])
    assert s.current.keys.increment("p0", "n", 5, "r1") == (5, [])


def test_a_request_id_reused_on_the_same_key_for_another_call_is_refused_and_changes_nothing():
    s = published()
    s.current.keys.compare_set("p0", "k", b"", b"A", "r1")
    s.take_journal()
    with pytest.raises(InvalidArgument, match="request_id 'r1' on key 'k' was a swap to another value"):
        s.current.keys.compare_set("p0", "k", b"A", b"C", "r1")
    with pytest.raises(InvalidArgument, match="request_id 'r1' on key 'k' was a swap or a set, not an increment"):
        s.current.keys.increment("p0", "k", 1, "r1")
    assert s.current.keys.get("p1", "k") == b"A" and s.take_journal() == []


def test_a_retry_of_a_call_past_the_answers_per_caller_is_refused_not_applied_again():
    s = published(limits=Limits(answers_per_caller=4))
    for i in range(6):
        s.current.keys.increment("p0", "n", 1, f"r{i}")
    s.take_journal()
    with pytest.raises(InvalidArgument, match=r"was answered before this client's last 4 calls, and its answer is no "
                                              r"longer kept \(the coordinator's --max-answers-per-caller\)"):
        s.current.keys.increment("p0", "n", 1, "r0")
    assert s.current.keys.get("p1", "n") == b"6" and s.take_journal() == []
    assert s.current.keys.increment("p0", "n", 1, "r5") == (6, [])


def test_a_retried_set_or_delete_is_answered_as_first_made_and_undoes_no_later_write():
    # A reply lost in a failover: the client sends the same call again, to the replica that took over.
    s = published()
    assert s.current.keys.set("p0", "k", b"A", True, "set-1") == [KeyChanged("k", b"A")]
    s.current.keys.increment("p1", "n", 1, "incr-1")
    s.current.keys.set("p1", "k", b"B", True, "set-2")  # a later write by another process
    standby = ClusterState(s.config)
    for entry in s.take_journal():
        standby.replay(entry)
    for state in (s, standby):  # the answer survives the failover: the retry is not applied again
        assert state.current.keys.set("p0", "k", b"A", True, "set-1") == []
        assert state.current.keys.get("p2", "k") == b"B"
    with pytest.raises(ifrt.InvalidArgument, match="set another value: a retry repeats its call"):
        s.current.keys.set("p0", "k", b"C", True, "set-1")
    assert s.current.keys.delete("p0", "k", False, "del-1") == (1, [KeyChanged("k", None)])
    s.current.keys.set("p1", "k", b"again", False, "set-3")
    assert s.current.keys.delete("p0", "k", False, "del-1") == (1, [])  # its count; the new value stays
    assert s.current.keys.get("p2", "k") == b"again"
    assert s.current.keys.set_many("p0", [("a", b"1"), ("b", b"2")], False, "multi-1") != []
    s.current.keys.set("p1", "b", b"changed", True)
    assert s.current.keys.set_many("p0", [("a", b"1"), ("b", b"2")], False, "multi-1") == []  # not KeyExists
    assert s.current.keys.get("p2", "b") == b"changed"
