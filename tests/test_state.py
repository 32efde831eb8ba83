"""The admission state machine, without a network: decisions, rejections that change nothing, journal replay."""

import base64
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core import journal
from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import Published, Waiting
from coordinator.core.registration import to_request
from coordinator.core.state import ClusterState
from ifrt import wire
from ifrt.errors import ClusterMismatch, InvalidArgument, ProcessDeclaredFailed, ProcessIdTaken
from tests.helpers import admit, reg


def state(n=4, **kwargs):
    return ClusterState(ClusterConfig(num_processes=n, cluster_id="job", **kwargs))


def snapshot(s):
    return (s.registered, s.current.progress(now=100.0), s.topology)


def test_publishes_when_the_last_process_registers():
    s = state(3)
    assert admit(s, reg("a", 0), 1.0) == Waiting(1, 3)
    assert admit(s, reg("b", 2, devices=3), 2.0) == Waiting(2, 3)
    out = admit(s, reg("c", 1, devices=1), 3.0)
    assert isinstance(out, Published) and out.process_id == 1
    assert [d.id for d in out.topology.devices] == [0, 1, 1 << 17, 2 << 17, 2 << 17 | 1, 2 << 17 | 2]
    assert out.topology.generation == 1


def test_retry_gets_the_same_answer():
    s = state(2)
    assert admit(s, reg("a", 0), 1.0) == admit(s, reg("a", 0), 2.0) == Waiting(1, 2)
    first = admit(s, reg("b", 1), 3.0)
    assert admit(s, reg("b", 1, ip="10.9.9.9"), 4.0) == first  # a retry may arrive from another route
    assert admit(s, reg("a", 0), 5.0) == Published(0, first.topology)


def test_progress_names_missing_ids_hosts_and_wait():
    s = state(4)
    admit(s, reg("a", 0, host="alpha"), 10.0)
    admit(s, reg("b", 3, host="beta"), 11.0)
    p = s.current.progress(now=14.0)
    assert (p.registered, p.expected, p.missing_process_ids, p.waited_seconds) == (2, 4, (1, 2), 4.0)
    assert p.registered_hosts == ("alpha (10.0.0.1)", "beta (10.0.0.1)")
    assert "missing process ids [1, 2]" in p.describe() and "waited 4.0s" in p.describe()


@pytest.mark.parametrize(("bad", "error", "message"), [
    (reg("x", 1, host="other"), ProcessIdTaken, "process id 1 is already registered by first"),
    (reg("x", 4), InvalidArgument, "process id 4 is out of range: expected 0 <= process_id < 4"),
    (reg("x", 2, num_processes=8), ClusterMismatch, "expects 8 processes; this coordinator's cluster has 4"),
    (reg("x", 2, cluster_id="other-job"), ClusterMismatch, "asked for cluster 'other-job'"),
    (reg("x", None, rank=5), ClusterMismatch, "this cluster uses explicit process ids"),
    (reg("a", 1, devices=5), ClusterMismatch, "registered again with a different request"),
])
def test_bad_registration_is_rejected_and_changes_nothing(bad, error, message):
    s = state(4)
    admit(s, reg("a", 1, host="first"), 1.0)
    s.current.call_started("a", 1.0)  # the holder is waiting for the topology
    before = snapshot(s)
    with pytest.raises(error, match=message):
        admit(s, bad, 2.0)
    assert snapshot(s) == before
    for uid, pid in [("b", 0), ("c", 2)]:
        admit(s, reg(uid, pid), 3.0)
    out = admit(s, reg("d", 3), 4.0)
    assert isinstance(out, Published) and [p.process_id for p in out.topology.processes] == [0, 1, 2, 3]


def test_explicit_id_after_assigned_ones_is_refused():
    s = state(2)
    admit(s, reg("a", rank=0), 1.0)
    with pytest.raises(ClusterMismatch, match="this cluster assigns process ids"):
        admit(s, reg("b", 1), 2.0)


def test_same_stable_key_twice_is_refused_with_advice():
    s = state(2)
    admit(s, reg("a", host="h", ip="10.0.0.1", rank=0), 1.0)
    s.current.call_started("a", 1.0)
    with pytest.raises(ProcessIdTaken, match="IFRT_LOCAL_RANK"):
        admit(s, reg("b", host="h", ip="10.0.0.1", rank=0), 2.0)


