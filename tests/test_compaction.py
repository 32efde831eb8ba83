"""The journal keeps what replay needs, not every write: a compacted journal (whole, or only its oldest part)
replays to the same state, and a coordinator's memory and etcd's journal stay bounded under overwrites."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ifrt
from coordinator.core import compaction, journal
from coordinator.core.effects import KeyChanged
from coordinator.core.limits import DEFAULT_LIMITS, Limits
from coordinator.core.retries import record_cost
from coordinator.core.state import ClusterState
from coordinator.replica import Replica
from coordinator.store import EtcdStore, MemoryStore
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError
from tests.helpers import clients, in_thread, published
from tests.replicas import Replicas
from tests.resources import rss_bytes

MiB = 1 << 20
KEYS = ["a", "ab", "abc", "b", "ba"]  # prefixes of each other, for prefix deletions
UIDS = ["p0", "p1"]
SMALL = Limits(answers_per_caller=8, answer_bytes=8 * 700)
"""Bounds that forget answers within a script: a caller's 9th call, and about the 9th call of all."""
REQUESTS = 24  # more request ids than SMALL lets a client's answers be remembered: some are forgotten

ops = st.lists(st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), st.binary(max_size=3)),
    st.tuples(st.just("incr"), st.sampled_from(KEYS), st.integers(-3, 3), st.sampled_from(UIDS),
              st.integers(0, REQUESTS)),
    st.tuples(st.just("swap"), st.sampled_from(KEYS), st.binary(max_size=1), st.binary(min_size=1, max_size=1),
              st.sampled_from(UIDS), st.integers(0, REQUESTS)),
    st.tuples(st.just("del"), st.sampled_from(KEYS), st.booleans()),
), max_size=400)


def play(s: ClusterState, script) -> None:
    """Runs the calls of ``script`` against a live cluster; a refused call (a non-integer incremented) is skipped,
    as it changes nothing."""
    for op in script:
        try:
            match op:
                case ("set", key, value):
                    s.current.keys.set("p0", key, value, True)
                case ("incr", key, amount, uid, request):
                    s.current.keys.increment(uid, key, amount, _request_id(request))
                case ("swap", key, expected, desired, uid, request):
                    s.current.keys.compare_set(uid, key, expected, desired, _request_id(request))
                case ("del", key, prefix):
                    s.current.keys.delete("p1", key, prefix)
        except IfrtError:
            pass


def _request_id(request: int) -> str:
    """Ordered request ids (1, 2, ...) and, for 0, one that is not ordered: a caller's forgotten calls are refused
    by number, or once one unordered call is forgotten, every unordered one not remembered."""
    return str(request) if request else "r0"


def replayed(entries, limits: Limits = DEFAULT_LIMITS) -> ClusterState:
    """A new replica's state: the two processes' registrations, then ``entries``."""
    s = published(n=2, limits=limits)
    fresh = ClusterState(s.config)
    for entry in [*s.take_journal(), *entries]:
        fresh.replay(entry)
    return fresh


def observable(s: ClusterState):
    """What replay must rebuild: the topology, every key's value, and what a retry of each call is answered."""
    retries = s.current.kv.retries
    return (s.topology, s.current.kv.dir(""), {uid: list(done.items()) for uid, done in retries.answers.items()},
            retries.calls(), retries.held, s.current.kv.store.held, dict(retries.records))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=ops, cut=st.floats(0, 1), small=st.booleans())
def test_a_compacted_journal_replays_to_the_same_state_whole_or_in_part(script, cut, small):
    limits = SMALL if small else DEFAULT_LIMITS
    s = published(n=2, limits=limits)
    play(s, script)
    entries = kv_entries(s)
    keep = compaction.needed(entries, limits)
    whole = [e for e, k in zip(entries, keep, strict=True) if k]
    p = int(cut * len(entries))  # a store that compacts oldest first may stop anywhere
    part = [e for e, k in zip(entries[:p], keep[:p], strict=True) if k] + entries[p:]
    expected = observable(replayed(entries, limits))
    assert observable(replayed(whole, limits)) == expected
    assert observable(replayed(part, limits)) == expected
    again = compaction.needed(whole, limits)  # compacting a compacted journal drops nothing more that matters
    assert observable(replayed([e for e, k in zip(whole, again, strict=True) if k], limits)) == expected


