"""Barriers used as a per-step series (``s/0``, ``s/1``, ...), each naming the one it follows in ``supersedes``: the
coordinator forgets a step once the next one completed, so a job of any length stays within ``--max-barriers``; a
late caller of the latest step still gets its result, a failed or cancelled step forgets nothing, and a standby
that takes over forgets what the leader forgot."""

from __future__ import annotations

import pytest

import ifrt
from coordinator.core import journal
from coordinator.core.barriers import BarrierResolved, Barriers
from coordinator.core.limits import Limits
from coordinator.core.state import ClusterState
from ifrt.errors import BarrierCancelled, BarrierFailed, BarrierTimeout, InvalidArgument
from tests.helpers import barrier_started_for, clients, in_thread, published, together
from tests.replicas import Replicas

PAIR = frozenset({0, 1})


def step(barriers: Barriers, name: str, supersedes: str = "", participants: frozenset[int] = PAIR,
         now: float = 0.0) -> list[BarrierResolved]:
    """Every participant arrives at ``name``; the effects of the last arrival."""
    effects: list[BarrierResolved] = []
    for pid in sorted(participants):
        _, effects = barriers.arrive(name, pid, participants, 60, now, {}, supersedes=supersedes)
    return effects


def series_name(n: int) -> str:
    return f"s/{n}"


def previous(n: int) -> str:
    return series_name(n - 1) if n else ""


# The pure state.
def test_a_series_keeps_two_steps_whatever_its_length_and_a_constant_footprint():
    barriers = Barriers(Limits(barriers=8))
    held_by_step = {}
    for n in range(300):
        assert step(barriers, series_name(n), previous(n)) == [BarrierResolved(series_name(n), None)]
        held_by_step[n] = barriers.held
    assert barriers.get("s/299") is not None and barriers.outcome("s/299") == BarrierResolved("s/299", None)
    assert [barriers.get(series_name(n)) for n in range(299)] == [None] * 299
    assert len({held_by_step[n] for n in range(101, 300)}) == 1  # names of one length: the same bytes at every step


def test_the_bytes_of_the_forgotten_step_go_back():
    barriers = Barriers()
    step(barriers, "s/0")
    one_step = barriers.held
    barriers.arrive("s/1", 0, PAIR, 60, 0.0, {}, supersedes="s/0")
    assert barriers.held > one_step  # s/1 pending beside s/0
    barriers.arrive("s/1", 1, PAIR, 60, 0.0, {}, supersedes="s/0")
    assert barriers.get("s/0") is None
    assert barriers.held < 2 * one_step  # what s/0 held is free again: about one step's worth is left


def test_only_a_finished_step_of_the_same_participants_is_forgotten():
    barriers = Barriers()
    step(barriers, "pair")
    step(barriers, "trio", "pair", frozenset({0, 1, 2}))
    assert barriers.outcome("pair") == BarrierResolved("pair", None)  # other participants: kept
    barriers.arrive("waits", 0, PAIR, 60, 0.0, {})
    step(barriers, "after-waits", "waits")
    assert barriers.get("waits") is not None and barriers.get("waits").pending  # still pending: kept
    _, effects = barriers.arrive("waits", 1, PAIR, 60, 0.0, {})
    assert effects == [BarrierResolved("waits", None)]
    assert step(barriers, "after-nothing", "never-started") == [BarrierResolved("after-nothing", None)]


def test_a_step_cancelled_before_anyone_arrived_is_forgotten_by_the_next_one():
    barriers = Barriers()  # a vote's no: its caller cancels the round before the others arrive, then arrives
    assert barriers.cancel("s/0", 0, PAIR, "process 0") == (True, [])
    assert step(barriers, "s/0") == []  # the first arrival started it, cancelled
    assert isinstance(barriers.outcome("s/0").error, BarrierCancelled)
    assert step(barriers, "s/1", "s/0") == [BarrierResolved("s/1", None)]
    assert barriers.get("s/0") is None and barriers.early_cancels("s/0") == {}


def test_a_failed_timed_out_or_cancelled_step_forgets_nothing():
    barriers = Barriers()
    step(barriers, "s/0")
    barriers.arrive("s/1", 0, PAIR, 60, 0.0, {}, supersedes="s/0")
    assert [e.name for e in barriers.fail_including(1, "failed: its host is gone")] == ["s/1"]
    _, effects = barriers.arrive("s/2", 0, PAIR, 60, 0.0, {1: "failed: its host is gone"}, supersedes="s/0")
    assert isinstance(effects[0].error, BarrierFailed)
    barriers.arrive("s/3", 0, PAIR, 1, 0.0, {}, supersedes="s/0")
    assert isinstance(barriers.expire(5.0, str)[0].error, BarrierTimeout)
    barriers.arrive("s/4", 0, PAIR, 60, 0.0, {}, supersedes="s/0")
    assert isinstance(barriers.cancel("s/4", 1, frozenset(), "process 1")[1][0].error, BarrierCancelled)
    _, effects = barriers.arrive("s/0", 1, PAIR, 60, 6.0, {})  # a late caller of s/0
    assert barriers.outcome("s/0") == BarrierResolved("s/0", None) and effects == []