def test_newcomer_after_publication_is_refused():
    s = state(1)
    admit(s, reg("a", rank=0), 1.0)
    s.current.attach("a", 1.0)
    with pytest.raises(ClusterMismatch, match="the cluster is complete"):
        admit(s, reg("b", rank=1), 2.0)
    with pytest.raises(ProcessIdTaken, match="another live process"):
        admit(s, reg("c", rank=0), 2.0)


def test_id_limit_applies_below_the_process_count():
    s = ClusterState(ClusterConfig(num_processes=8, max_processes=8))
    with pytest.raises(InvalidArgument, match="< 8"):
        admit(s, reg("a", 8), 1.0)
    with pytest.raises(InvalidArgument, match="num_processes 9 is out of range"):
        ClusterConfig(num_processes=9, max_processes=8)


hosts = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["10.0.0.1", "10.0.0.2"]),
                           st.integers(0, 3)), min_size=1, max_size=12, unique=True)


@settings(max_examples=50, deadline=None)
@given(hosts, st.randoms(use_true_random=False))
def test_assigned_ids_do_not_depend_on_arrival_order(keys, rng):
    def run(order):
        s = state(len(keys))
        out = None
        for i in order:
            host, ip, rank = keys[i]
            out = admit(s, reg(f"uid-{i}-{rng.random()}", host=host, ip=ip, rank=rank, devices=1 + i % 3), 1.0)
        return wire.encode(out.topology)

    order = list(range(len(keys)))
    shuffled = order[:]
    rng.shuffle(shuffled)
    assert run(order) == run(shuffled)


def test_assigned_ids_follow_host_then_address_then_local_rank():
    s = state(4)
    arrivals = [reg("w", host="b", ip="10.0.0.1"), reg("x", host="a", ip="10.0.0.2"),
                reg("y", host="a", ip="10.0.0.1", rank=1), reg("z", host="a", ip="10.0.0.1")]
    for r in arrivals:
        admit(s, r, 1.0)
    assert {r.client_uid: admit(s, r, 2.0).process_id for r in arrivals} == {"z": 0, "y": 1, "x": 2, "w": 3}


def outcomes(s, reader_uid, keys, barriers):
    """The values of ``keys`` (as the live client ``reader_uid`` reads them) and how each of ``barriers`` ended, as
    (error class name, message): the one place that reads a state's key-values and barrier results."""
    def ended(name):
        outcome = s.current.barrier_outcome(name)
        if outcome is None:
            return None
        return (type(outcome.error).__name__, str(outcome.error)) if outcome.error else ("", "")

    return {k: s.current.keys.get(reader_uid, k) for k in keys}, {name: ended(name) for name in barriers}


def journaled_cluster():
    """A cluster of 4 (heartbeat timeout 1 s) whose life journals every kind of record; returns it and its journal."""
    s = state(4, heartbeat_timeout_s=1.0)
    admit(s, reg("ghost", 3, host="ghost"), 0.0)  # registers, then goes silent before publication
    for i in range(2):
        admit(s, reg(f"u{i}", i, host=f"h{i}", devices=i + 1), 0.5)
        s.current.call_started(f"u{i}", 0.5)  # waiting for the topology: alive
    assert s.tick(2.0)  # the ghost is forgotten (Forgot)
    admit(s, reg("u2", 2, host="h2", devices=3), 2.2)
    s.current.call_started("u2", 2.2)
    assert isinstance(admit(s, reg("u3", 3, host="h3", devices=2), 2.5), Published)  # another process 3
    for i in range(3):
        s.current.call_ended(f"u{i}", 2.5)
    for i in range(4):
        s.current.attach(f"u{i}", 3.0)
    assert s.current.keys.set("u0", "nccl/id", b"\x00\x01", False)  # KeySet
    assert s.current.keys.set("u1", "other", b"x", False)
    for i in range(4):
        s.current.arrive(f"u{i}", "step-1", frozenset(), 10, 3.0)  # completes (BarrierFinished)
    s.current.arrive("u0", "lonely", frozenset({0, 1}), 0.5, 3.0)
    s.tick(3.6)  # "lonely" times out
    s.current.arrive("u0", "sync", frozenset({0, 2}), 60, 3.7)
    s.current.arrive("u0", "pair", frozenset({0, 1}), 60, 3.8)
    s.current.detach("u1", 3.9)
    s.tick(4.5)  # process 1 lost its session and did not come back: Failed; "pair" fails
    outcome, _ = s.register(reg("u1-again", 1, host="h1", devices=3), 4.6)  # a restart with other devices
    assert isinstance(outcome, Published) and outcome.topology.generation == 2
    assert s.current.keys.set("u1-again", "nccl/id", b"new", True)
    s.leave("u2", 5.0)  # Left; "sync" fails
    return s, s.take_journal()


