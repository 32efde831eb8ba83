"""Barriers and votes belong to their participants: only a participant cancels a barrier (a stranger's cancel changes
nothing and is refused, naming the participants), a cancel before anyone arrived counts only if its canceller takes
part when the barrier starts (also across a failover), what one process holds alone (its cancels of unknown names,
the barriers nobody else arrived at) is at most its share of the job's barrier bounds, and a vote that cannot be held
says so in every voter."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ifrt
from coordinator.core import compaction, journal
from coordinator.core.barriers import ALWAYS_HELD, BarrierResolved, Barriers
from coordinator.core.limits import BARRIER_OVERHEAD_BYTES, PARTICIPANT_BYTES, Limits
from coordinator.core.state import ClusterState
from ifrt.errors import BarrierCancelled, IfrtError, PermissionDenied, ResourceExhausted
from tests.helpers import barrier_started_for, clients, in_thread, published, together
from tests.replicas import Replicas

PAIR = frozenset({0, 1})
KiB = 1024


def alone_cost(name: str, participants: int, supersedes: str = "") -> int:
    """What a barrier held alone counts against its holder's share (its set of participants counted as its own)."""
    return (3 * len(name) + 2 * len(supersedes) + BARRIER_OVERHEAD_BYTES + 8 * participants
            + PARTICIPANT_BYTES * participants)


def votes(client: ifrt.Client, scope: str, ballots: list[bool]) -> list[bool]:
    """The answers of a vote of processes 0 and 1 under ``scope``, one round per ballot."""
    vote = ifrt.Vote(client, scope, [0, 1], timeout=30)
    return [vote(ok) for ok in ballots]


# The pure state.
def test_an_early_cancel_counts_only_if_its_canceller_takes_part_and_a_stranger_is_refused_naming_the_participants():
    barriers = Barriers(processes=3)
    assert barriers.cancel("pair", 2, frozenset(), "process 2") == (True, [])  # not named: kept for process 2
    assert barriers.cancel("pair", 2, frozenset(), "process 2") == (False, [])  # once
    barriers.arrive("pair", 0, PAIR, 60, 0.0, {})
    assert barriers.early_cancels("pair") == {} and barriers.outcome("pair") is None  # dropped: 2 takes no part
    held = barriers.held
    with pytest.raises(PermissionDenied, match=r"^process 2 may not cancel barrier 'pair': only its participants "
                                               r"may \(processes \[0, 1\]\)$"):
        barriers.cancel("pair", 2, frozenset(), "process 2")
    with pytest.raises(PermissionDenied, match=r"processes \[0, 1\]"):
        barriers.cancel("later", 2, PAIR, "process 2")  # named participants that leave the caller out
    assert barriers.held == held and barriers.early_cancels("later") == {}
    assert barriers.cancel("later", 1, frozenset(), "process 1") == (True, [])
    _, effects = barriers.arrive("later", 0, PAIR, 60, 0.0, {})
    assert [str(e.error) for e in effects] == ["barrier 'later' was cancelled by process 1"]


def test_a_journaled_early_cancel_replays_for_its_canceller_and_an_old_one_for_anyone():
    entry = journal.BarrierFinished("v/0", (), "BarrierCancelled", "barrier 'v/0' was cancelled by process 2",
                                    canceller=2)
    assert journal.decode(journal.encode(entry)) == entry
    old = journal.decode(b'{"type":"BarrierFinished","name":"v/1","participants":[],"error_type":"BarrierCancelled",'
                         b'"error":"barrier \'v/1\' was cancelled by process 0"}')
    assert old.canceller is None  # a journal written before cancels named their canceller
    barriers = Barriers()
    for e in (entry, old):
        barriers.restore(e.name, frozenset(e.participants), journal.error_of(e.error_type, e.error), e.forgot,
                         e.canceller)
    barriers.arrive("v/0", 0, PAIR, 60, 0.0, {})
    assert barriers.outcome("v/0") is None  # process 2 takes no part
    _, effects = barriers.arrive("v/1", 0, PAIR, 60, 0.0, {})
    assert isinstance(effects[0].error, BarrierCancelled)


