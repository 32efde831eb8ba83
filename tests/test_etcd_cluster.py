"""tests/etcd_cluster.py against real etcd servers, through etcd3aio (the client the etcd store uses)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from etcd3aio import Etcd3Client, EtcdConnectionError, EtcdError

from tests.etcd_cluster import EtcdCluster, requires_etcd
from tests.helpers import free_ports

BOUND = 30.0  # seconds any one test's asyncio part may take in all


async def put_within(client: Etcd3Client, key: str, value: str, seconds: float) -> float:
    """Retries a put (0.5 s per try) until it succeeds; returns the seconds it took, raises after ``seconds``."""
    t0 = time.monotonic()
    while True:
        try:
            await client.kv.put(key, value, timeout=0.5)
            return time.monotonic() - t0
        except (EtcdError, TimeoutError):
            if time.monotonic() - t0 > seconds:
                raise
            await asyncio.sleep(0.05)


async def get_value(client: Etcd3Client, key: str) -> bytes | None:
    """The value stored at ``key`` (linearizable read), or None."""
    response = await client.kv.get(key, timeout=2)
    return response.kvs[0].value if response.kvs else None


async def leader_index(endpoints: Sequence[str]) -> int:
    """Index of the endpoint whose member is the raft leader, asked through the maintenance status API."""
    for i, endpoint in enumerate(endpoints):
        async with Etcd3Client(endpoints=[endpoint]) as client:
            status = await client.maintenance.status(timeout=2)
            if status.leader and status.leader == status.header.member_id:
                return i
    raise AssertionError(f"no member of {endpoints} is the leader")


def test_free_ports_are_distinct() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(1024 <= p <= 65535 for p in ports)


def test_only_one_or_three_members(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="1 or 3"):
        EtcdCluster.start(2, tmp_path=tmp_path)


@requires_etcd
def test_single_member_put_get(tmp_path: Path) -> None:
    with EtcdCluster.start(tmp_path=tmp_path) as etcd:
        assert len(etcd.endpoints) == 1
        assert etcd.endpoints[0].startswith("127.0.0.1:")
        assert etcd.url == f"etcd://{etcd.endpoints[0]}"
        assert etcd.directory.parent == tmp_path
        assert etcd.leader() == 0
        assert etcd.healthy(0)

        async def main() -> None:
            async with asyncio.timeout(BOUND), Etcd3Client(endpoints=etcd.endpoints) as client:
                await client.kv.put("/ifrt/test/k", "v1", timeout=2)
                assert await get_value(client, "/ifrt/test/k") == b"v1"
                assert await get_value(client, "/ifrt/test/missing") is None

        asyncio.run(main())
        assert "now serving peer/client/metrics" in etcd.log(0)
        pid = etcd.pid(0)
        assert pid is not None
    assert not etcd.running(0)
    assert etcd.pid(0) is None


@requires_etcd
def test_stop_escalates_to_sigkill_and_restart_keeps_data(tmp_path: Path) -> None:
    with EtcdCluster.start(tmp_path=tmp_path) as etcd:

        async def put_get(key: str, value: str | None) -> bytes | None:
            async with asyncio.timeout(BOUND), Etcd3Client(endpoints=etcd.endpoints) as client:
                if value is not None:
                    await client.kv.put(key, value, timeout=2)
                return await get_value(client, key)

        assert asyncio.run(put_get("/ifrt/test/k", "v")) == b"v"
        pid = etcd.pid(0)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # a member that ignores SIGTERM, as one without quorum can
        t0 = time.monotonic()
        etcd.stop(0, grace=0.3)
        assert time.monotonic() - t0 < 2
        assert not etcd.running(0)
        assert etcd.exit_code(0) == -signal.SIGKILL

        port = etcd.endpoints[0]
        assert etcd.restart(0) < 10  # one member is a quorum of one: waits until healthy
        assert etcd.healthy(0)
        assert etcd.endpoints[0] == port
        assert asyncio.run(put_get("/ifrt/test/k", None)) == b"v"
        assert "--initial-cluster-state existing" in etcd.log(0)


@requires_etcd
@pytest.mark.slow
def test_three_members_survive_the_leader_being_killed(tmp_path: Path) -> None:
    with EtcdCluster.start(3, tmp_path=tmp_path) as etcd:
        assert len(set(etcd.endpoints)) == 3
        assert etcd.url == "etcd://" + ",".join(etcd.endpoints)

        async def main() -> int:
            async with asyncio.timeout(BOUND), Etcd3Client(endpoints=etcd.endpoints) as client:
                await client.kv.put("/ifrt/test/k", "before", timeout=2)
                leader = await leader_index(etcd.endpoints)
                assert etcd.leader() == leader  # the helper's HTTP view agrees with the gRPC one

                etcd.kill(leader)
                assert not etcd.running(leader)
                # The long-lived client (all three endpoints, like the coordinator's) carries on once the remaining
                # two have elected a new leader, 0.5-0.9 s after the kill (--election-timeout 500). A put in flight
                # meanwhile is dropped by etcd 3.4 and fails only at its own deadline (a 5 s put: TimeoutError
                # after 5 s), hence short tries: the first put succeeds 0.55-1.1 s after the kill.
                took = await put_within(client, "/ifrt/test/k", "after", seconds=5)
                assert took < 5

                remaining = [e for i, e in enumerate(etcd.endpoints) if i != leader]
                async with Etcd3Client(endpoints=remaining) as fresh:
                    await fresh.kv.put("/ifrt/test/k2", "fresh", timeout=2)
                    assert await get_value(fresh, "/ifrt/test/k") == b"after"
                assert remaining[await leader_index(remaining)] != etcd.endpoints[leader]
                return leader

        killed = asyncio.run(main())
        assert etcd.leader() not in (None, killed)
        etcd.restart(killed)  # the killed member comes back with its data and ports, as a follower
        assert etcd.healthy(killed)


@requires_etcd
@pytest.mark.slow
def test_all_members_down_then_back(tmp_path: Path) -> None:
    with EtcdCluster.start(3, tmp_path=tmp_path) as etcd:

        async def main() -> None:
            async with asyncio.timeout(BOUND), Etcd3Client(endpoints=etcd.endpoints) as client:
                await client.kv.put("/ifrt/test/k", "kept", timeout=2)
                etcd.stop_all()
                assert not any(etcd.running(i) for i in range(3))

                # Every port refuses connections: gRPC fails each attempt at once with UNAVAILABLE ("connections
                # to all backends failing ... Connection refused"), etcd3aio retries it twice (0.05 s, 0.1 s
                # backoff) and raises EtcdConnectionError after about 0.15 s, whatever the timeout.
                t0 = time.monotonic()
                with pytest.raises(EtcdConnectionError):
                    await client.kv.put("/ifrt/test/k", "lost", timeout=1)
                assert time.monotonic() - t0 < 1.5

                # One member up, no quorum: it accepts TCP but answers nothing (neither gRPC nor /health) until a
                # quorum is back. Depending on gRPC's connection state a call then either waits for its deadline
                # (etcd3aio's asyncio.timeout raises the builtin TimeoutError, empty message, after `timeout`) or
                # fails fast like above (EtcdConnectionError after ~0.15 s); both happen, even for a new client.
                etcd.restart(0)
                assert etcd.running(0)
                with pytest.raises(TimeoutError, match=r"not healthy within 0\.3s[\s\S]*m0\.log"):
                    etcd.wait_healthy(0, timeout=0.3)
                async with Etcd3Client(endpoints=etcd.endpoints) as fresh:
                    t0 = time.monotonic()
                    with pytest.raises((TimeoutError, EtcdConnectionError)):
                        await fresh.kv.put("/ifrt/test/k", "lost", timeout=0.5)
                    assert time.monotonic() - t0 < 1.5

                etcd.restart(1)  # a quorum again: waits until member 1 is healthy
                assert etcd.healthy(0)
                etcd.restart(2)
                await put_within(client, "/ifrt/test/k2", "again", seconds=5)
                assert await get_value(client, "/ifrt/test/k") == b"kept"

                etcd.stop_all()
                etcd.restart_all()
                await put_within(client, "/ifrt/test/k3", "third", seconds=5)
                assert await get_value(client, "/ifrt/test/k2") == b"again"

        asyncio.run(main())
    assert "received signal; shutting down" in etcd.log(0)