KEYS = ("nccl/id", "other", "never-set")
BARRIERS = ("step-1", "lonely", "sync", "pair", "never-started")


def test_replaying_the_journal_gives_the_same_topology_key_values_and_barriers():
    original, entries = journaled_cluster()
    assert {type(e).__name__ for e in entries} == {"Registered", "Forgot", "KeySet", "BarrierFinished", "Left",
                                                   "Failed"}
    raw = [journal.encode(e) for e in entries]
    assert [journal.decode(r) for r in raw] == entries

    rebuilt = state(4, heartbeat_timeout_s=1.0)
    for r in raw:
        rebuilt.replay(journal.decode(r))
    assert rebuilt.take_journal() == []  # replaying journals nothing anew
    assert wire.encode(rebuilt.topology) == wire.encode(original.topology)
    assert rebuilt.topology.generation == 2
    assert [(d.process_id, d.local_id) for d in rebuilt.topology.devices] == [
        (0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0), (3, 1)]
    assert [p.hostname for p in rebuilt.topology.processes] == ["h0", "h1", "h2", "h3"]
    assert outcomes(rebuilt, "u0", KEYS, BARRIERS) == outcomes(original, "u0", KEYS, BARRIERS)
    values, barriers = outcomes(rebuilt, "u0", KEYS, BARRIERS)
    assert values == {"nccl/id": b"new", "other": b"x", "never-set": None}
    assert barriers["step-1"] == ("", "")
    assert barriers["lonely"] == ("BarrierTimeout", "barrier 'lonely' timed out after 0.6s: 1 of 2 processes did "
                                                    "not arrive: 1 (h1 (10.0.0.1))")
    assert barriers["sync"] == ("BarrierFailed", "barrier 'sync' cannot complete: process 2 left")
    assert barriers["pair"] == ("BarrierFailed", "barrier 'pair' cannot complete: process 1 failed: lost its "
                                                 "connection and did not come back within 0.125s")
    assert barriers["never-started"] is None


@settings(max_examples=30, deadline=None)
@given(host_address=st.text(max_size=20), secret_hash=st.text(max_size=20),
       now=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10)))
def test_a_registration_is_journaled_as_the_general_encoding_writes_it(host_address, secret_hash, now):
    # A registration's entry is built directly (one per process), byte for byte what json.dumps writes.
    r = replace(reg("uid", 3, host="hé"), host_address=host_address, secret_hash=secret_hash)
    entry = journal.Registered(r, now)
    general = json.dumps({"type": "Registered", "request": base64.b64encode(to_request(r)).decode(),
                          "host_address": host_address, "secret_hash": secret_hash, "now": now},
                         separators=(",", ":")).encode()
    assert journal.encode(entry) == general


def test_replayed_state_continues_like_the_original():
    """What the original decides next, the rebuilt state decides the same: a registration is a retry, the failed
    and departed processes stay so, and a finished barrier answers a late arrival with its result."""
    original, entries = journaled_cluster()
    rebuilt = state(4, heartbeat_timeout_s=1.0)
    for e in entries:
        rebuilt.replay(e)
    for s in (original, rebuilt):
        assert s.register(reg("u3", 3, host="h3", devices=2), 7.0) == (Published(3, s.topology), [])
        with pytest.raises(ProcessDeclaredFailed, match="lost its connection"):
            s.current.attach("u1", 7.0)
        with pytest.raises(ProcessDeclaredFailed, match="was declared left"):
            s.current.attach("u2", 7.0)
        outcome, effects = s.current.arrive("u3", "step-1", frozenset(), 10, 7.0)  # a retry of a finished barrier
        assert (outcome.error, effects) == (None, [])
    assert wire.encode(rebuilt.topology) == wire.encode(original.topology)