def test_one_processes_early_cancels_hold_at_most_its_share_and_only_it_is_refused():
    barriers = Barriers(Limits(barrier_bytes=64 * KiB), processes=4)
    name = "x" * 1000
    kept = 0
    with pytest.raises(ResourceExhausted) as info:
        for i in range(100):
            barriers.cancel(f"{i}/{name}", 3, frozenset(), "process 3")
            kept += 1
    assert kept == 16 * KiB // (3 * 1002 + 1024)
    assert str(info.value).startswith(f"keeping process 3's cancel of barrier '{kept}/xxx")
    assert ("(4030 bytes), which nobody arrived at yet, would pass process 3's share of the coordinator's bounds on "
            "what one process holds alone (the barriers only it arrived at, its cancels of barriers nobody arrived "
            "at): 262144 of them and 16384 bytes a process (--max-barriers 1048576 and --max-barrier-bytes 65536 over "
            "--num-processes 4); it holds 4 (16120 bytes): cancel only barriers" in str(info.value))
    assert barriers.cancel(f"0/{name}", 0, frozenset(), "process 0") == (True, [])  # another process still may


def test_a_barrier_only_its_starter_arrived_at_is_in_its_share_until_a_second_participant_arrives_or_it_goes():
    barriers = Barriers(processes=3)
    barriers.arrive("mine/0", 2, frozenset({2}), 60, 0.0, {})  # completes at once, kept to answer late arrivals
    assert barriers.holder("mine/0") == 2 and barriers.held_alone(2) == (1, alone_cost("mine/0", 1))
    barriers.arrive("pair", 2, frozenset({0, 2}), 0.01, 0.0, {})
    assert barriers.held_alone(2) == (2, alone_cost("mine/0", 1) + alone_cost("pair", 2))  # pending: its too
    barriers.expire(1.0, str)  # failed with only its starter arrived
    assert barriers.holder("pair") == 2
    barriers.arrive("pair", 0, frozenset({0, 2}), 60, 2.0, {})  # a second participant hears the result: shared
    assert barriers.holder("pair") is None and barriers.held_alone(2) == (1, alone_cost("mine/0", 1))
    assert barriers.held_alone(0) == (0, 0)
    barriers.arrive("mine/1", 2, frozenset({2}), 60, 3.0, {}, supersedes="mine/0")  # forgets the one before
    assert barriers.get("mine/0") is None
    assert barriers.held_alone(2) == (1, alone_cost("mine/1", 1, supersedes="mine/0"))
    barriers.cancel("v/0", 1, PAIR, "process 1")  # a voter's no before anyone arrived: its own
    barriers.arrive("v/0", 0, PAIR, 60, 4.0, {})  # ... dropped as 0 starts the round, which fails at once: 0's
    assert barriers.holder("v/0") == 0 and barriers.held_alone(1) == (0, 0)
    barriers.arrive("v/0", 1, PAIR, 60, 4.0, {})
    assert barriers.holder("v/0") is None and barriers.held_alone(0) == (0, 0)


def test_past_its_share_only_the_process_holding_barriers_alone_is_refused_and_it_may_still_join_others():
    barriers = Barriers(Limits(barrier_bytes=128 * KiB), processes=4)
    name = "x" * 1000
    cost = alone_cost(f"0/{name}", 1)
    kept = 0
    with pytest.raises(ResourceExhausted) as info:
        for i in range(100):
            barriers.arrive(f"{i}/{name}", 3, frozenset({3}), 60, 0.0, {})
            kept += 1
    assert kept == 32 * KiB // cost > ALWAYS_HELD
    assert str(info.value).startswith(f"starting barrier '{kept}/xxx")
    assert (f"({cost} bytes), which only process 3 arrived at yet, would pass process 3's share of the coordinator's "
            f"bounds on what one process holds alone (the barriers only it arrived at, its cancels of barriers nobody "
            f"arrived at): 262144 of them and 32768 bytes a process (--max-barriers 1048576 and --max-barrier-bytes "
            f"131072 over --num-processes 4); it holds {kept} ({kept * cost} bytes): a barrier leaves this share once "
            f"another participant arrives at it" in str(info.value))
    with pytest.raises(ResourceExhausted, match="process 3's share"):
        barriers.arrive(f"with-0/{name}", 3, frozenset({0, 3}), 60, 0.0, {})  # nobody else arrived: still its own
    with pytest.raises(ResourceExhausted, match="process 3's share"):
        barriers.cancel(f"unknown/{name}", 3, frozenset(), "process 3")
    barriers.arrive("started-by-0", 0, frozenset({0, 3}), 60, 0.0, {})
    _, effects = barriers.arrive("started-by-0", 3, frozenset({0, 3}), 60, 0.0, {})  # it may join others' barriers
    assert effects == [BarrierResolved("started-by-0", None)]
    barriers.arrive(f"0/{name}", 3, frozenset({3}), 60, 0.0, {})  # arriving again at its own changes nothing


