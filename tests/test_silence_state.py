"""The heartbeat timeout is the tolerance it says, and a leader that loses most of the job at once suspects itself
first: the pure state machine's rules (coordinator.core.liveness, ClusterConfig.grace_after_session), without a
network."""

from __future__ import annotations

import pytest

from coordinator.core.effects import SuspectSelf
from coordinator.core.journal import Failed
from ifrt.events import ProcessFailed
from tests.helpers import TIMEOUT, failures, published

PING_TIMEOUT = 0.5 * TIMEOUT


def suspicions(effects) -> list[SuspectSelf]:
    return [e for e in effects if isinstance(e, SuspectSelf)]


def failed_at(heard: float, dropped: float, step: float = 0.001) -> float:
    """When process 1 of a 3-process cluster, last heard at ``heard`` and dropped at ``dropped``, is failed."""
    s = published()
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, heard)
    s.current.detach("p1", dropped)
    t = dropped
    while not failures(s.tick(t)):
        t = round(t + step, 6)
        s.current.heard("p0", t)
        s.current.heard("p2", t)
    return t


@pytest.mark.parametrize(("heard", "dropped"), [(0.0, 0.2), (0.0, 0.31), (0.0, 0.5), (0.0, 0.9), (0.4, 0.8)])
def test_no_process_is_failed_before_it_was_silent_for_the_timeout(heard, dropped):
    at = failed_at(heard, dropped)
    if dropped - heard <= 0.3:  # answering until its connection closed (killed): the reconnect grace
        assert at == pytest.approx(dropped + TIMEOUT / 8, abs=0.002)
    else:  # dropped for silence: heard last at its Heartbeat, or up to the unanswered ping (a ping timeout earlier)
        last_heard = max(heard, dropped - PING_TIMEOUT)
        assert last_heard + TIMEOUT <= at <= last_heard + TIMEOUT + 0.002


def test_a_flap_within_the_timeout_costs_nothing():
    s = published()
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 1.0)
    s.current.detach("p1", 1.7)  # its link went silent after 1.0: dropped by keepalive at 1.7
    assert failures(s.tick(2.1)) == []  # before: failed at 1.7 + 1/8
    s.current.attach("p1", 2.1)  # the link is back: it attached again, 1.1 s after it was last heard
    s.current.heard("p1", 2.1)
    assert failures(s.tick(10.0)) == []


def test_a_worker_whose_host_session_ended_is_assumed_silent():
    s = published()
    s.current.detach("p1", 1.0, carried=True)  # Heartbeats do not cross an agent's host session
    assert failures(s.tick(1.0 + TIMEOUT - PING_TIMEOUT)) == []
    assert failures(s.tick(1.0 + TIMEOUT - PING_TIMEOUT + 0.01)) == [
        ProcessFailed(1, "lost its connection and did not come back within 0.5s")]


def test_most_of_the_job_silent_at_once_is_suspected_as_the_leaders_partition_and_nothing_is_journaled():
    s = published(4)
    for uid in ("p0", "p1", "p2", "p3"):
        s.current.heard(uid, 1.0)
    for uid, at in (("p0", 1.5), ("p1", 1.55), ("p2", 1.6)):  # dropped for silence, each at its own ping
        s.current.detach(uid, at)
    s.current.heard("p3", 2.0)
    s.take_journal()
    effects = s.tick(2.13)  # p0 is overdue; p1 and p2 went silent too: 3 of 4
    assert failures(effects) == [] and suspicions(effects) == [SuspectSelf(
        "3 of the job's 4 live processes went silent at once (their connections dropped unanswered, or their "
        "heartbeats stopped): more likely this coordinator's own partition than theirs", TIMEOUT)]
    assert s.take_journal() == []  # nothing durable on that evidence alone
    assert suspicions(s.tick(2.3)) and failures(s.tick(2.3)) == []  # spared, not forgotten: found again
    s.current.attach("p0", 2.4)  # they come back (the cut healed): nothing was lost
    s.current.attach("p1", 2.4)
    s.current.attach("p2", 2.4)
    assert s.tick(2.9) == []


