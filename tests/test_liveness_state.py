"""Liveness, restarts, failure policies, barriers and key-values in the state machine, without a network."""

from dataclasses import replace

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core import journal
from coordinator.core.barriers import BarrierResolved
from coordinator.core.cluster import ClusterConfig, FailurePolicy
from coordinator.core.effects import Evict, Forgotten, Notify, Republish, WaitingForHolder
from coordinator.core.limits import Limits
from coordinator.core.state import ClusterState
from ifrt.errors import (
    BarrierFailed,
    BarrierTimeout,
    InvalidArgument,
    KeyExists,
    ProcessDeclaredFailed,
    ProcessIdTaken,
    UnknownClient,
)
from ifrt.events import ProcessFailed, ProcessLeft, ProcessRestarted
from tests.helpers import TIMEOUT, admit, failures, lose_session, published, reg


def test_the_timing_adds_up_to_the_heartbeat_timeout():
    config = ClusterConfig(num_processes=1, heartbeat_timeout_s=10.0)
    server = CoordinatorConfig(cluster=config)
    assert (server.keepalive_interval_s, server.keepalive_timeout_s, config.reconnect_grace_s) == (2.5, 5.0, 1.25)
    assert config.answering_within_s == 3.0  # 1.5 heartbeat intervals, within 0.8 of the ping timeout (4 s)
    assert config.grace_after_session(1.0) == 1.25  # closed while answering: a kill, reported fast
    assert config.grace_after_session(3.5) == 6.5  # heard 3.5 s before the drop: failed 10 s after that
    assert config.grace_after_session(20.0) == config.grace_after_session(None) == 5.0  # silent since the ping


def test_an_attached_process_is_alive_however_long_it_sends_nothing():
    s = published()
    assert s.tick(100.0) == []  # its connection's keepalive vouches for it; a dead peer's connection is dropped
    assert [p.phase for p in s.current.report(100.0).processes] == ["alive"] * 3


def test_a_lost_session_gets_the_reconnect_grace_then_fails():
    s = published()
    s.current.detach("p1", 2.0)
    assert s.tick(2.125) == []  # grace: TIMEOUT - interval - keepalive timeout = 0.125 s
    effects = s.tick(2.13)
    assert failures(effects) == [ProcessFailed(1, "lost its connection and did not come back within 0.125s")]
    assert not any(isinstance(e, Evict) for e in effects)  # no session left to close
    assert s.topology.generation == 1  # propagate keeps the topology
    with pytest.raises(ProcessDeclaredFailed, match="lost its connection"):
        s.current.attach("p1", 2.6)
    assert s.tick(100.0) == []  # failed once


def test_attaching_again_within_the_grace_stops_the_clock():
    s = published()
    s.current.detach("p2", 0.5)
    assert s.tick(0.6) == []
    s.current.attach("p2", 0.6)  # came back in time
    assert s.tick(5.0) == []
    s.current.detach("p2", 5.0)
    assert failures(s.tick(5.2)) == [ProcessFailed(2, "lost its connection and did not come back within 0.125s")]


def test_nobody_is_failed_while_the_coordinator_catches_up_on_a_burst_of_arrivals():
    s = published(4)
    s.current.detach("p1", 2.0)  # its grace is 0.125 s; meanwhile others keep arriving, each maybe queued behind it
    for t in (2.05, 2.1, 2.15, 2.2):
        s.current.detach("p3", t)
        s.current.attach("p3", t)
        assert failures(s.tick(t)) == []
    assert failures(s.tick(2.29)) == []  # the burst is over only 0.1 s (timeout/10) after the last arrival
    assert failures(s.tick(2.31)) == [ProcessFailed(1, "lost its connection and did not come back within 0.125s")]


def test_a_burst_that_never_ends_spares_a_silent_process_for_three_timeouts_at_most():
    s = published(3)
    s.current.detach("p1", 0.0)
    t = 0.0
    while t < 2.95:
        t = round(t + 0.05, 2)
        s.current.call_started("p2", t)  # calls keep arriving; p2 is alive throughout
        assert failures(s.tick(t)) == []
    for t in (3.05, 3.1):
        s.current.call_started("p2", t)
    assert failures(s.tick(3.1)) == [ProcessFailed(1, "lost its connection and did not come back within 0.125s")]


def test_overlapping_sessions_of_a_reconnecting_client_keep_it_attached():
    s = published()
    s.current.attach("p0", 1.0)  # the new stream attached before the coordinator saw the old one end
    s.current.detach("p0", 1.5)
    assert s.tick(10.0) == []
    s.current.detach("p0", 10.0)
    assert failures(s.tick(10.2)) == [ProcessFailed(0, "lost its connection and did not come back within 0.125s")]