def test_barriers_every_participant_arrives_at_are_never_refused_by_a_share_at_any_job_size():
    n = 4096  # a share of the default --max-barrier-bytes is 16 KiB; one barrier of every process costs 320 KiB
    everyone = frozenset(range(n))
    barriers = Barriers(processes=n)
    assert alone_cost("step/0", n) > barriers.limits.barrier_bytes // n
    for step in range(3):  # a per-step series: every process arrives
        for p in range(n):
            barriers.arrive(f"step/{step}", p, everyone, 60, 0.0, {}, supersedes=f"step/{step - 1}" if step else "")
    assert barriers.outcome("step/2") is not None and barriers.get("step/0") is None
    for r in range(ALWAYS_HELD):  # a voter says no in rounds the others have not reached yet
        barriers.cancel(f"v/{r}", 0, everyone, "process 0")
        barriers.arrive(f"v/{r}", 0, everyone, 60, 0.0, {}, supersedes=f"v/{r - 1}" if r else "")
    for r in range(ALWAYS_HELD + 1):
        for p in range(1, n):
            barriers.arrive(f"v/{r}", p, everyone, 60, 0.0, {}, supersedes=f"v/{r - 1}" if r else "")
    barriers.arrive(f"v/{ALWAYS_HELD}", 0, everyone, 60, 0.0, {}, supersedes=f"v/{ALWAYS_HELD - 1}")
    assert barriers.outcome(f"v/{ALWAYS_HELD}") == BarrierResolved(f"v/{ALWAYS_HELD}", None)
    assert all(barriers.held_alone(p) == (0, 0) for p in range(n))


owner_steps = st.lists(st.tuples(st.sampled_from(["alone", "timeout", "late", "no", "yes"]), st.integers(0, 4),
                                 st.booleans()), max_size=40)
"""Barriers held alone and shared: (what, n, whether it supersedes the one numbered n - 1). ``alone``: process 2's
barrier of itself; ``timeout``: process 2's barrier of {0, 2} that times out; ``late``: process 0 arriving at it
(or starting it); ``no``/``yes``: a round of a vote of {0, 1} that process 1 cancels / both arrive at."""


def _script_journal(script) -> tuple[ClusterState, list[journal.Entry]]:
    """Plays ``script`` on a live cluster of 3 processes; returns it and its journal after the registrations."""
    s = published(n=3, limits=Limits(barrier_bytes=16 * KiB))
    now = 0.0
    for what, n, supersedes in script:
        now += 0.01
        kind = {"alone": "a", "no": "v", "yes": "v"}.get(what, "t")
        name, previous = f"{kind}/{n}", f"{kind}/{n - 1}" if supersedes and n else ""
        try:
            match what:
                case "alone":
                    s.current.arrive("p2", name, frozenset({2}), 60, now, supersedes=previous)
                case "timeout" | "late":
                    s.current.arrive("p2" if what == "timeout" else "p0", name, frozenset({0, 2}), 0.001, now,
                                     supersedes=previous)
                    s.tick(now + 0.002)
                case "no":
                    s.current.cancel_barrier("p1", name, now, process_ids=PAIR)
                    s.current.arrive("p1", name, PAIR, 60, now, supersedes=previous)
                case "yes":
                    for uid in ("p0", "p1"):
                        s.current.arrive(uid, name, PAIR, 60, now, supersedes=previous)
        except IfrtError:
            pass
    return s, [e for e in s.take_journal() if not isinstance(e, journal.Registered)]


def _replayed(entries: list[journal.Entry]) -> ClusterState:
    fresh = published(n=3, limits=Limits(barrier_bytes=16 * KiB))
    state = ClusterState(fresh.config)
    for entry in [*fresh.take_journal(), *entries]:
        state.replay(journal.decode(journal.encode(entry)))
    return state


def _held(state: ClusterState):
    barriers = state.current.barriers
    names = [f"{k}/{n}" for k in "atv" for n in range(5)]
    return ([barriers.held_alone(p) for p in range(3)], {n: barriers.holder(n) for n in names}, barriers.held,
            {n: o and str(o.error) for n in names if (o := barriers.outcome(n)) is not None})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=owner_steps, cut=st.floats(0, 1))
def test_a_replay_whole_or_compacted_gives_each_process_back_what_it_held_alone(script, cut):
    s, entries = _script_journal(script)
    keep = compaction.needed(entries)
    whole = [e for e, k in zip(entries, keep, strict=True) if k]
    p = int(cut * len(entries))
    part = [e for e, k in zip(entries[:p], keep[:p], strict=True) if k] + entries[p:]
    expected = _held(s)
    assert _held(_replayed(entries)) == expected == _held(_replayed(whole)) == _held(_replayed(part))
    assert compaction.Garbage.of(entries, [1] * len(entries), compacted=False).entries == len(entries) - len(whole)


