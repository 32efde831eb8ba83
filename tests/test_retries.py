"""A retried key-value call is answered as its first call was, or refused once its answer was forgotten (by
--max-answers-per-caller or --max-answer-bytes): never applied twice, never undoing a later write. The same live, on
replay of the journal, after a compaction, and through a real coordinator over gRPC (issue 49, item 4)."""

from __future__ import annotations

import time

import pytest

import ifrt
from coordinator.core import compaction, journal
from coordinator.core.effects import KeyChanged
from coordinator.core.limits import Limits
from coordinator.core.retries import Forgotten, RetryAnswers, Stored, ordered, record_cost
from coordinator.core.state import ClusterState
from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import ResourceExhausted
from tests.helpers import clients, published
from tests.replicas import Replicas

BIG = b"v" * 2000
"""A value whose set pushes a few small answers out of ``LIMITS``."""
LIMITS = Limits(answer_bytes=8 * 1024)
PUSHED_OUT = r"the answers of this client's calls up to request_id \d+ were pushed out of the coordinator's " \
             r"--max-answer-bytes"


def push_out(s: ClusterState, uid: str = "p1", count: int = 8) -> None:
    """Another caller's sets of big values, with fresh (ordered) request ids: every older answer is forgotten."""
    for i in range(count):
        s.current.keys.set(uid, f"big/{uid}/{i}", BIG, True, str(100 + i))


def kv_entries(s: ClusterState) -> list[journal.Entry]:
    return [e for e in s.take_journal() if not isinstance(e, journal.Registered)]


def replay(entries: list[journal.Entry], limits: Limits = LIMITS) -> ClusterState:
    """A standby's state: the processes' registrations, then ``entries``."""
    s = published(n=2, limits=limits)
    fresh = ClusterState(s.config)
    for entry in [*s.take_journal(), *entries]:
        fresh.replay(entry)
    return fresh


def compacted(entries: list[journal.Entry], limits: Limits = LIMITS) -> list[journal.Entry]:
    return [e for e, k in zip(entries, compaction.needed(entries, limits), strict=True) if k]


# The rule, without I/O.

def test_request_ids_that_are_increasing_numbers_are_ordered_and_others_not():
    assert [ordered(r) for r in ("1", "42", "9" * 19)] == [1, 42, int("9" * 19)]
    assert [ordered(r) for r in ("0", "007", "9" * 20, "r1", "", " 1", "1a", "\u0661")] == [None] * 8


def test_an_increment_pushed_out_of_the_answer_bytes_is_refused_not_applied_twice():
    # The reproduction: process 0 increments with request id T (answer 1), process 1 sets big values with
    # fresh request ids, process 0's retry of T was answered 2 and the key held 2.
    s = published(n=2, limits=LIMITS)
    assert s.current.keys.increment("p0", "n", 1, "7") == (1, [KeyChanged("n", b"1")])
    assert s.current.keys.increment("p0", "n", 1, "7") == (1, [])  # remembered: answered as before
    push_out(s)
    s.take_journal()
    with pytest.raises(ifrt.InvalidArgument, match=r"request_id '7' on key 'n': the answers of this client's calls up "
                                                   r"to request_id 7 were pushed out of the coordinator's "
                                                   r"--max-answer-bytes of 8192 bytes over all callers, so this call "
                                                   r"may have been applied and is not applied again; read the key to "
                                                   r"see whether it took effect, and if not call again with a new "
                                                   r"request_id"):
        s.current.keys.increment("p0", "n", 1, "7")
    assert s.current.keys.get("p1", "n") == b"1" and s.take_journal() == []  # changed nothing
    with pytest.raises(ifrt.InvalidArgument, match=PUSHED_OUT):
        s.current.keys.increment("p0", "n", 1, "3")  # an older request id: refused too (it may have been applied)
    assert s.current.keys.increment("p0", "n", 1, "8") == (2, [KeyChanged("n", b"2")])  # a newer one: a new call


def test_a_set_pushed_out_of_the_answer_bytes_never_undoes_a_later_write():
    s = published(n=2, limits=LIMITS)
    s.current.keys.set("p0", "k", b"A", True, "1")
    s.current.keys.set("p1", "k", b"B", True, "1")  # another process's later write
    push_out(s)
    for retry in (lambda: s.current.keys.set("p0", "k", b"A", True, "1"),
                  lambda: s.current.keys.set_many("p0", [("k", b"A")], True, "1"),
                  lambda: s.current.keys.compare_set("p0", "k", b"", b"A", "1"),
                  lambda: s.current.keys.delete("p0", "k", False, "1")):
        with pytest.raises(ifrt.InvalidArgument, match=PUSHED_OUT):
            retry()
    assert s.current.keys.get("p1", "k") == b"B"