barrier_steps = st.lists(st.tuples(st.integers(0, 6), st.booleans(), st.booleans()), max_size=60)
"""Barriers of a series ``s/<n>`` (names used again: a forgotten one may come back): (n, whether it supersedes
``s/<n-1>``, whether it is cancelled instead of completing)."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=barrier_steps, cut=st.floats(0, 1))
def test_barriers_a_series_forgot_go_from_the_journal_and_replay_the_same(script, cut):
    s = published(n=2)
    for n, supersedes, cancelled in script:
        name, previous = f"s/{n}", f"s/{n - 1}" if supersedes and n else ""
        try:
            if cancelled:
                s.current.cancel_barrier(UIDS[0], name, 0.0)
            else:
                for uid in UIDS:
                    s.current.arrive(uid, name, frozenset(), 60.0, 0.0, supersedes=previous)
        except IfrtError:
            pass

    def seen(state: ClusterState):
        outcomes = {n: state.current.barrier_outcome(f"s/{n}") for n in range(7)}
        return {n: o and (type(o.error), str(o.error)) for n, o in outcomes.items()}, state.current.barriers.held

    entries = kv_entries(s)
    whole = kept(entries)
    p = int(cut * len(entries))
    part = [e for e, k in zip(entries[:p], compaction.needed(entries)[:p], strict=True) if k] + entries[p:]
    expected = seen(replayed(entries))
    assert seen(replayed(whole)) == expected == seen(replayed(part)) == seen(s)
    assert compaction.Garbage.of(entries, [1] * len(entries), compacted=False).entries == len(entries) - len(whole)


def test_a_long_series_of_barriers_compacts_to_its_last():
    s = published(n=2)
    for n in range(100):
        for uid in UIDS:
            s.current.arrive(uid, f"s/{n}", frozenset(), 60.0, 0.0, supersedes=f"s/{n - 1}" if n else "")
    entries = kv_entries(s)
    assert [e.name for e in kept(entries)] == ["s/99"]
    assert compaction.Garbage.of(entries, [1] * len(entries), compacted=False).entries == 99


swaps_of_any_size = st.lists(st.one_of(
    st.tuples(st.just("incr"), st.sampled_from(KEYS), st.integers(-3, 3), st.sampled_from(UIDS),
              st.integers(0, REQUESTS)),
    st.tuples(st.just("swap"), st.sampled_from(KEYS), st.binary(max_size=1), st.binary(min_size=1, max_size=3000),
              st.sampled_from(UIDS), st.integers(0, REQUESTS)),
    st.tuples(st.just("del"), st.sampled_from(KEYS), st.booleans()),
), max_size=200)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=swaps_of_any_size, cut=st.floats(0, 1), budget=st.integers(300, 12_000), per_caller=st.integers(1, 10))
def test_answers_of_any_cost_are_remembered_the_same_after_a_compaction(script, cut, budget, per_caller):
    # The calls remembered are the newest whose costs fit: compaction keeps them and the newest call forgotten
    # before them, so that a replay, whole or in part, forgets exactly what the coordinator forgot.
    limits = Limits(answer_bytes=budget, answers_per_caller=per_caller)
    s = published(n=2, limits=limits)
    play(s, script)
    entries = kv_entries(s)
    keep = compaction.needed(entries, limits)
    whole = [e for e, k in zip(entries, keep, strict=True) if k]
    p = int(cut * len(entries))
    part = [e for e, k in zip(entries[:p], keep[:p], strict=True) if k] + entries[p:]
    expected = observable(replayed(entries, limits))
    assert observable(replayed(whole, limits)) == expected
    assert observable(replayed(part, limits)) == expected
    assert s.current.kv.retries.held <= budget or len(s.current.kv.retries.calls()) == 1


def kv_entries(s: ClusterState) -> list[journal.Entry]:
    return [e for e in s.take_journal() if not isinstance(e, journal.Registered)]


def kept(entries, limits: Limits = DEFAULT_LIMITS) -> list[journal.Entry]:
    return [e for e, k in zip(entries, compaction.needed(entries, limits), strict=True) if k]


def test_overwrites_of_a_key_keep_only_the_last():
    s = published(n=2)
    for i in range(1000):
        s.current.keys.set("p0", "k", str(i).encode(), True)
    assert kept(kv_entries(s)) == [journal.KeySet("k", b"999")]


def test_a_replaced_process_or_a_lost_host_taken_over_keeps_the_attempts_key_values():
    entries = [journal.KeySet("k", b"v"),
               journal.AttemptDecided(0, 1, "h1", "exit code 3", False, "r1", replace=True),
               journal.HostTakenOver(0, "agent-b", "agent-c", (2, 3), "hb", "host hb lost", False)]
    assert kept(entries) == entries  # the attempt goes on: its key-values too


def test_deleted_keys_leave_nothing():
    s = published(n=2)
    for key in ("job/a", "job/b", "other"):
        s.current.keys.set("p0", key, b"v", False)
    s.current.keys.delete("p0", "job/", True)
    s.current.keys.delete("p0", "other", False)
    assert kept(kv_entries(s)) == []


def test_increments_keep_the_answers_a_retry_may_ask_for_within_the_answer_bytes():
    # 100 increments' answers (caller p0, request ids of 4 digits, key n) and p0's record of what it forgot
    limits = Limits(answer_bytes=100 * (256 + len("p01000n")) + record_cost("p0"))
    s = published(n=2, limits=limits)
    for i in range(1000, 1300):
        s.current.keys.increment("p0", "n", 1, str(i))
    entries = kept(kv_entries(s), limits)
    # The last 100 calls, the newest call forgotten before them (so that a replay forgets what came before) and the
    # newest record of what p0 forgot (its calls up to 1199), which a replay no longer finds in the calls
    calls = [e.request_id for e in entries if isinstance(e, journal.KeyIncremented)]
    assert calls == [str(i) for i in range(1199, 1300)]
    records = [e for e in entries if isinstance(e, journal.AnswersForgotten)]
    assert records == [journal.AnswersForgotten("p0", 1199, False)]
    again = replayed(entries, limits)
    assert again.current.keys.increment("p0", "n", 1, "1299") == (300, [])  # answered, not applied again
    with pytest.raises(ifrt.InvalidArgument, match="was answered before this client's last 64 calls"):
        again.current.keys.increment("p0", "n", 1, "1235")  # remembered as a call, its answer forgotten: refused
    # forgotten, by the bytes: refused too, never applied twice
    for forgotten in ("1000", "1199"):
        with pytest.raises(ifrt.InvalidArgument, match="the answers of this client's calls up to request_id 1199 "
                                                       "were pushed out of the coordinator's --max-answer-bytes"):
            again.current.keys.increment("p0", "n", 1, forgotten)
    assert again.current.keys.get("p1", "n") == b"300"
    assert again.current.keys.increment("p0", "n", 1, "1300") == (301, [KeyChanged("n", b"301")])  # a new call


def test_swaps_of_big_values_deleted_at_once_leave_at_most_the_answer_bytes_in_the_journal():
    # 1,500 swaps of 1 MiB values, each key deleted right after, left 1,500 MiB in the journal (64 answers kept for
    # every caller id): the answers kept now are those within --max-answer-bytes.
    limits = Limits(answer_bytes=8 * MiB)
    s = published(n=2, limits=limits)
    value = b"v" * (MiB // 4)
    for i in range(200):
        s.current.keys.compare_set(f"agent-{i}", f"torchrun/{i}", b"", value, "r1")
        s.current.keys.delete("p0", f"torchrun/{i}", False)
    everything = kv_entries(s)
    entries = kept(everything, limits)
    stored = sum(len(e.value) for e in entries if isinstance(e, journal.KeySwapped))
    assert 7 * MiB < stored <= 8 * MiB + len(value)
    assert s.current.kv.retries.held <= limits.answer_bytes
    assert observable(replayed(entries, limits)) == observable(replayed(everything, limits))


def test_a_set_or_deletion_a_retry_may_ask_about_stays_after_later_writes():
    s = published(n=2)
    s.current.keys.set("p0", "k", b"A", True, "set-1")
    s.current.keys.set("p1", "k", b"B", True)  # supersedes the value, not the answer
    s.current.keys.set("p1", "gone", b"x", True)
    s.current.keys.delete("p0", "gone", False, "del-1")
    entries = kept(kv_entries(s))
    assert entries == [journal.KeySet("k", b"A", "p0", "set-1"), journal.KeySet("k", b"B"),
                       journal.KeysDeleted("gone", False, "p0", "del-1", 1)]
    rebuilt = replayed(entries)
    assert rebuilt.current.keys.set("p0", "k", b"A", True, "set-1") == []  # answered: B stays
    assert rebuilt.current.keys.get("p1", "k") == b"B"
    assert rebuilt.current.keys.delete("p0", "gone", False, "del-1") == (1, [])


def test_a_deletion_stays_while_it_removes_a_remembered_swap():
    s = published(n=2)
    s.current.keys.compare_set("p0", "k", b"", b"A", "swap-1")
    s.current.keys.delete("p1", "k", False)
    entries = kept(kv_entries(s))
    assert entries == [journal.KeySwapped("k", b"A", "p0", "swap-1"), journal.KeysDeleted("k", False)]
    assert replayed(entries).current.kv.dir("") == []


def test_compaction_is_due_once_superseded_bytes_reach_the_minimum_and_then_the_journal_size():
    garbage = compaction.Garbage()
    overwrites = 0
    while not garbage.due():
        garbage.observe(journal.KeySet("k", b""), MiB)
        overwrites += 1
    assert overwrites == compaction.MIN_BYTES // MiB + 1
    after = compaction.Garbage.of([journal.KeySet(f"k{i}", b"") for i in range(64)], [MiB] * 64, compacted=True)
    writes = 0
    while not after.due():
        after.observe(journal.KeySet("k0", b""), MiB)
        writes += 1
    assert writes == 64  # as much new garbage as the journal held after the last compaction (above the minimum)


def test_a_replica_taking_over_a_grown_journal_compacts_it_before_serving():
    async def scenario():
        s = published(n=2)
        entries = [*s.take_journal(), *(journal.KeySet("blob", bytes([i]) * MiB) for i in range(40))]
        store = MemoryStore()
        await store.append([journal.encode(e) for e in entries])
        replica = Replica(s.config, store, "here:8476", time.monotonic, lambda: None, lambda why: None)
        running = asyncio.create_task(replica.run())
        while not replica.serving:
            await asyncio.sleep(0.01)
        loaded = [journal.decode(raw) for raw in await store.load()]
        value = replica.state.current.kv.dir("")
        running.cancel()
        return loaded, value

    loaded, value = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert loaded[2:] == [journal.KeySet("blob", bytes([39]) * MiB)]  # after the two registrations
    assert value == [("blob", bytes([39]) * MiB)]


# A real coordinator.

OVERWRITES = 300


def test_overwriting_one_key_keeps_the_coordinators_memory_bounded(start_coordinator):
    """The issue's case: 400 overwrites of 1 MiB took the coordinator from 58 to 616 MB, with one key held."""
    coordinator = start_coordinator(num_processes=1)
    with ifrt.Client(coordinator.address, process_id=0, timeout=30) as client:
        client.discover()
        client.kv_set("blob", b"\0" * MiB, allow_overwrite=True)
        before = rss_bytes(coordinator.pid)
        for i in range(OVERWRITES):
            client.kv_set("blob", bytes([i % 256]) * MiB, allow_overwrite=True)
        grown = rss_bytes(coordinator.pid) - before
        assert client.kv_get("blob", timeout=10) == bytes([(OVERWRITES - 1) % 256]) * MiB
    assert "compacted the journal" in coordinator.log
    # Kept whole, the journal alone would hold OVERWRITES MiB (and more as base64): bounded, it holds MIN_BYTES.
    assert grown < OVERWRITES * MiB / 2, f"the coordinator grew {grown / MiB:.0f} MiB"


