"""The job's numbered event history in the state machine, without a network: numbering, what a session opening from
a position is sent, the bound and its snapshot, and the same history after a replay, whole or compacted."""

import pytest

from coordinator.core import compaction
from coordinator.core.cluster import FailurePolicy
from coordinator.core.history import CatchUp, GenerationPublished, Numbered, Snapshot
from coordinator.core.limits import DEFAULT_LIMITS, Limits
from coordinator.core.state import ClusterState
from ifrt.errors import InvalidArgument
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.ids import MAX_PROCESSES
from tests.helpers import published, reg

LOST = "lost its connection and did not come back within 0.125s"


def fail(s: ClusterState, uid: str, now: float) -> None:
    """``uid`` loses its session at ``now`` and is failed once the reconnect grace (0.125 s) is over."""
    s.current.detach(uid, now)
    s.tick(now + 1.0)


def test_job_events_are_numbered_in_the_order_decided_and_nothing_else_takes_a_number():
    s = published()
    assert (s.published_at, s.event_position) == (1, 1)  # generation 1 is event 1
    s.current.keys.set("p0", "k", b"v", True)
    s.current.arrive("p0", "b", frozenset({0}), 5.0, 0.1)
    assert s.event_position == 1  # key-values and barriers are not job events
    s.leave("p1", 0.5)
    fail(s, "p2", 1.0)
    assert s.current.catch_up(0, 1, 1) == CatchUp(3, (Numbered(2, ProcessLeft(1)), Numbered(3, ProcessFailed(2, LOST))))
    assert s.current.catch_up(0, 2, 1) == CatchUp(3, (Numbered(3, ProcessFailed(2, LOST)),))
    assert s.current.catch_up(0, 3, 1) == CatchUp(3)


def test_a_session_is_sent_the_current_topology_where_the_generations_were_published():
    s = published(4, on_failure=FailurePolicy.ELASTIC)
    fail(s, "p3", 0.0)  # event 2: the failure; event 3: generation 2 without it
    fail(s, "p2", 2.0)  # event 4, then generation 3 as event 5
    s.leave("p1", 4.0)  # event 6, then generation 4 as event 7
    s.current.keys.set("p0", "after", b"1", True)
    assert s.topology.generation == 4 and s.published_at == 7
    current = Numbered(7, GenerationPublished(4))
    reason, run = LOST, s.current
    assert run.catch_up(0, 1, 1).events == (Numbered(2, ProcessFailed(3, reason)),
                                            Numbered(4, ProcessFailed(2, reason)),
                                            Numbered(6, ProcessLeft(1)), current)  # the superseded generations left out
    assert run.catch_up(0, 7, 4) == CatchUp(7)  # up to date
    assert run.catch_up(0, 7, 3).events == (current,)  # a position past its generation, but another held: sent first


def test_a_restarted_process_is_not_told_of_its_own_earlier_incarnation():
    s = published()
    fail(s, "p1", 0.0)  # event 2
    s.register(reg("p1-again", 1, host="h1"), 2.0)  # event 3: restarted, the same generation
    s.current.attach("p1-again", 2.0)
    s.leave("p2", 3.0)  # event 4
    restarted = Numbered(3, ProcessRestarted(1, 1))
    assert s.current.catch_up(1, 1, 1).events == (Numbered(4, ProcessLeft(2)),)
    assert s.current.catch_up(0, 1, 1).events == (Numbered(2, ProcessFailed(1, LOST)), restarted,
                                                  Numbered(4, ProcessLeft(2)))


def test_past_the_bound_a_session_gets_each_process_state_instead():
    s = published(4, limits=Limits(event_history=2))
    s.leave("p1", 0.5)  # event 2
    fail(s, "p2", 1.0)  # event 3; the history holds 2 and 3
    assert s.current.catch_up(0, 1, 1).events == (Numbered(2, ProcessLeft(1)), Numbered(3, ProcessFailed(2, LOST)))
    s.current.preemption_notice("p3", 3.0)  # event 4; event 2 is gone
    assert s.current.catch_up(0, 2, 1).events == (Numbered(3, ProcessFailed(2, LOST)), Numbered(4, PreemptionNotice(3)))
    snapshot = Snapshot(4, failed=(ProcessFailed(2, LOST),), left=(ProcessLeft(1),), preemption=PreemptionNotice(3))
    assert s.current.catch_up(0, 1, 1) == CatchUp(4, (), snapshot)
    assert s.current.catch_up(2, 1, 1).snapshot.failed == ()  # a process is not told about itself


def test_a_restarted_process_appears_in_the_snapshot_with_its_incarnation():
    s = published(3, limits=Limits(event_history=1))
    fail(s, "p1", 0.0)
    s.register(reg("p1-again", 1, host="h1"), 2.0)
    assert s.current.catch_up(0, 1, 1) == CatchUp(3, (), Snapshot(3, restarted=(ProcessRestarted(1, 1),)))


def test_a_position_past_the_latest_event_is_refused_and_changes_nothing():
    s = published()
    s.leave("p1", 0.5)
    with pytest.raises(InvalidArgument, match=r"opened from job event 9, but the latest event of this cluster is 2"):
        s.current.catch_up(0, 9, 1)
    assert s.current.catch_up(0, 1, 1) == CatchUp(2, (Numbered(2, ProcessLeft(1)),))


def test_the_default_bound_holds_several_events_for_every_process_of_the_largest_job():
    # A job of 2**14 processes that all fail and come back with other devices (a failure, a restart and a new
    # generation each) never makes a session that attaches late fall back to a snapshot.
    assert DEFAULT_LIMITS.event_history >= 3 * MAX_PROCESSES


def history_of(s: ClusterState) -> tuple:
    return s.event_position, s.published_at, s.current.catch_up(0, 0, 0)


def run_job(s: ClusterState) -> None:
    """Events interleaved with key-value writes that a compaction drops."""
    for i in range(20):
        s.current.keys.set("p0", "hot", str(i).encode(), True)
    fail(s, "p1", 0.0)
    for i in range(20):
        s.current.keys.set("p0", "hot", f"x{i}".encode(), True)
        s.current.keys.delete("p0", "cold", False)
        s.current.keys.set("p0", "cold", b"1", True)
    s.register(reg("p1-again", 1, host="h1", devices=3), 2.0)  # a restart with other devices: generation 2
    s.current.attach("p1-again", 2.0)
    s.current.keys.delete("p0", "hot", False)
    s.current.preemption_notice("p0", 2.5)
    s.leave("p2", 3.0)


def test_a_replay_whole_or_compacted_rebuilds_the_same_history_with_the_same_numbers():
    s = published(3, on_failure=FailurePolicy.PROPAGATE)
    run_job(s)
    entries = s.take_journal()
    before = (s.event_position, s.published_at, s.current.catch_up(0, 0, 0))
    assert before[0] == 6 and before[1] == 3  # gen 1, failed, gen 2, restarted (after the generation it completes),
    # notice, left

    def replayed(kept) -> ClusterState:
        fresh = ClusterState(s.config)
        for entry in kept:
            fresh.replay(entry)
        return fresh

    keep = compaction.needed(entries)
    assert not all(keep)  # the overwritten keys are dropped
    compacted = [e for e, k in zip(entries, keep, strict=True) if k]
    assert history_of(replayed(entries)) == before
    assert history_of(replayed(compacted)) == before
