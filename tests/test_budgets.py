"""The byte budgets of what callers make the coordinator hold, in the pure state machine: each refuses with its own
RESOURCE_EXHAUSTED naming its flag, the bytes held and the limit, and changes nothing; what was refused in the past
is not refused again on replay. (tests/test_attack.py runs the same attacks against a real daemon.)"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.core import journal
from coordinator.core.barriers import Barriers
from coordinator.core.kv import KeyValueStore
from coordinator.core.limits import KEY_OVERHEAD_BYTES, Limits
from coordinator.core.state import ClusterState
from coordinator.outbox import Backlogs, Outbox
from ifrt.errors import ProcessDeclaredFailed, ResourceExhausted, UnknownClient
from tests.helpers import published, reg

KiB = 1 << 10


def test_the_store_refuses_a_write_past_its_bytes_and_changes_nothing():
    store = KeyValueStore(Limits(kv_bytes=10 * KiB))
    for i in range(8):
        store.set(f"k{i}", b"v" * 1000)
    held = store.held
    assert held == 8 * (2 + 1000 + KEY_OVERHEAD_BYTES)
    with pytest.raises(ResourceExhausted) as info:
        store.set("k8", b"v" * 1000)
    assert str(info.value) == (f"storing 1000 bytes at key 'k8' would pass the coordinator's --kv-max-bytes of 10240 "
                               f"bytes; {held} bytes are held: delete keys that are no longer needed, or raise the "
                               "flag")
    assert info.value.code.name == "RESOURCE_EXHAUSTED"
    assert store.held == held and store.get("k8") is None
    store.set("k0", b"small", allow_overwrite=True)  # a smaller value fits again, and so does a new key after it
    store.delete("k1")
    store.set("k8", b"v" * 1000)
    assert store.held == sum(len(k) + len(v) + KEY_OVERHEAD_BYTES for k, v in store.dir(""))


def test_increments_and_swaps_count_against_the_store_bytes_too():
    s = published(limits=Limits(kv_bytes=2 * KiB))
    s.current.keys.set("p0", "big", b"v" * 1700, False)
    s.take_journal()
    with pytest.raises(ResourceExhausted, match="--kv-max-bytes"):
        s.current.keys.compare_set("p0", "other", b"", b"w" * 400, "r1")
    with pytest.raises(ResourceExhausted, match="--kv-max-bytes"):
        s.current.keys.increment("p0", "n", 1, "r2")
    keys = s.current.keys
    assert s.take_journal() == [] and keys.get("p1", "other") is None and keys.get("p1", "n") is None
    assert s.current.kv.retries.get("p0", "r1", "other") is None  # a refused call is no answer to remember


def test_a_replay_restores_what_was_stored_under_a_larger_budget():
    s = published(limits=Limits(kv_bytes=64 * KiB))
    for i in range(20):
        s.current.keys.set("p0", f"k{i}", b"v" * 2000, False)
    entries = s.take_journal()
    smaller = ClusterState(published(limits=Limits(kv_bytes=8 * KiB)).config)
    for entry in entries:
        smaller.replay(entry)
    assert len(smaller.current.kv.dir("")) == 20  # nothing refused on replay; new writes are, until enough is deleted
    with pytest.raises(ResourceExhausted, match="--kv-max-bytes of 8192 bytes"):
        smaller.current.keys.set("p0", "one-more", b"x", False)


def test_a_listing_past_the_reply_bytes_is_refused_before_it_is_built():
    s = published(limits=Limits(reply_bytes=10 * KiB))
    for i in range(20):
        s.current.keys.set("p0", f"job/{i:02d}", b"v" * 1000, False)
    with pytest.raises(ResourceExhausted) as info:
        s.current.keys.dir("p0", "job/")
    assert str(info.value).startswith("the listing of 20 keys under 'job/' (20440 bytes) would pass the "
                                      "coordinator's --max-reply-bytes of 10240 bytes: list a narrower prefix")
    assert len(s.current.keys.dir("p0", "job/0")) == 10  # a narrower prefix fits


def test_barriers_are_bounded_in_bytes_and_share_their_sets_of_participants():
    barriers = Barriers(Limits(barrier_bytes=64 * KiB))
    everyone = frozenset(range(100))
    for i in range(10):
        barriers.arrive(f"step-{i}", 0, frozenset(everyone), 60.0, 0.0, {})
    sets = {id(barriers.get(f"step-{i}").participants) for i in range(10)}  # type: ignore[union-attr]
    assert len(sets) == 1  # one set held for all ten
    held = barriers.held
    cancelled = 0
    with pytest.raises(ResourceExhausted) as info:
        while True:
            barriers.cancel(f"unknown-{cancelled}-" + "b" * 1000, 0, frozenset(), "process 0")
            cancelled += 1
    assert cancelled == (64 * KiB - held) // (3 * len("unknown-0-" + "b" * 1000) + 1024)
    assert "would pass the coordinator's --max-barrier-bytes of 65536 bytes" in str(info.value)
    assert barriers.held <= 64 * KiB and barriers.held > held
    assert barriers.get(f"unknown-{cancelled}-" + "b" * 1000) is None  # the refused one is not kept


def test_a_replaced_incarnation_keeps_no_request_and_only_the_latest_is_kept():
    s = published(n=2)
    for i in range(1, 6):  # process 0 killed (its session gone) and restarted, again and again
        s.current.detach("p0" if i == 1 else f"p0-{i - 1}", 0.0)
        s.register(reg(f"p0-{i}", 0, host="h0", devices=64), 0.0)
        s.current.attach(f"p0-{i}", 0.0)  # its session opens (until then it holds its id)
    members = s.current.admission.members
    assert sorted(members) == ["p0-4", "p0-5", "p1"]  # the current incarnation and the one it replaced
    assert members["p0-4"].registration.devices == () and members["p0-4"].replaced
    assert len(members["p0-5"].registration.devices) == 64
    with pytest.raises(ProcessDeclaredFailed, match="was declared failed: replaced by a restarted process"):
        s.register(reg("p0-4", 0, host="h0", devices=64), 1.0)  # its retry: told it ended, not compared
    with pytest.raises(UnknownClient):
        s.current.attach("p0-3", 1.0)  # an older one is no longer known: register again


def test_registrations_of_an_attempt_are_bounded_in_bytes_replays_are_not_refused():
    limits = Limits(registration_bytes=16 * KiB)
    s = published(n=2, limits=limits)
    held = s.current.admission.held
    uid = "p0"
    refused = None
    for i in range(1, 100):
        s.current.detach(uid, 0.0)  # killed, and restarted (a process that left would wait for the next run instead)
        try:
            s.register(reg(f"p0-{i}", 0, host="h0", devices=8), 0.0)
        except ResourceExhausted as e:
            refused = e
            break
        uid = f"p0-{i}"
        s.current.attach(uid, 0.0)
    assert refused is not None and 3 < i < 20
    assert "would pass the coordinator's --max-registration-bytes of 16384 bytes" in str(refused)
    assert s.current.admission.held <= 16 * KiB and s.current.admission.held > held
    entries = s.take_journal()
    again = ClusterState(published(n=2, limits=Limits(registration_bytes=4 * KiB)).config)
    for entry in entries:
        again.replay(entry)  # accepted when it was made: never refused when replayed
    assert again.current.registration_of(0).client_uid == uid  # type: ignore[union-attr]
    assert [type(e) for e in entries].count(journal.Registered) == 2 + i - 1


def test_sessions_together_hold_at_most_the_backlog_bytes_each_message_counted_once():
    async def run() -> tuple[list[object], int]:
        backlogs = Backlogs(6 * KiB)
        ended = []
        outboxes = [Outbox(8 * KiB, lambda w: ("own", w), backlogs, lambda w, i=i: ended.append(i) or ("shared", w))
                    for i in range(4)]
        shared = b"s" * 2000
        for outbox in outboxes:  # one message queued four times: 2000 bytes held, not 8000
            outbox.put_nowait(shared)
        assert backlogs.held == 2000
        for i in range(3):  # each session's own messages
            outboxes[1].put_nowait(bytes([i]) * 3000)
        held_after = backlogs.held
        first = await outboxes[1].get()
        return [first, ended, held_after], backlogs.held

    (first, ended, held_after), held = asyncio.run(run())
    assert ended == [1] and first == ("shared", 8000)  # the session holding the most was ended
    assert held_after == 2000 and held == 2000