def test_after_an_unordered_request_id_is_pushed_out_no_unordered_call_of_that_caller_is_applied():
    # A request id that is no increasing number cannot be told from a new call: once one of the caller's is
    # forgotten, its unordered request ids not remembered are refused; its numbered ones and other callers' go on.
    s = published(n=2, limits=LIMITS)
    s.current.keys.increment("p0", "n", 1, "a-uuid")
    push_out(s)
    for request_id in ("a-uuid", "another-uuid"):
        with pytest.raises(ifrt.InvalidArgument, match=r"an answer of this client's calls with request_ids that are "
                                                       r"not increasing numbers was pushed out of the coordinator's "
                                                       r"--max-answer-bytes .* numbered 1, 2, 3, ... per client"):
            s.current.keys.increment("p0", "n", 1, request_id)
    assert s.current.keys.increment("p0", "n", 1, "1")[0] == 2
    assert s.current.keys.increment("p1", "n", 1, "a-uuid")[0] == 3
    assert s.current.keys.increment("p0", "n", 1, "")[0] == 4  # no request id: not remembered, never refused


def test_a_call_arriving_first_after_a_newer_call_of_its_caller_was_forgotten_is_refused_and_changes_nothing():
    # Request ids are numbered in the order a client makes its calls; one delayed past the forgetting of a newer one
    # cannot be told from a retry: refused (safe, as it changed nothing), and the caller makes it again.
    s = published(n=2, limits=LIMITS)
    s.current.keys.increment("p0", "n", 1, "5")
    push_out(s)
    with pytest.raises(ifrt.InvalidArgument, match=PUSHED_OUT):
        s.current.keys.increment("p0", "n", 1, "4")
    assert s.current.keys.get("p1", "n") == b"1"


def test_the_records_of_what_callers_forgot_count_and_a_call_they_leave_no_room_for_is_refused():
    limits = Limits(answer_bytes=4 * record_cost("agent-00") + 300)
    retries = RetryAnswers(limits)
    for i in range(4):
        retries.remember(f"agent-{i:02d}", "1", "k", 0, 0)
    assert len(retries.records) == 4 and retries.held <= limits.answer_bytes
    assert retries.records_held == 4 * record_cost("agent-00")
    with pytest.raises(ResourceExhausted, match=r"remembering the answer of request_id '1' on key 'k' \(\d+ "
                                                     r"bytes\) beside the records of what 4 callers' retries may no "
                                                     r"longer be answered \(\d+ bytes\) would pass the coordinator's "
                                                     r"--max-answer-bytes"):
        retries.check_room("agent-04", "1", "k", 0)
    s = published(n=2, limits=limits)
    for i in range(4):
        s.current.keys.increment(f"p{i % 2}" if i < 2 else "p0", f"n{i}", 1, str(i + 1))
    s.take_journal()
    before = s.current.kv.retries.held
    with pytest.raises(ResourceExhausted, match="--max-answer-bytes"):
        s.current.keys.set("p1", "k", b"x" * 400, True, "9")
    assert s.current.keys.get("p0", "k") is None and s.take_journal() == [] and s.current.kv.retries.held == before


def test_a_replay_and_a_compacted_replay_refuse_and_answer_the_same_retries():
    s = published(n=2, limits=LIMITS)
    s.current.keys.increment("p0", "n", 1, "1")
    s.current.keys.set("p0", "k", b"A", True, "2")
    s.current.keys.set("p1", "k", b"B", True, "1")
    s.current.keys.increment("p1", "m", 1, "an-unordered-id")
    push_out(s, "p1")
    push_out(s, "p0")  # p0's newest calls, which stay remembered (or as marks)
    s.current.keys.increment("p0", "n", 1, "200")
    entries = kv_entries(s)
    records = [e for e in entries if isinstance(e, journal.AnswersForgotten)]
    assert records and all(journal.decode(journal.encode(e)) == e for e in records)
    kept = compacted(entries)
    newest = {e.client_uid: e for e in records}  # a caller's record only grows: its newest entry says it all
    assert [e for e in kept if isinstance(e, journal.AnswersForgotten)] == sorted(newest.values(), key=records.index)
    calls = [("p0", "1", "n"), ("p0", "2", "k"), ("p1", "1", "k"), ("p1", "an-unordered-id", "m"), ("p0", "200", "n"),
             ("p0", "107", "big/p0/7"), ("p1", "100", "big/p1/0"), ("p0", "300", "n"), ("p1", "another-id", "m")]

    def answers(state: ClusterState) -> list[object]:
        retries = state.current.kv.retries
        return [retries.get(*call) for call in calls] + [dict(retries.records), retries.held, retries.calls()]

    live = answers(s)
    assert live[0] == live[1] == Forgotten(per_caller=False, through=104)  # p0's numbered calls up to 104 forgotten
    assert live[2] == live[6] == Forgotten(per_caller=False, through=107)  # all of p1's
    assert live[3] == live[8] == Forgotten(per_caller=False)  # p1's unordered ids
    assert (live[4], live[5], live[7]) == (2, Stored.of(BIG), None)  # remembered: answered; a new call
    assert answers(replay(entries)) == live
    assert answers(replay(kept)) == live
    for cut in range(0, len(entries), 5):  # a journal of which only an oldest part was compacted
        assert answers(replay(compacted(entries[:cut]) + entries[cut:])) == live
    assert answers(replay(compacted(compacted(entries[:9]) + entries[9:]))) == live