def test_a_bad_supersedes_is_invalid_names_the_value_and_changes_nothing():
    barriers = Barriers(Limits(barrier_name_bytes=16))
    step(barriers, "s/0")
    held = barriers.held
    with pytest.raises(InvalidArgument, match=r"supersedes 'x{17}' is 17 bytes long: expected at most 16 \(the "
                                              r"coordinator's --max-barrier-name-bytes\)"):
        barriers.arrive("s/1", 0, PAIR, 60, 0.0, {}, supersedes="x" * 17)
    with pytest.raises(InvalidArgument, match="barrier 's/1' names itself in supersedes: expected the barrier it "
                                              "follows"):
        barriers.arrive("s/1", 0, PAIR, 60, 0.0, {}, supersedes="s/1")
    assert barriers.get("s/1") is None and barriers.held == held
    barriers.arrive("s/1", 0, PAIR, 60, 0.0, {}, supersedes="s/0")
    with pytest.raises(InvalidArgument, match="barrier 's/1' was started superseding 's/0'; this call names ''"):
        barriers.arrive("s/1", 1, PAIR, 60, 0.0, {})
    assert barriers.get("s/1").arrived == {0} and barriers.get("s/0") is not None


def test_a_replay_of_the_journal_forgets_what_the_leader_forgot():
    s = published(2)
    for n in range(20):
        for uid in ("p0", "p1"):
            s.current.arrive(uid, series_name(n), frozenset(), 60, 1.0, supersedes=previous(n))
    raw = [journal.encode(e) for e in s.take_journal()]
    rebuilt = ClusterState(s.config)
    for r in raw:
        rebuilt.replay(journal.decode(r))
    for state in (s, rebuilt):
        assert [state.current.barriers.get(series_name(n)) is not None for n in range(20)] == [False] * 19 + [True]
    assert rebuilt.current.barriers.held == s.current.barriers.held
    old = journal.decode(b'{"type":"BarrierFinished","name":"b","participants":[0,1],"error_type":"","error":""}')
    assert old == journal.BarrierFinished("b", (0, 1), "", "")  # a journal written before the field still decodes


# Through a real coordinator.
def run_series(client: ifrt.Client, start: int, stop: int, process_ids: list[int] | None = None) -> None:
    for n in range(start, stop):
        client.barrier(series_name(n), timeout=60, process_ids=process_ids, supersedes=previous(n))


def test_a_series_of_200_steps_passes_under_max_barriers_8_and_a_late_caller_gets_its_result(start_coordinator):
    coordinator = start_coordinator("--max-barriers", "8", num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        results = together([c0, c1], lambda c: run_series(c, 0, 200, [0, 1]), timeout=120)
        assert results == [None, None]
        waiting = in_thread(lambda: c0.barrier("s/200", timeout=60, process_ids=[0, 1], supersedes="s/199"))
        barrier_started_for(coordinator.address, c0, "s/200")
        c1.barrier("s/199", timeout=10, process_ids=[0, 1], supersedes="s/198")  # late: s/200 has not completed
        c1.barrier("s/200", timeout=60, process_ids=[0, 1], supersedes="s/199")
        assert waiting.get(timeout=30) is None
        c1.barrier("s/200", timeout=60, process_ids=[0, 1], supersedes="s/199")  # the latest step still answers


def test_a_failed_or_cancelled_step_leaves_the_one_before_for_late_callers(start_coordinator):
    coordinator = start_coordinator("--max-barriers", "8", num_processes=2)
    c0, c1 = clients(coordinator.address, 2)
    with c0, c1:
        assert together([c0, c1], lambda c: run_series(c, 0, 5), timeout=60) == [None, None]
        with pytest.raises(ifrt.BarrierTimeout, match=r"barrier .s/5. timed out after .* did not arrive"):
            c0.barrier("s/5", timeout=0.5, supersedes="s/4")  # process 1 never comes: s/5 fails
        c1.barrier("s/4", timeout=10, supersedes="s/3")  # a late caller of s/4: its result is still there
        waiting = in_thread(lambda: c0.barrier("s/6", timeout=60, supersedes="s/4"))
        assert c1.cancel_barrier("s/6") is True
        assert isinstance(waiting.get(timeout=30), ifrt.BarrierCancelled)
        c1.barrier("s/4", timeout=10, supersedes="s/3")


def test_a_standby_that_takes_over_forgets_what_the_leader_forgot(etcd):
    with Replicas(etcd, "--max-barriers", "8", num_processes=2) as replicas:
        c0, c1 = clients(replicas.addresses, 2)
        with c0, c1:
            assert together([c0, c1], lambda c: run_series(c, 0, 20), timeout=60) == [None, None]
            replicas.kill_leader()
            results = together([c0, c1], lambda c: run_series(c, 20, 40), timeout=90)
            assert results == [None, None], results