def test_a_minority_cut_off_is_failed_as_before():
    s = published(4)
    for uid in ("p0", "p1", "p2", "p3"):
        s.current.heard(uid, 1.0)
    s.current.detach("p1", 1.5)
    s.current.detach("p2", 1.5)  # 2 of 4: not more than half
    effects = s.tick(2.2)
    assert [f.process_id for f in failures(effects)] == [1, 2] and suspicions(effects) == []
    assert [type(e) for e in s.take_journal()][-2:] == [Failed, Failed]


def test_a_one_process_job_is_failed_as_before():
    s = published(1)
    s.current.heard("p0", 1.0)
    s.current.detach("p0", 1.5)
    effects = s.tick(2.2)
    assert [f.process_id for f in failures(effects)] == [0] and suspicions(effects) == []


def test_killed_processes_are_failed_fast_even_all_at_once():
    s = published(3)
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 1.0)
        s.current.detach(uid, 1.05)  # closed while answering: their kernels closed the sockets
    effects = s.tick(1.05 + TIMEOUT / 8 + 0.01)
    assert [f.process_id for f in failures(effects)] == [0, 1, 2] and suspicions(effects) == []


def test_after_standing_aside_or_a_takeover_processes_that_never_come_back_are_failed():
    s = published(3)
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 1.0)
        s.current.detach(uid, 1.5)
    assert suspicions(s.tick(2.2))
    s.reset_liveness(3.0)  # as the replica that leads next does, after replaying the journal
    assert s.tick(3.9) == []
    effects = s.tick(4.01)  # never heard by this leader: no suspicion, failed after its grace as after any failover
    assert [f.process_id for f in failures(effects)] == [0, 1, 2] and suspicions(effects) == []


def test_most_of_the_job_hung_at_once_is_suspected_too():
    s = published(3, hung_timeouts=2)
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 1.0)
    effects = s.tick(3.01)  # every session connected, no heartbeat for 2 timeouts: this leader's reads stalled?
    assert failures(effects) == [] and suspicions(effects)
    s.current.heard("p0", 3.1)
    s.current.heard("p1", 3.1)
    effects = s.tick(3.2)
    assert suspicions(effects) == [] and [f.process_id for f in failures(effects)] == [2]


def test_most_hosts_sessions_lost_at_once_under_agents_is_suspected_too():
    s = published(4)  # each process carried on its host's agent session: no Heartbeats reach the coordinator
    for uid in ("p0", "p1", "p2"):
        s.current.detach(uid, 1.0, carried=True)
    effects = s.tick(1.0 + TIMEOUT - PING_TIMEOUT + 0.01)
    assert failures(effects) == [] and suspicions(effects)


def test_a_close_just_after_a_silence_is_a_flapping_link_not_a_kill():
    s = published()
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 1.0)
    s.current.heard("p1", 2.0)  # a heartbeat missed: its link was down for a while and is back
    s.current.detach("p1", 2.05)  # then its client gave up the connection (its keepalive timed out): no kill
    assert failures(s.tick(2.05 + TIMEOUT / 8 + 0.01)) == []  # not the reconnect grace of a kill...
    assert failures(s.tick(2.99)) == []  # ...but a heartbeat timeout from when it was last heard
    assert failures(s.tick(3.01)) == [ProcessFailed(1, "lost its connection and did not come back within 0.95s")]


def test_a_session_attached_after_a_silence_is_recovering_too():
    s = published()
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 1.0)
    s.current.detach("p1", 1.7)  # dropped for silence
    s.current.attach("p1", 2.0)  # back; its link drops again before its first Heartbeat arrives
    s.current.detach("p1", 2.1)
    assert failures(s.tick(2.5)) == []
    assert [f.process_id for f in failures(s.tick(3.11))] == [1]


def test_a_session_silent_from_its_attach_is_silent_not_killed():
    s = published()  # attached at 0.0; a client sends its first Heartbeat on attach, this one never did
    s.current.attach("p1", 1.0)  # its new session (the old one still open), then it went silent at once
    s.current.detach("p1", 1.0)
    s.current.detach("p1", 1.6)  # dropped by keepalive: no Heartbeat since it attached 0.6 s ago
    assert failures(s.tick(2.09)) == []  # heard last at the unanswered ping (1.1) at the latest: failed at 2.1
    assert [f.process_id for f in failures(s.tick(2.11))] == [1]