def test_a_process_that_never_attaches_after_publication_has_the_whole_timeout():
    s = ClusterState(ClusterConfig(num_processes=2, heartbeat_timeout_s=TIMEOUT))
    admit(s, reg("a", 0), 0.0)
    s.current.call_started("a", 0.0)
    admit(s, reg("b", 1), 0.5)  # the last one: its answer is the topology; it never opens a session
    s.current.call_ended("a", 0.5)
    s.current.attach("a", 0.6)
    assert s.tick(1.5) == []
    assert failures(s.tick(1.51)) == [ProcessFailed(1, "lost its connection and did not come back within 1s")]


def test_processes_silent_in_one_tick_fail_in_the_order_they_went_silent():
    s = published(4)
    for uid, at in (("p3", 0.1), ("p0", 0.2), ("p2", 0.3)):
        s.current.detach(uid, at)
    assert [f.process_id for f in failures(s.tick(2.0))] == [3, 0, 2]


def test_after_a_replay_every_process_has_the_whole_timeout_to_attach():
    s = published()
    s.current.detach("p1", 0.0)
    s.reset_liveness(5.0)  # as a replica that took over does
    assert s.tick(5.9) == []  # more than the reconnect grace: everyone gets the timeout
    assert [f.process_id for f in failures(s.tick(6.01))] == [0, 1, 2]


def test_waiting_registration_is_alive_and_a_silent_one_is_forgotten():
    s = ClusterState(ClusterConfig(num_processes=2, heartbeat_timeout_s=TIMEOUT))
    admit(s, reg("a", 0), 0.0)
    s.current.call_started("a", 0.0)
    assert s.tick(30.0) == []  # waiting in Register for 30s is fine
    s.current.call_ended("a", 30.0)
    assert s.tick(31.5) == [Forgotten("h (10.0.0.1)", "went silent for 1.5s before the topology was published")]
    assert s.registered == 0
    assert s.current.progress(31.5).missing_process_ids == (0, 1)
    admit(s, reg("a2", 0), 32.0)  # a restarted process takes the id
    assert s.registered == 1


def test_restart_with_the_same_devices_keeps_the_generation():
    s = published()
    s.current.detach("p1", 0.0)
    s.tick(1.5)
    before = s.topology
    outcome, effects = s.register(reg("p1-again", 1, host="h1"), 2.0)
    assert outcome.process_id == 1 and outcome.topology is before
    assert effects == [Notify(ProcessRestarted(1, 1), 3)]  # job events: 1 generation 1, 2 the failure
    s.current.attach("p1-again", 2.0)
    with pytest.raises(ProcessDeclaredFailed, match=r"lost its connection"):
        s.current.attach("p1", 2.0)
    assert s.tick(50.0) == []  # the new incarnation is attached; the old one is failed already


def test_restart_with_other_devices_publishes_the_next_generation():
    s = published()
    s.current.detach("p1", 0.0)
    outcome, effects = s.register(reg("p1-again", 1, host="h1", devices=5), 0.5)  # before failure was detected
    assert effects[0] == Republish(s.topology, 2)  # before the restart: a peer holds it when it hears the restart
    assert effects[1] == Notify(ProcessRestarted(1, 1), 3)
    assert s.topology.generation == 2 and outcome.topology is s.topology
    assert [d.local_id for d in s.topology.devices if d.process_id == 1] == [0, 1, 2, 3, 4]


def test_restart_is_refused_while_the_holder_is_connected():
    s = published()
    with pytest.raises(ProcessIdTaken, match=r"process id 1 is already registered by h1 .*alive"):
        s.register(reg("impostor", 1, host="other"), 0.5)


def test_elastic_policy_drops_the_failed_process():
    s = published(3, on_failure=FailurePolicy.ELASTIC, min_processes=2)
    lose_session(s, 0)
    effects = s.tick(1.5)
    assert failures(effects) == [ProcessFailed(0, "lost its connection and did not come back within 0.125s")]
    assert Republish(s.topology, 3) in effects
    assert s.topology.generation == 2
    assert [p.process_id for p in s.topology.processes] == [1, 2]  # survivors keep their ids
    assert s.topology.num_processes == 2


def test_elastic_policy_below_the_minimum_is_fatal():
    s = published(3, on_failure=FailurePolicy.ELASTIC, min_processes=3)
    lose_session(s, 0)
    effects = s.tick(1.5)
    assert "fewer than --min-processes 3: the cluster cannot continue" in failures(effects)[0].reason
    assert not any(isinstance(e, Republish) for e in effects)
    assert s.topology.generation == 1