def journal_keys(etcd, cluster_id: str) -> int:
    async def count() -> int:
        store = EtcdStore(etcd.endpoints, cluster_id, timeout_s=5)
        try:
            from etcd3aio import prefix_range_end

            prefix = f"/ifrt/{cluster_id}/journal/".encode()
            kv = await store._kv()
            return (await kv.get(prefix, prefix_range_end(prefix), count_only=True, timeout=5)).count
        finally:
            await store.close()

    return asyncio.run(count())


def test_a_leader_killed_after_compaction_loses_nothing(etcd):
    with Replicas(etcd, num_processes=2, cluster_id="compacting", heartbeat="30") as replicas:
        a, b = made = clients(replicas.addresses, 2)
        try:
            before = a.topology
            increment = pb.KeyValueIncrementRequest(client_uid=a.client_uid, key="count", amount=1,
                                                    request_id=uuid.uuid4().hex)
            retry = lambda: a._unary("KeyValueIncrement", lambda _: increment, time.monotonic() + 60)  # noqa: E731
            assert retry().value == 1
            for _ in range(4):
                b.kv_increment("count")
            a.kv_set("gone/x", b"x")
            other = in_thread(lambda: b.barrier("before-compaction", timeout=30))
            a.barrier("before-compaction", timeout=30)
            assert other.get(timeout=30) is None
            written = 0

            def overwrite(value: bytes) -> None:  # with no request id: a write nobody retries, so none is remembered
                request = pb.KeyValueSetRequest(client_uid=a.client_uid, key="blob", value=value, allow_overwrite=True)
                a._unary("KeyValueSet", lambda _: request, time.monotonic() + 60)

            while "compacted the journal" not in replicas.leader.log:  # overwrites until the leader compacts
                assert written < 4 * compaction.MIN_BYTES // (MiB // 2), replicas.leader.log
                overwrite(bytes([written % 256]) * (MiB // 2))
                written += 1
                time.sleep(0.01 if written > compaction.MIN_BYTES // (MiB // 2) else 0)
            overwrite(b"last")
            a.kv_delete("gone/", prefix=True)
            keys = journal_keys(etcd, "compacting")
            assert keys < 10, f"{keys} journal keys after compacting {written} overwrites of 512 KiB"
            replicas.kill_leader()
            standby = replicas.leader
            found = int(re.search(r"replayed (\d+) journal entries", standby.log).group(1))
            assert found < 20, standby.log
            assert retry().value == 1  # answered as before the kill, not applied again
            assert a.kv_increment("count") == 6
            assert a.kv_get("blob", timeout=30) == b"last"
            assert a.kv_try_get("gone/x") is None
            a.barrier("before-compaction", timeout=30)  # a finished barrier answers as it did
            after = a.register_again()
            assert (after.generation, after.fingerprint, after.process_id) == \
                (before.generation, before.fingerprint, before.process_id)
        finally:
            for c in made:
                c.close()
