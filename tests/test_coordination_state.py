"""Key-value increments and deletes, barrier cancel, live-set agreement, the preemption sync point and job attempts
in the state machine, without a network; and a replay of every new journal record."""

from dataclasses import replace

import pytest

from coordinator.core import journal
from coordinator.core.agreement import LeftOut, LiveSetResolved
from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import KeyChanged, Notify
from coordinator.core.preemption import PreemptionResolved
from coordinator.core.state import ClusterState
from ifrt.errors import BarrierCancelled, BarrierTimeout, ClusterMismatch, InvalidArgument, ProcessDeclaredFailed
from ifrt.events import PreemptionNotice
from tests.helpers import TIMEOUT, admit, lose_session, published, reg


def test_increment_starts_at_zero_and_a_retry_is_not_applied_twice():
    s = published()
    assert s.current.keys.increment("p0", "count", 5, "call-1") == (5, [KeyChanged("count", b"5")])
    assert s.current.keys.increment("p1", "count", 1, "call-2") == (6, [KeyChanged("count", b"6")])
    assert s.current.keys.increment("p0", "count", 5, "call-1") == (5, [])  # the retry is answered, not applied
    assert s.current.keys.get("p2", "count") == b"6"
    assert s.current.keys.increment("p2", "count", -10, "call-3")[0] == -4


def test_increment_of_a_value_that_is_no_integer_is_refused_and_changes_nothing():
    s = published()
    s.current.keys.set("p0", "name", b"abc", False)
    s.take_journal()
    with pytest.raises(InvalidArgument, match="key 'name' holds 3 bytes that are not a decimal integer"):
        s.current.keys.increment("p0", "name", 1, "x")
    s.current.keys.set("p0", "big", str(2**63 - 1).encode(), False)
    with pytest.raises(InvalidArgument, match="leaves the signed 64-bit range"):
        s.current.keys.increment("p0", "big", 1, "y")
    assert (s.current.keys.get("p0", "name"), s.current.keys.get("p0", "big")) == (b"abc", b"9223372036854775807")


def test_delete_one_key_or_a_prefix_and_a_missing_key_is_no_error():
    s = published()
    for key in ("a/1", "a/2", "ab", "b"):
        s.current.keys.set("p0", key, b"v", False)
    assert s.current.keys.delete("p1", "missing", False) == (0, [])
    assert s.current.keys.delete("p1", "ab", False) == (1, [KeyChanged("ab", None)])
    assert s.current.keys.delete("p1", "a/", True) == (2, [KeyChanged("a/1", None), KeyChanged("a/2", None)])
    assert s.current.keys.dir("p0", "") == [("b", b"v")]


def test_cancel_fails_current_and_future_waiters_and_leaves_a_completed_barrier_alone():
    s = published()
    assert s.current.arrive("p0", "step-1", frozenset(), 60, 0.0) == (None, [])
    cancelled, effects = s.current.cancel_barrier("p1", "step-1", 0.1)
    assert cancelled and len(effects) == 1 and isinstance(effects[0].error, BarrierCancelled)
    assert str(effects[0].error) == "barrier 'step-1' was cancelled by process 1 (h1 (10.0.0.1))"
    outcome, _ = s.current.arrive("p2", "step-1", frozenset(), 60, 0.2)  # a later waiter hears it too
    assert isinstance(outcome.error, BarrierCancelled)
    assert s.current.cancel_barrier("p0", "not-yet", 0.3)[0]  # before anyone arrived
    outcome, _ = s.current.arrive("p1", "not-yet", frozenset({0, 1}), 60, 0.4)
    assert str(outcome.error) == "barrier 'not-yet' was cancelled by process 0 (h0 (10.0.0.1))"
    for uid in ("p0", "p1", "p2"):
        s.current.arrive(uid, "done", frozenset(), 60, 0.5)
    assert s.current.cancel_barrier("p0", "done", 0.6) == (False, [])
    assert s.current.barrier_outcome("done").error is None


def test_two_participant_sets_for_one_barrier_are_invalid_and_name_both():
    s = published()
    s.current.arrive("p0", "pair", frozenset({0, 1}), 60, 0.0)
    with pytest.raises(InvalidArgument) as info:
        s.current.arrive("p2", "pair", frozenset({0, 2}), 60, 0.1)
    assert str(info.value) == ("barrier 'pair' was started for processes [0, 1]; this call names [0, 2]: use a new "
                               "name for other participants")
    outcome, _ = s.current.arrive("p1", "pair", frozenset({0, 1}), 60, 0.2)  # the refused call changed nothing
    assert outcome.error is None


def test_live_set_is_decided_once_when_every_live_process_called():
    s = published(3)
    assert s.current.live_processes("p0", "c0", 60, 0.0) == (None, [])
    assert s.current.live_processes("p1", "c1", 60, 0.1) == (None, [])
    answer, effects = s.current.live_processes("p2", "c2", 60, 0.2)
    assert answer == ((0, 0), (1, 0), (2, 0))
    assert effects == [LiveSetResolved((("p0", "c0"), ("p1", "c1"), ("p2", "c2")), answer, None)]
    assert s.current.live_answer("p0", "c0") == s.current.live_answer("p1", "c1") == answer
    assert s.current.live_processes("p0", "c0", 60, 0.3) == (answer, [])  # a retry: the same answer
    assert s.current.live_processes("p0", "next", 60, 0.4) == (None, [])  # a new call starts a new agreement