def test_leave_is_reported_as_left():
    s = published()
    assert s.leave("p2", 0.5)[0] == Notify(ProcessLeft(2), 2)
    lose_session(s, 2, at=0.5)  # a process that left is not failed for going
    assert failures(s.tick(5.0)) == []


def test_barrier_completes_when_everyone_arrived():
    s = published()
    assert s.current.arrive("p0", "step-1", frozenset(), 10, 0.1) == (None, [])
    assert s.current.arrive("p2", "step-1", frozenset(), 10, 0.2) == (None, [])
    done = BarrierResolved("step-1", None)
    assert s.current.arrive("p1", "step-1", frozenset(), 10, 0.3) == (done, [done])
    assert s.current.arrive("p1", "step-1", frozenset(), 10, 0.4) == (done, [])  # a retry sees it done, nothing new
    assert s.current.barrier_outcome("step-1") == done


def test_barrier_fails_at_once_when_a_participant_fails():
    s = published()
    s.current.arrive("p0", "sync", frozenset({0, 1}), 60, 0.1)
    lose_session(s, 1)
    effects = s.tick(1.5)
    [resolved] = [e for e in effects if isinstance(e, BarrierResolved)]
    assert isinstance(resolved.error, BarrierFailed)
    assert "process 1 failed: lost its connection" in str(resolved.error)
    outcome, _ = s.current.arrive("p0", "later", frozenset({0, 1}), 60, 1.6)
    assert isinstance(outcome.error, BarrierFailed)
    assert "process 1 failed" in str(s.current.barrier_outcome("later").error)


def test_barrier_timeout_names_who_did_not_arrive():
    s = published()
    s.current.arrive("p0", "sync", frozenset(), 0.5, 0.0)
    [resolved] = s.tick(0.6)
    assert isinstance(resolved.error, BarrierTimeout)
    assert "2 of 3 processes did not arrive: 1 (h1 (10.0.0.1)), 2 (h2 (10.0.0.1))" in str(resolved.error)


def test_barrier_misuse_is_an_invalid_argument():
    s = published()
    s.current.arrive("p0", "b", frozenset({0, 1}), 5, 0.0)
    with pytest.raises(InvalidArgument, match="was started for processes \\[0, 1\\]"):
        s.current.arrive("p2", "b", frozenset({0, 2}), 5, 0.0)
    with pytest.raises(InvalidArgument, match="process 2 is not a participant"):
        s.current.arrive("p2", "c", frozenset({0, 1}), 5, 0.0)
    with pytest.raises(InvalidArgument, match="not in the topology"):
        s.current.arrive("p0", "d", frozenset({0, 7}), 5, 0.0)
    with pytest.raises(UnknownClient):
        s.current.arrive("stranger", "e", frozenset(), 5, 0.0)


def test_key_values():
    s = published()
    assert s.current.keys.set("p0", "nccl/id", b"abc", allow_overwrite=False)
    assert not s.current.keys.set("p1", "nccl/id", b"abc", allow_overwrite=False)  # same value again: a retry
    with pytest.raises(KeyExists, match="already holds another value"):
        s.current.keys.set("p1", "nccl/id", b"xyz", allow_overwrite=False)
    assert s.current.keys.set("p1", "nccl/id", b"xyz", allow_overwrite=True)
    s.current.keys.set("p0", "nccl/other", b"1", allow_overwrite=False)
    s.current.keys.set("p0", "other", b"2", allow_overwrite=False)
    assert s.current.keys.dir("p2", "nccl/") == [("nccl/id", b"xyz"), ("nccl/other", b"1")]
    assert s.current.keys.get("p2", "missing") is None
    with pytest.raises(UnknownClient):
        s.current.keys.get("stranger", "nccl/id")


def test_oversized_value_is_refused_and_stores_nothing():
    s = published(limits=Limits(kv_value_bytes=8))
    s.take_journal()
    with pytest.raises(InvalidArgument, match="9 bytes: expected at most 8"):
        s.current.keys.set("p0", "k", b"x" * 9, allow_overwrite=False)
    assert s.current.keys.get("p0", "k") is None
    assert s.take_journal() == []


def test_a_session_that_stopped_heartbeating_shows_slow_and_fails_as_stopped_answering():
    s = published()  # heartbeat timeout 1 s: slow past 1/3 s without a heartbeat
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 0.1)
    s.current.heard("p0", 0.45)
    s.current.heard("p2", 0.3)  # every 0.2 s or so, as sessions send them
    s.current.heard("p2", 0.45)
    report = s.current.report(0.5)
    assert [p.process_id for p in report.slow] == [1]  # quiet for 0.4 s
    assert [round(p.heartbeat_age_s, 2) for p in report.processes] == [0.05, 0.4, 0.05]
    s.current.detach("p1", 0.6)  # its connection dropped after 0.5 s without a heartbeat: it stopped answering
    s.current.heard("p2", 0.59)
    s.current.detach("p2", 0.6)  # heard from just before: its connection was closed (killed), not dropped
    assert failures(s.tick(0.8)) == [ProcessFailed(2, "lost its connection and did not come back within 0.125s")]
    # last heard at its Heartbeat (0.1; the unanswered ping was sent 0.5 s before the drop, as late): failed at 1.1
    assert failures(s.tick(1.09)) == []
    assert failures(s.tick(1.11)) == [
        ProcessFailed(1, "stopped answering (no heartbeat for 0.5s, then its connection was dropped: hung, or its "
                         "host cut off) and did not come back within 0.5s")]


