"""The runs of one job on a coordinator that outlives them, in the state machine without a network: a re-run starts
fresh, a live id is refused by name, a real restart takes its id back, a process that left waits for the next run,
no generation holds a process known to be gone, and a replay of the journal decides the same."""

import pytest

from coordinator.core import compaction, journal
from coordinator.core.cluster import FailurePolicy
from coordinator.core.effects import Evict, Published, Republish, RunEnded, RunStarted, Waiting, WaitingForNextRun
from coordinator.core.limits import Limits
from coordinator.core.state import ClusterState
from ifrt import wire
from ifrt.errors import ClusterMismatch, ProcessIdTaken, ResourceExhausted, UnknownClient
from tests.helpers import published, reg

KiB = 1 << 10


def register_all(s: ClusterState, prefix: str, n: int = 3, now: float = 10.0, **fields) -> list:
    """Registers processes ``<prefix>0..`` (hosts h0..) and returns their outcomes and effects."""
    return [s.register(reg(f"{prefix}{i}", i, host=f"h{i}", **fields), now) for i in range(n)]


def leave_all(s: ClusterState, prefix: str = "p", n: int = 3, now: float = 5.0) -> list:
    effects = []
    for i in range(n):
        effects += s.leave(f"{prefix}{i}", now)
    return effects


def test_after_every_process_left_the_next_registrations_start_a_fresh_run():
    s = published()
    s.current.keys.set("p0", "nccl/id", b"run-1", False)
    s.current.keys.set("agent", "torchrun/job/state", b"rendezvous", False)  # torchrun's agents: outside any run
    s.current.arrive("p0", "step", frozenset(), 60, 1.0)
    first = s.topology
    effects = leave_all(s)
    assert effects[-1] == RunEnded(1)  # the last departure ends the run: waiting registrations may start the next
    (o0, e0), (o1, e1), (o2, e2) = register_all(s, "q", devices=3)
    assert e0 == [RunStarted(1, 2)] and e1 == e2 == []
    assert o0 == Waiting(1, 3) and o1 == Waiting(2, 3)
    assert isinstance(o2, Published) and o2.first is not None  # generation 1 of run 2, formed by the new processes
    assert s.run == 2 and s.topology.generation == 1 and s.topology != first
    assert [len([d for d in s.topology.devices if d.process_id == i]) for i in range(3)] == [3, 3, 3]
    for i in range(3):
        s.current.attach(f"q{i}", 10.0)
    assert s.current.keys.get("q0", "nccl/id") is None  # nothing of run 1 is visible to run 2
    assert s.current.keys.get("q0", "torchrun/job/state") == b"rendezvous"  # but the agents' rendezvous goes on
    assert s.current.barrier_outcome("step") is None
    assert [e for e in s.take_journal() if isinstance(e, journal.RunStarted)] == [journal.RunStarted(2)]


def test_after_every_process_failed_the_next_registration_starts_a_new_run():
    s = published()
    for i in range(3):
        s.current.detach(f"p{i}", 1.0)
    effects = s.tick(2.0)
    assert RunEnded(1) in effects
    outcome, effects = s.register(reg("q0", 0, host="h0"), 3.0)
    assert effects == [RunStarted(1, 2)] and outcome == Waiting(1, 3)  # not a restart into the failed run


def test_a_live_process_keeps_its_id_and_the_newcomer_is_refused_by_name():
    s = published()
    before = (s.topology, s.current.report(1.0), s.take_journal())
    with pytest.raises(ProcessIdTaken, match=r"held by a live process on h1 \(10\.0\.0\.1\) since 2\.0s ago: is "
                                             r"another job using this coordinator\? give it its own --cluster-id "
                                             r"or coordinator"):
        s.register(reg("other-job", 1, host="h1"), 2.0)
    assert (s.topology, s.current.report(1.0), s.take_journal()) == (before[0], before[1], [])


def test_a_restart_of_a_dead_process_takes_its_id_back_in_the_same_run():
    s = published()
    s.current.detach("p1", 1.0)  # killed: its connection dropped, not declared failed yet
    outcome, effects = s.register(reg("p1-again", 1, host="h1"), 1.05)
    assert isinstance(outcome, Published) and outcome.process_id == 1 and s.run == 1
    assert not any(isinstance(e, RunStarted) for e in effects)