def test_a_journal_written_before_barriers_were_held_replays_them_as_shared():
    old = journal.decode(b'{"type":"BarrierFinished","name":"mine","participants":[2],"error_type":"","error":""}')
    assert old.held_by is None
    entry = journal.BarrierFinished("mine", (2,), "", "", held_by=2)
    assert journal.decode(journal.encode(entry)) == entry
    assert journal.decode(journal.encode(journal.BarrierJoined("t", 0))) == journal.BarrierJoined("t", 0)
    barriers = Barriers(processes=3)
    barriers.restore(old.name, frozenset(old.participants), None, held_by=old.held_by)
    assert barriers.held_alone(2) == (0, 0)


# Real coordinators.
def test_a_non_participant_cannot_cancel_a_started_barrier_and_the_barrier_completes(start_coordinator):
    coordinator = start_coordinator(num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        waiting = in_thread(lambda: c0.barrier("pair", timeout=60, process_ids=[0, 1]))
        barrier_started_for(coordinator.address, c0, "pair")
        with pytest.raises(ifrt.PermissionDenied, match=r"process 2 may not cancel barrier 'pair': only its "
                                                        r"participants may \(processes \[0, 1\]\)"):
            c2.cancel_barrier("pair")
        c1.barrier("pair", timeout=60, process_ids=[0, 1])
        assert waiting.get(timeout=30) is None  # completed: the stranger's cancel changed nothing
        with pytest.raises(ifrt.PermissionDenied, match=r"processes \[0, 1\]"):
            c2.cancel_barrier("pair")  # finished or not, it is not process 2's
        assert c1.cancel_barrier("pair") is False  # a participant's: its result stands


def test_a_non_voter_cannot_pre_cancel_the_rounds_of_a_vote_and_a_voters_no_names_it(start_coordinator):
    coordinator = start_coordinator(num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        for r in range(10):
            assert c2.cancel_barrier(f"v/vote/{r}") is True  # kept for process 2, which takes no part
        assert together([c0, c1], lambda c: votes(c, "v", [True] * 10)) == [[True] * 10] * 2
        with pytest.raises(ifrt.PermissionDenied, match=r"process 2 may not cancel barrier 'v/vote/10': only its "
                                                        r"participants may \(processes \[0, 1\]\)"):
            c2.cancel_barrier("v/vote/10", process_ids=[0, 1])

        def ballot(p: int) -> tuple[bool, str]:
            vote = ifrt.Vote([c0, c1][p], "w", [0, 1], timeout=30)
            return vote(p != 0), vote.why

        answers = together([0, 1], ballot)
        assert [ok for ok, _ in answers] == [False, False]  # a voter's no: False in every voter, naming it
        assert all("barrier 'w/vote/0' was cancelled by process 0 (" in why for _, why in answers), answers


def test_one_process_flooding_cancels_of_unknown_names_spends_only_its_share(start_coordinator):
    # 16,501 cancels of made-up 1 KB names filled --max-barrier-bytes; then every new barrier was refused.
    coordinator = start_coordinator("--max-barrier-bytes", str(96 * KiB), num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        refused = []
        for i in range(200):
            try:
                c2.cancel_barrier(f"made-up/{i}/" + "b" * 1000)
            except ResourceExhausted as e:
                refused.append(str(e))
        assert len(refused) == 200 - 32 * KiB // (3 * len("made-up/0/" + "b" * 1000) + 1024), refused[:1]
        assert "would pass process 2's share of the coordinator's bounds" in refused[0]
        assert "--max-barrier-bytes 98304 over --num-processes 3" in refused[0]
        together([c0, c1], lambda c: c.barrier("after", timeout=30, process_ids=[0, 1]))
        assert together([c0, c1], lambda c: votes(c, "v", [True, True, False])) == [[True, True, False]] * 2


def test_a_vote_the_coordinator_cannot_keep_says_so_in_every_voter(start_coordinator):
    coordinator = start_coordinator("--max-barrier-bytes", str(64 * KiB), num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        for i in range(200):  # barriers every process completed fill the job's budget (each smaller than a round)
            if any(isinstance(r, ResourceExhausted) for r in together(
                    [c0, c1, c2], lambda c, i=i: c.barrier(f"fill/{i}", timeout=30))):
                break
        errors = together([c0, c1], lambda c: votes(c, "v", [True]))
        for e in errors:
            assert isinstance(e, ResourceExhausted), errors
            assert str(e).startswith("vote 'v' round 0 of processes [0, 1] cannot be held, so it has no answer: "
                                     "coordinator "), e
            assert "keeping barrier 'v/vote/0' (1208 bytes) would pass the coordinator's --max-barrier-bytes" in str(e)


def test_early_cancels_survive_a_failover_for_their_canceller_only(etcd):
    with Replicas(etcd, num_processes=3) as replicas:
        c0, c1, c2 = clients(replicas.addresses, 3)
        with c0, c1, c2:
            assert c0.cancel_barrier("v/vote/0") is True  # a voter's no, answered ...
            assert c2.cancel_barrier("v/vote/1") is True  # ... and a stranger's
            replicas.kill_leader()  # before anyone arrived
            assert together([c0, c1], lambda c: votes(c, "v", [True, True]), timeout=90) == [[False, True]] * 2


def flood(client: ifrt.Client, names: list[str], process_ids: list[int], timeout: float) -> list[str]:
    """``client`` starts a barrier of each name; returns the ResourceExhausted messages of those refused."""
    refused = []
    for name in names:
        try:
            client.barrier(name, timeout=timeout, process_ids=process_ids)
        except ResourceExhausted as e:
            refused.append(str(e))
        except ifrt.BarrierTimeout:
            pass
    return refused


def test_one_process_flooding_barriers_of_itself_spends_only_its_share(start_coordinator):
    coordinator = start_coordinator("--max-barrier-bytes", str(96 * KiB), num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        names = [f"mine/{i}/" + "b" * 1000 for i in range(200)]  # each completes at once and is kept
        refused = flood(c2, names, [2], timeout=30)
        assert together([c0, c1], lambda c: c.barrier("after", timeout=30, process_ids=[0, 1])) == [None, None]
        assert together([c0, c1], lambda c: votes(c, "v", [True, True, False])) == [[True, True, False]] * 2
        assert len(refused) == 200 - 32 * KiB // alone_cost(names[0], 1), refused[:1]
        assert "which only process 2 arrived at yet, would pass process 2's share" in refused[0]
        assert "--max-barrier-bytes 98304 over --num-processes 3" in refused[0]


def test_one_process_flooding_barriers_that_time_out_at_once_spends_only_its_share(start_coordinator):
    coordinator = start_coordinator("--max-barrier-bytes", str(96 * KiB), num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        names = [f"gone/{i}/" + "b" * 1000 for i in range(200)]  # process 0 never arrives: each fails, kept
        refused = flood(c2, names, [0, 2], timeout=0.01)
        assert together([c0, c1], lambda c: c.barrier("after", timeout=30, process_ids=[0, 1])) == [None, None]
        assert together([c0, c1], lambda c: votes(c, "v", [True, False])) == [[True, False]] * 2
        assert len(refused) == 200 - 32 * KiB // alone_cost(names[0], 2), refused[:1]
        assert "would pass process 2's share" in refused[0] and "--num-processes 3" in refused[0]
        with pytest.raises(ifrt.BarrierTimeout):
            c0.barrier(names[0], timeout=30, process_ids=[0, 2])  # a second participant: no longer 2's alone ...
        assert flood(c2, [names[-1]], [0, 2], timeout=0.01) == []  # ... so it has room for one more


def test_a_failover_gives_each_process_back_what_it_held_alone(etcd):
    with Replicas(etcd, "--max-barrier-bytes", str(96 * KiB), num_processes=3) as replicas:
        c0, c1, c2 = clients(replicas.addresses, 3)
        with c0, c1, c2:
            names = [f"gone/{i}/" + "b" * 1000 for i in range(12)]
            kept = 12 - len(flood(c2, names, [0, 2], timeout=0.01))
            time.sleep(1)  # each has timed out, and is journaled, held by process 2
            with pytest.raises(ifrt.BarrierTimeout):
                c0.barrier(names[0], timeout=30, process_ids=[0, 2])  # shared from now on, journaled too
            replicas.kill_leader()
            assert flood(c2, [names[kept]], [0, 2], timeout=0.01) == []  # the room process 0's arrival made
            assert len(flood(c2, [names[kept + 1]], [0, 2], timeout=0.01)) == 1  # and no more
            assert together([c0, c1], lambda c: c.barrier("after", timeout=30, process_ids=[0, 1]),
                            timeout=90) == [None, None]