def test_a_session_that_never_heartbeats_is_judged_by_its_connection_alone():
    s = published()  # clients that predate heartbeats: keepalive vouches for them, as before
    assert s.current.report(50.0).slow == () and {p.heartbeat_age_s for p in s.current.report(50.0).processes} == {0.0}
    s.current.detach("p1", 50.0)
    assert failures(s.tick(50.2)) == [ProcessFailed(1, "lost its connection and did not come back within 0.125s")]


def test_a_process_answered_and_not_attached_yet_is_not_taken_over_by_a_second_launch():
    s = ClusterState(ClusterConfig(num_processes=2, heartbeat_timeout_s=TIMEOUT))
    for i in range(2):
        s.current.call_started(f"p{i}", 0.0)
        admit(s, replace(reg(f"p{i}", host=f"h{i}"), opens_session=True), 0.0)
    for i in range(2):
        s.current.call_ended(f"p{i}", 0.01)  # both answered with the topology; neither has opened its session yet
    s.current.attach("p0", 0.02)
    outcome, effects = s.register(reg("second-launch", host="h1"), 0.05)  # it waits: nothing admitted or journaled
    assert outcome == WaitingForHolder("1 (h1 (10.0.0.1) local rank 0)", pytest.approx(0.04)) and effects == []
    assert s.take_journal()[-1] != journal.Registered(reg("second-launch", host="h1"), 0.05)
    s.current.attach("p1", 0.06)  # the first launch's process attaches: the second launch's is refused by name
    with pytest.raises(ProcessIdTaken, match=r"process \(held by a live process on h1"):
        s.register(reg("second-launch", host="h1"), 0.07)
    assert s.current.process_id_of("p1") == 1 and s.topology.generation == 1


def test_a_process_that_never_attaches_is_taken_over_once_it_is_declared_failed():
    s = ClusterState(ClusterConfig(num_processes=2, heartbeat_timeout_s=TIMEOUT))
    for i in range(2):
        admit(s, replace(reg(f"p{i}", host=f"h{i}"), opens_session=True), 0.0)
        s.current.call_ended(f"p{i}", 0.0)
    s.current.attach("p0", 0.0)
    assert isinstance(s.register(reg("p1-restarted", host="h1"), 0.5)[0], WaitingForHolder)  # killed, or attaching
    assert failures(s.tick(TIMEOUT + 0.1)) == [ProcessFailed(1, f"lost its connection and did not come back within "
                                                                f"{TIMEOUT:g}s")]
    outcome, _ = s.register(reg("p1-restarted", host="h1"), TIMEOUT + 0.2)
    assert outcome.process_id == 1


def test_a_process_without_a_session_is_taken_over_by_its_restart_at_once():
    s = ClusterState(ClusterConfig(num_processes=1, heartbeat_timeout_s=TIMEOUT))
    admit(s, reg("p0", host="h0"), 0.0)  # Client(session=False): nothing vouches for it once answered
    s.current.call_ended("p0", 0.0)
    outcome, _ = s.register(reg("p0-restarted", host="h0"), 0.1)
    assert outcome.process_id == 0


def test_a_replica_that_took_over_vouches_for_no_process_it_only_replayed():
    s = ClusterState(ClusterConfig(num_processes=1, heartbeat_timeout_s=TIMEOUT))
    admit(s, replace(reg("p0", host="h0"), opens_session=True), 0.0)
    s.current.call_ended("p0", 0.0)
    standby = ClusterState(s.config)
    for entry in s.take_journal():
        standby.replay(entry)
    standby.reset_liveness(1.0)
    outcome, _ = standby.register(reg("p0-restarted", host="h0"), 1.1)  # the job restarted with its coordinator
    assert outcome.process_id == 0


def test_a_process_whose_session_ended_is_taken_over_by_its_restart_at_once():
    s = published()
    s.current.detach("p1", 0.0)  # killed: its connection closed
    outcome, _ = s.register(reg("p1-again", 1, host="h1"), 0.01)
    assert outcome.process_id == 1