def test_a_process_that_left_waits_for_the_next_run_and_changes_nothing():
    s = published()
    s.leave("p1", 1.0)
    s.take_journal()
    before = (s.topology, s.current.report(2.0))
    outcome, effects = s.register(reg("p1-again", 1, host="h1"), 2.0)
    assert effects == [] and s.take_journal() == []
    assert outcome == WaitingForNextRun(1, 3, ("0 (h0 (10.0.0.1))", "2 (h2 (10.0.0.1))"), 2)
    assert "2 of its processes are still live: 0 (h0 (10.0.0.1)), 2 (h2 (10.0.0.1))" in outcome.describe()
    assert (s.topology, s.current.report(2.0)) == before
    with pytest.raises(UnknownClient):
        s.current.answer("p1-again", 2.0)  # nothing of it is held
    assert s.waiting_for_next_run() == outcome
    assert s.leave("p0", 3.0)[-1:] != [RunEnded(1)]
    assert s.leave("p2", 3.0)[-1] == RunEnded(1)
    assert s.waiting_for_next_run() is None
    outcome, effects = s.register(reg("p1-again", 1, host="h1"), 4.0)  # its long-poll registers again
    assert effects == [RunStarted(1, 2)] and outcome == Waiting(1, 3)


def test_in_a_finishing_run_a_restart_waits_for_the_next_run_too():
    s = published()
    s.leave("p2", 1.0)  # the run publishes no generation any more
    s.current.detach("p1", 1.0)
    s.tick(2.0)  # process 1 failed
    outcome, _ = s.register(reg("p1-again", 1, host="h1"), 3.0)
    assert isinstance(outcome, WaitingForNextRun) and outcome.still_live == ("0 (h0 (10.0.0.1))",)
    with pytest.raises(ProcessIdTaken, match="another job"):
        s.register(reg("impostor", 0, host="h0"), 3.0)  # process 0 is still live and attached


def test_no_restarted_process_gets_a_generation_holding_a_failed_one():
    s = published()
    for uid in ("p1", "p2"):
        s.current.detach(uid, 1.0)
    s.tick(2.0)  # both failed; the cluster keeps generation 1 (propagate)
    first, effects = s.register(reg("p1-again", 1, host="h1", devices=4), 3.0)
    assert first == Waiting(2, 3)  # process 2 is known to be gone: nothing is published yet
    assert not any(isinstance(e, Republish) for e in effects) and s.topology.generation == 1
    assert s.current.answer("p1-again", 3.5) == Waiting(2, 3)
    second, effects = s.register(reg("p2-again", 2, host="h2"), 4.0)
    assert isinstance(second, Published) and s.topology.generation == 2
    assert Republish(s.topology, s.published_at) in effects
    assert s.current.answer("p1-again", 4.0) == Published(1, s.topology)  # both get the one generation
    assert s.run == 1


def test_elastic_drops_a_process_that_left_and_its_id_waits_for_the_next_run():
    s = published(3, on_failure=FailurePolicy.ELASTIC, min_processes=2)
    s.leave("p2", 1.0)
    assert [p.process_id for p in s.topology.processes] == [0, 1]
    outcome, _ = s.register(reg("p2-again", 2, host="h2"), 2.0)
    assert isinstance(outcome, WaitingForNextRun) and outcome.live == 2
    s.current.detach("p1", 2.0)
    s.tick(3.0)  # process 1 failed; not dropped: 1 process would remain, fewer than --min-processes 2
    outcome, _ = s.register(reg("p1-again", 1, host="h1"), 4.0)
    assert isinstance(outcome, Published) and s.run == 1  # a failed process's restart still takes its id back


def test_a_refused_registration_does_not_start_the_next_run():
    s = published()
    leave_all(s)
    s.take_journal()
    with pytest.raises(ClusterMismatch, match="cluster 'elsewhere'"):
        s.register(reg("q0", 0, host="h0", cluster_id="elsewhere"), 6.0)
    assert s.run == 1 and s.take_journal() == [] and s.topology.generation == 1