def test_a_process_that_dies_while_others_wait_is_left_out():
    s = published(3)
    s.current.live_processes("p0", "c0", 60, 0.0)
    s.current.live_processes("p2", "c2", 60, 0.0)
    lose_session(s, 1)
    effects = s.tick(TIMEOUT + 0.5)  # process 1 never called and is declared failed
    [resolved] = [e for e in effects if isinstance(e, LiveSetResolved)]
    assert resolved.members == ((0, 0), (2, 0)) and resolved.error is None


def test_a_caller_declared_failed_while_it_waits_is_answered_why_at_once():
    s = published(3)
    s.current.live_processes("p0", "c0", 60, 0.0)
    s.current.live_processes("p1", "c1", 60, 0.0)
    lose_session(s, 1)
    effects = s.tick(TIMEOUT + 0.5)  # declared failed while the agreement still waits for process 2
    [left_out] = [e for e in effects if isinstance(e, LeftOut)]
    assert (left_out.client_uid, left_out.call_id) == ("p1", "c1")
    assert isinstance(left_out.error, ProcessDeclaredFailed)
    assert str(left_out.error).startswith("this process (h1 (10.0.0.1)) was declared failed: ")
    assert not [e for e in effects if isinstance(e, LiveSetResolved)]
    answer, effects = s.current.live_processes("p2", "c2", 60, TIMEOUT + 1)
    assert answer == ((0, 0), (2, 0))
    assert effects == [LiveSetResolved((("p0", "c0"), ("p2", "c2")), answer, None)]


def test_a_live_process_that_does_not_call_is_named_at_the_timeout():
    s = published(3)
    s.current.live_processes("p0", "c0", 2.0, 0.0)
    s.current.live_processes("p1", "c1", 60, 0.5)
    [resolved] = [e for e in s.tick(2.0) if isinstance(e, LiveSetResolved)]
    assert isinstance(resolved.error, BarrierTimeout)
    assert str(resolved.error) == ("live_processes found no agreement after 2.0s: 1 of 3 live processes did not call "
                                   "it: 2 (h2 (10.0.0.1))")
    assert s.current.live_answer("p1", "c1") is resolved.error


def test_preemption_sync_step_is_the_largest_reported_and_decided_once():
    s = published(3)
    assert s.current.preemption_notice("p1", 0.0) == [Notify(PreemptionNotice(1), 2)]
    assert s.current.preemption_notice("p1", 0.1) == []  # noticed again: nothing new
    assert s.current.preemption_sync("p0", 12, 60, 0.2) == (None, [])
    assert s.current.preemption_sync("p1", 10, 60, 0.3) == (None, [])
    assert s.current.preemption_sync("p2", 11, 60, 0.4) == (12, [PreemptionResolved(12, None)])
    assert s.current.preemption_sync("p1", 11, 60, 0.5) == (12, [])
    assert s.current.notices() == [PreemptionNotice(1)]


def test_preemption_sync_without_a_notice_is_the_callers_notice_and_skips_the_dead():
    s = published(3)
    outcome, effects = s.current.preemption_sync("p2", 7, 60, 0.0)
    assert outcome is None and effects == [Notify(PreemptionNotice(2), 2)]
    s.current.preemption_sync("p0", 5, 60, 0.1)
    lose_session(s, 1)
    [decided] = [e for e in s.tick(TIMEOUT + 0.5) if isinstance(e, PreemptionResolved)]
    assert decided == PreemptionResolved(7, None)


def test_a_process_of_another_attempt_is_refused_naming_both():
    s = ClusterState(ClusterConfig(num_processes=2, cluster_id="job", attempt=2))
    with pytest.raises(ClusterMismatch) as info:
        admit(s, replace(reg("a", 0, host="h0"), attempt=1), 0.0)
    assert str(info.value) == ("h0 (10.0.0.1) belongs to attempt 1 of the job; this coordinator serves attempt 2 "
                               "of cluster 'job': a process of another attempt is refused (start it with the job's "
                               "current attempt, IFRT_ATTEMPT)")
    assert s.registered == 0


def test_replaying_the_new_records_gives_the_same_answers():
    s = published(3)
    s.current.keys.increment("p0", "count", 3, "i1")
    s.current.keys.set("p0", "dir/a", b"1", False)
    s.current.keys.set("p0", "dir/b", b"2", False)
    s.current.keys.delete("p1", "dir/", True)
    s.current.cancel_barrier("p0", "cancelled-early", 0.0)
    for i in range(3):
        s.current.live_processes(f"p{i}", f"c{i}", 60, 0.0)
    s.current.preemption_notice("p2", 0.0)
    for i, step in enumerate((4, 6, 5)):
        s.current.preemption_sync(f"p{i}", step, 60, 0.0)
    entries = s.take_journal()
    assert {type(e).__name__ for e in entries} >= {"KeyIncremented", "KeysDeleted", "BarrierFinished",
                                                   "LiveSetDecided", "PreemptionNoticed", "PreemptionSyncDecided"}
    raw = [journal.encode(e) for e in entries]
    assert [journal.decode(r) for r in raw] == entries
    rebuilt = ClusterState(s.config)
    for r in raw:
        rebuilt.replay(journal.decode(r))
    assert rebuilt.take_journal() == []
    for state in (s, rebuilt):
        assert state.current.keys.dir("p0", "") == [("count", b"3")]
        assert state.current.keys.increment("p0", "count", 3, "i1") == (3, [])  # the retry is still recognized
        outcome, _ = state.current.arrive("p1", "cancelled-early", frozenset(), 60, 1.0)
        assert isinstance(outcome.error, BarrierCancelled)
        assert state.current.live_answer("p1", "c1") == ((0, 0), (1, 0), (2, 0))
        assert state.current.preemption_outcome() == 6
        assert state.current.notices() == [PreemptionNotice(2)]
