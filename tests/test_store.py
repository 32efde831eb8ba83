"""The store contract, one suite for every backend: memory, and etcd against a real etcd server."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.core import journal
from coordinator.core.cluster import ClusterConfig
from coordinator.core.registration import Registration
from coordinator.core.state import ClusterState
from coordinator.journal_batches import BATCH_VERSION, MAX_BATCH_BYTES, pack_batches, unpack_batch
from coordinator.store import EtcdStore, MemoryStore, StoreError, open_store
from ifrt import wire
from ifrt.records import LocalDevice


def run(coro, timeout: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(params=["memory", "etcd"])
def make_store(request):
    """A factory of stores of one backend, all on the same journal (the same etcd and cluster id)."""
    if request.param == "memory":
        shared = MemoryStore()
        return lambda cluster_id="job": shared
    cluster = request.getfixturevalue("etcd")
    return lambda cluster_id="job": EtcdStore(cluster.endpoints, cluster_id, lease_ttl_s=2, timeout_s=2)


def test_appended_entries_load_back_in_order(make_store):
    async def scenario():
        store = make_store()
        await store.acquire("c1:8476")
        await store.append([b"a", b"b"])
        await store.append([b"c", *(f"n{i}".encode() for i in range(150))])
        await store.close()
        again = make_store()
        await again.acquire("c1:8476")
        loaded = await again.load()
        await again.close()
        return loaded

    assert run(scenario()) == [b"a", b"b", b"c", *(f"n{i}".encode() for i in range(150))]


def test_an_append_larger_than_one_key_loads_back_whole_and_in_order(make_store):
    big = [bytes([i]) * (MAX_BATCH_BYTES // 3 + i) for i in range(7)]  # over two keys' worth of entries

    async def scenario():
        store = make_store()
        await store.acquire("c1:8476")
        await store.append([b"first"])
        await store.append([*big, b""])
        await store.append([b"last"])
        loaded = await store.load()
        await store.close()
        return loaded

    assert run(scenario()) == [b"first", *big, b"", b"last"]


def test_journal_replays_to_the_same_topology(make_store):
    """What a coordinator journals, another rebuilds byte for byte."""
    config = ClusterConfig(num_processes=2, cluster_id="job")
    original = ClusterState(config)
    for pid in (1, 0):
        original.register(Registration(f"uid{pid}", "", 2, pid, f"h{pid}", "10.0.0.1", 0, f"h{pid}:9",
                                       (LocalDevice(0, "cpu", "cpu", "s0", (pid,), {"k": "v"}),), "cpu"), 1.0)
    original.current.keys.set("uid0", "nccl/id", b"\x00\x01", False)

    async def scenario():
        store = make_store()
        await store.acquire("c1:8476")
        await store.append([journal.encode(e) for e in original.take_journal()])
        loaded = await store.load()
        await store.close()
        return loaded

    rebuilt = ClusterState(config)
    for raw in run(scenario()):
        rebuilt.replay(journal.decode(raw))
    assert wire.encode(rebuilt.topology) == wire.encode(original.topology)
    assert rebuilt.current.keys.get("uid0", "nccl/id") == b"\x00\x01"


def test_a_deposed_leader_cannot_append(etcd):
    async def scenario():
        first = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        second = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        await first.acquire("c1:8476")
        waiting = asyncio.create_task(second.acquire("c2:8476"))
        await asyncio.sleep(1.0)  # deliberately let time pass: the second does not become leader meanwhile
        assert not waiting.done()  # one leader at a time
        await first.append([b"from first"])
        await first.release()  # e.g. its lease expired
        await asyncio.wait_for(waiting, 10)
        await second.append([b"from second"])
        with pytest.raises(StoreError, match="no longer leads") as info:
            await first.append([b"stale write"])
        assert not info.value.retryable and first.lost.is_set()
        loaded = await second.load()
        await first.close()
        await second.close()
        return loaded

    assert run(scenario()) == [b"from first", b"from second"]


def test_a_dead_leader_is_replaced_when_its_lease_expires(etcd):
    async def scenario():
        first = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        await first.acquire("c1:8476")
        first._keepalive.cancel()  # as if the process froze or died: the lease is no longer renewed
        second = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        started = asyncio.get_running_loop().time()
        await second.acquire("c2:8476")
        took = asyncio.get_running_loop().time() - started
        await second.close()
        return took

    assert run(scenario()) < 10


def test_clusters_do_not_see_each_other(etcd):
    async def scenario():
        a, b = (EtcdStore(etcd.endpoints, name, lease_ttl_s=2, timeout_s=2) for name in ("job-a", "job-b"))
        await a.acquire("a:1")
        await b.acquire("b:1")  # each cluster has its own leader
        await a.append([b"a1"])
        await b.append([b"b1", b"b2"])
        loaded = await a.load(), await b.load()
        await a.close()
        await b.close()
        return loaded

    assert run(scenario()) == ([b"a1"], [b"b1", b"b2"])


def test_unreachable_etcd_is_a_retryable_error_naming_it(etcd):
    async def scenario():
        store = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=1)
        await store.acquire("c1:8476")
        etcd.stop_all()
        with pytest.raises(StoreError, match="cannot write the journal to etcd") as info:
            await store.append([b"x"])
        assert info.value.retryable
        store._lease = 0  # nothing to revoke on a stopped etcd
        await store.close()

    run(scenario())


def test_bad_store_specs_say_what_is_expected():
    with pytest.raises(ValueError, match="expected memory or etcd://HOST:PORT"):
        open_store("redis://x:1", "job")
    with pytest.raises(ValueError, match="expected etcd://HOST:PORT"):
        open_store("etcd://", "job")


def test_the_etcd_layout_is_one_key_per_batch_numbered_from_zero(etcd):
    """What a deployed journal looks like in etcd: ``journal/<16 digits>`` per append, values of framed entries."""
    from etcd3aio import prefix_range_end

    async def scenario():
        store = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        await store.acquire("c1:8476")
        await store.append([b"a", b"bc"])
        await store.append([b"d"])
        await store.append([b"x" * MAX_BATCH_BYTES, b"y"])  # one key cannot hold both
        prefix = b"/ifrt/job/journal/"
        found = await (await store._kv()).get(prefix, prefix_range_end(prefix), timeout=2)
        await store.close()
        return [(bytes(item.key), bytes(item.value)) for item in found.kvs]

    keys, values = zip(*sorted(run(scenario())), strict=True)
    assert keys == tuple(f"/ifrt/job/journal/{i:016d}".encode() for i in range(4))
    assert values[0] == BATCH_VERSION + b"\x00\x00\x00\x01a\x00\x00\x00\x02bc"
    assert [unpack_batch(v) for v in values[1:]] == [[b"d"], [b"x" * MAX_BATCH_BYTES], [b"y"]]


def test_a_journal_key_that_is_not_a_batch_is_an_error_naming_it(etcd):
    async def scenario():
        store = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        await store.acquire("c1:8476")
        await store.append([b"fine"])
        await (await store._kv()).put(b"/ifrt/job/journal/0000000000000001", b'{"type":"Left"}', timeout=2)
        try:
            with pytest.raises(StoreError, match=r"journal/0000000000000001.*not a journal batch") as info:
                await store.load()
            assert not info.value.retryable
        finally:
            await store.close()

    run(scenario())


def test_batches_split_at_the_limit_and_keep_every_entry_in_order():
    entries = [b"a" * 4, b"", b"b" * 6, b"c" * 11, b"d"]
    values = pack_batches(entries, limit=10)
    assert [unpack_batch(v) for v in values] == [[b"a" * 4, b"", b"b" * 6], [b"c" * 11], [b"d"]]
    assert all(v.startswith(BATCH_VERSION) for v in values)
    assert pack_batches([]) == []
    assert pack_batches([b""]) == [BATCH_VERSION + b"\x00" * 4]


def test_a_damaged_batch_is_refused_saying_where():
    value = pack_batches([b"abc"])[0]
    with pytest.raises(ValueError, match="runs past the end"):
        unpack_batch(value[:-1])
    with pytest.raises(ValueError, match="truncated entry length"):
        unpack_batch(value + b"\x00")
    with pytest.raises(ValueError, match="not a journal batch of version 1"):
        unpack_batch(b"\x02" + value[1:])


# Compaction: the store drops what replay no longer needs.

def test_a_compacted_journal_loads_back_the_kept_entries_in_order_and_grows_on(make_store):
    entries = [f"e{i}".encode() for i in range(40)]
    keep = [i % 3 == 0 or i >= 30 for i in range(40)]

    async def scenario():
        store = make_store()
        await store.acquire("c1:8476")
        for i in range(0, 40, 4):  # ten appends
            await store.append(entries[i:i + 4])
        loaded = await store.load()
        await store.compact(loaded, keep)
        await store.append([b"after"])
        mine = await store.load()
        await store.close()
        again = make_store()  # a new leader finds the same
        await again.acquire("c2:8476")
        theirs = await again.load()
        await again.append([b"from the next leader"])
        final = await again.load()
        await again.close()
        return mine, theirs, final

    kept = [e for e, k in zip(entries, keep, strict=True) if k]
    mine, theirs, final = run(scenario())
    assert mine == theirs == [*kept, b"after"]
    assert final == [*kept, b"after", b"from the next leader"]


def test_a_compaction_decided_on_another_journal_is_refused_and_changes_nothing(make_store):
    async def scenario():
        store = make_store()
        await store.acquire("c1:8476")
        await store.append([b"a", b"b"])
        loaded = await store.load()
        await store.append([b"c"])  # appended after the read the compaction was decided on
        with pytest.raises(StoreError, match="the journal holds 3 entries, the compaction was decided on 2"):
            await store.compact(loaded, [False, True])
        result = await store.load()
        await store.close()
        return result

    assert run(scenario()) == [b"a", b"b", b"c"]


def test_compaction_merges_and_deletes_etcd_keys(etcd):
    from etcd3aio import prefix_range_end

    async def scenario():
        store = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        await store.acquire("c1:8476")
        for i in range(300):
            await store.append([f"overwrite {i}".encode()])
        await store.append([b"x" * MAX_BATCH_BYTES, b"y" * MAX_BATCH_BYTES])  # two keys of their own
        loaded = await store.load()
        await store.compact(loaded, [i % 100 == 99 or i >= 300 for i in range(len(loaded))])
        prefix = b"/ifrt/job/journal/"
        found = await (await store._kv()).get(prefix, prefix_range_end(prefix), keys_only=True, timeout=2)
        await store.append([b"next"])
        await store.close()
        return sorted(bytes(item.key) for item in found.kvs)

    keys = run(scenario())
    # The three kept overwrites fit in the first key; each large entry keeps its own.
    assert keys == [f"/ifrt/job/journal/{i:016d}".encode() for i in (0, 300, 301)]


def test_a_deposed_leader_cannot_compact(etcd):
    async def scenario():
        first = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        await first.acquire("c1:8476")
        await first.append([b"a", b"b"])
        loaded = await first.load()
        await first.release()
        second = EtcdStore(etcd.endpoints, "job", lease_ttl_s=2, timeout_s=2)
        await second.acquire("c2:8476")
        with pytest.raises(StoreError, match="no longer leads"):
            await first.compact(loaded, [False, True])
        result = await second.load()
        await first.close()
        await second.close()
        return result

    assert run(scenario()) == [b"a", b"b"]