def test_replaying_the_journal_of_two_runs_gives_the_same_state():
    s = published()
    s.current.keys.set("p0", "old", b"1", False)
    s.current.keys.set("agent", "torchrun/job/state", b"r", False)
    leave_all(s)
    register_all(s, "q", devices=1)
    for i in range(3):
        s.current.attach(f"q{i}", 10.0)
    s.current.keys.set("q0", "new", b"2", False)
    entries = s.take_journal()
    rebuilt, compacted = ClusterState(s.config), ClusterState(s.config)
    for raw in [journal.encode(e) for e in entries]:
        rebuilt.replay(journal.decode(raw))
    for entry, kept in zip(entries, compaction.needed(entries), strict=True):
        if kept:
            compacted.replay(entry)
    assert rebuilt.take_journal() == []
    assert rebuilt.run == compacted.run == s.run == 2
    assert wire.encode(rebuilt.topology) == wire.encode(compacted.topology) == wire.encode(s.topology)
    rebuilt.reset_liveness(11.0)
    compacted.reset_liveness(11.0)
    for state in (s, rebuilt, compacted):
        assert [state.current.keys.get("q0", k) for k in ("old", "new", "torchrun/job/state")] == [None, b"2", b"r"]
        assert state.register(reg("q1", 1, host="h1", devices=1), 12.0) == (Published(1, state.topology), [])


def test_a_restart_still_waiting_when_its_run_ends_starts_the_next_run():
    s = published()
    for uid in ("p1", "p2"):
        s.current.detach(uid, 1.0)
    s.tick(2.0)
    assert s.register(reg("p1-again", 1, host="h1"), 3.0)[0] == Waiting(2, 3)  # process 2 is gone: it waits
    s.current.detach("p0", 4.0)
    assert RunEnded(1) in s.tick(5.0)  # the last process that held a generation of run 1 failed
    outcome, effects = s.register(reg("p1-again", 1, host="h1"), 6.0)  # its long-poll, again
    assert effects == [RunStarted(1, 2)] and outcome == Waiting(1, 3) and s.run == 2


def test_compaction_drops_the_ended_runs_keys_but_the_agents():
    s = published()
    s.current.keys.set("p0", "nccl/id", b"run-1", False)
    s.current.keys.set("agent", "torchrun/job/state", b"r", False)
    leave_all(s)
    register_all(s, "q", devices=1)
    entries = s.take_journal()
    kept = dict(zip(range(len(entries)), compaction.needed(entries), strict=True))
    writes = {e.key: kept[i] for i, e in enumerate(entries) if isinstance(e, journal.KeySet)}
    assert writes == {"nccl/id": False, "torchrun/job/state": True}
    garbage = compaction.Garbage.of(entries, [len(journal.encode(e)) for e in entries], compacted=False)
    assert garbage.entries == 1  # run 1's key, counted toward the next compaction


def test_the_registrations_of_every_run_count_against_the_registration_budget():
    s = published(3, limits=Limits(registration_bytes=16 * KiB))
    leave_all(s)
    s.take_journal()
    runs_started = 0
    with pytest.raises(ResourceExhausted, match="--max-registration-bytes"):
        for i in range(100):  # each run journals its registrations for good (until a new attempt)
            for j in range(3):
                _, effects = s.register(reg(f"r{i}-{j}", j, host=f"h{j}", devices=8), 10.0)
                runs_started += effects.count(RunStarted(s.run - 1, s.run))
            leave_all(s, f"r{i}-")
    assert 0 < runs_started < 100 and s.current.admission.held <= 16 * KiB
    before = (s.run, s.topology, s.take_journal())
    with pytest.raises(ResourceExhausted):
        s.register(reg("late", 0, host="h0", devices=8), 11.0)
    assert (s.run, s.topology, s.take_journal()) == (before[0], before[1], [])  # refused: no run started


def test_a_process_that_stopped_answering_may_be_restarted_while_its_session_is_open():
    s = published()
    s.current.heard("p1", 1.0)  # a heartbeat: answering
    late = 1.0 + s.config.unanswered_after_s
    with pytest.raises(ProcessIdTaken, match="another job"):
        s.register(reg("p1-again", 1, host="h1"), late)  # not overdue yet: a live process
    outcome, effects = s.register(reg("p1-again", 1, host="h1"), late + 0.01)  # hung (SIGSTOP): overdue
    assert isinstance(outcome, Published) and outcome.process_id == 1 and s.run == 1
    assert Evict("p1", "replaced by a restarted process from h1 (10.0.0.1)") in effects