def test_the_records_of_an_ended_run_go_from_the_journal_with_its_answers():
    s = published(n=2, limits=LIMITS)
    s.current.keys.increment("p0", "n", 1, "1")
    push_out(s)
    entries = kv_entries(s)
    assert any(isinstance(e, journal.AnswersForgotten) for e in compacted(entries))
    assert not any(isinstance(e, journal.AnswersForgotten) for e in compacted([*entries, journal.RunStarted(2)]))
    garbage = compaction.Garbage()
    garbage.observe(journal.AnswersForgotten("p0", 1, False), 60)
    garbage.observe(journal.AnswersForgotten("p0", 2, False), 60)
    assert (garbage.entries, garbage.bytes) == (1, 60)  # a caller's newer record supersedes its older one


# Through a real coordinator.

def _increment(client: ifrt.Client, request_id: str) -> int:
    """``kv_increment`` of key "n" as the client sends it, with ``request_id``: the same request again is its retry."""
    request = pb.KeyValueIncrementRequest(client_uid=client.client_uid, key="n", amount=1, request_id=request_id)
    return client._unary("KeyValueIncrement", lambda _: request, time.monotonic() + 30).value


def _set(client: ifrt.Client, value: bytes, request_id: str) -> None:
    request = pb.KeyValueSetRequest(client_uid=client.client_uid, key="k", value=value, allow_overwrite=True,
                                    request_id=request_id)
    client._unary("KeyValueSet", lambda _: request, time.monotonic() + 30)


def test_a_retry_whose_answer_other_callers_pushed_out_is_refused_over_grpc():
    # The issue's trial at a small --max-answer-bytes: 20 sets of 4 KiB by process 1 push out process 0's answers.
    with LocalCoordinator("--max-answer-bytes", "16384", num_processes=2, log_level="WARNING") as coordinator:
        a, b = made = clients(coordinator.address, 2, transfer=False)
        try:
            increment, first_set = a._kv.request_id(), a._kv.request_id()  # as the client numbers its calls
            assert _increment(a, increment) == 1
            _set(a, b"A", first_set)
            assert _increment(a, increment) == 1  # a retry while remembered: answered as before
            b.kv_set("k", b"B", allow_overwrite=True)  # another process's later write
            for i in range(20):
                b.kv_set(f"big/{i}", bytes([i]) * 4096)
            with pytest.raises(ifrt.InvalidArgument, match=f"request_id '{increment}' on key 'n': {PUSHED_OUT}"):
                _increment(a, increment)
            with pytest.raises(ifrt.InvalidArgument, match=f"request_id '{first_set}' on key 'k': {PUSHED_OUT}"):
                _set(a, b"A", first_set)
            assert (b.kv_try_get("n"), b.kv_try_get("k")) == (b"1", b"B")
            assert a.kv_increment("n") == 2  # the client's next call is a new one
        finally:
            for c in made:
                c.close()


def test_a_standby_refuses_the_same_retries_after_a_failover(etcd):
    # The records are journaled: the standby that replays the journal refuses what the leader refused.
    with Replicas(etcd, "--max-answer-bytes", "16384", num_processes=2, cluster_id="retries",
                  heartbeat="30") as replicas:
        a, b = made = clients(replicas.addresses, 2, transfer=False)
        try:
            increment = a._kv.request_id()
            assert _increment(a, increment) == 1
            for i in range(20):
                b.kv_set(f"big/{i}", bytes([i]) * 4096)
            remembered = b._kv.request_id()
            request = pb.KeyValueIncrementRequest(client_uid=b.client_uid, key="m", amount=1, request_id=remembered)
            assert b._unary("KeyValueIncrement", lambda _: request, time.monotonic() + 30).value == 1
            replicas.kill_leader()
            with pytest.raises(ifrt.InvalidArgument, match=f"request_id '{increment}' on key 'n': {PUSHED_OUT}"):
                _increment(a, increment)
            assert b._unary("KeyValueIncrement", lambda _: request, time.monotonic() + 30).value == 1  # answered
            assert (b.kv_try_get("n"), b.kv_try_get("m")) == (b"1", b"1")
        finally:
            for c in made:
                c.close()
