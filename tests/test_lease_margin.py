"""No answer from a replica that may no longer lead: a leader cut off from etcd stops answering anything built from
memory before its lease can have expired there, so no read it answers comes after a write the next leader
acknowledged (docs/failover.md, "The lease margin")."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
import uuid

import grpc
import pytest

import ifrt
from coordinator.local import LocalCoordinator, _console_script
from coordinator.store import EtcdStore, lease_margin
from ifrt._generated import coordinator_pb2 as pb
from tests.cuts import Cgroup, dropping, skip_without_cuts
from tests.replicas import serving

TTL = 2
KEY = "margin/k"
TAKEOVER_S = 20.0
"""Far above what a takeover takes at TTL 2 (about 2-3 s): the bound only stops a broken run."""


def test_a_lease_ttl_the_margin_cannot_hold_is_refused_naming_the_smallest():
    with pytest.raises(ValueError, match=r"--leader-ttl 1 is too short.*at least 2"):
        EtcdStore(["127.0.0.1:1"], "job", lease_ttl_s=1)
    assert lease_margin(2) == 0.5 and lease_margin(30) == 3.0
    for ttl in ("1", "0", "-3"):
        done = subprocess.run([_console_script("ifrt-coordinator"), "--num-processes", "1", "--leader-ttl", ttl],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert f"--leader-ttl {ttl} is too short" in done.stderr and "at least 2" in done.stderr


def test_a_store_stops_holding_its_lease_before_etcd_can_expire_it(etcd):
    """etcd frozen (SIGSTOP: connections open, nothing answered): the store says it no longer holds the lease by
    the last renewal's send time + TTL - margin, and sets ``lost`` then, not after a renewal attempt times out."""
    async def scenario() -> tuple[float, float, float]:
        store = EtcdStore(etcd.endpoints, "margin", lease_ttl_s=TTL, timeout_s=5)
        await store.acquire("c1:1")
        await asyncio.sleep(1.0)  # a renewal or two
        assert store.holds_lease()
        os.kill(etcd.pid(0), signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            deadline = store.serves_until
            while store.holds_lease():
                await asyncio.sleep(0.005)
            refused = time.monotonic()
            await asyncio.wait_for(store.lost.wait(), 5)
            lost = time.monotonic()
        finally:
            os.kill(etcd.pid(0), signal.SIGCONT)
        store._lease = 0  # nothing to revoke: it expired
        await store.close()
        return deadline - frozen, refused - frozen, lost - frozen

    until, refused, lost = asyncio.run(asyncio.wait_for(scenario(), 30))
    # The last renewal was sent before the freeze: serving ends by then + TTL - margin, the clock says so at once,
    # and the renewal loop gives up then too (before, it did after a try's 5 s timeout: about 5.7 s in).
    assert until <= TTL - lease_margin(TTL) + 0.01, until
    assert refused <= until + 0.5, (refused, until)
    assert lost <= until + 1.0, (lost, until)


def test_a_leader_cut_from_etcd_answers_no_read_after_the_new_leader_acknowledged_a_write(etcd, monkeypatch):
    """The old leader keeps its clients and loses etcd; a writer reaches the standby as soon as it leads. Every read
    the old leader answers must have been called before the new leader acknowledged the write."""
    skip_without_cuts()
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "1")
    group = Cgroup("old-leader")
    args = ("--store", etcd.url, "--leader-ttl", str(TTL), "--heartbeat-timeout", "60", "--cluster-id", "margin")
    replicas: list[LocalCoordinator] = []
    clients: list[ifrt.Client] = []
    try:
        replicas.append(LocalCoordinator(*args, num_processes=2, log_level="DEBUG", wrapper=group.wrapper))
        old = serving(replicas[0])
        replicas.append(LocalCoordinator(*args, num_processes=2, log_level="DEBUG"))
        new = replicas[1]
        new.wait_for_log("standing by")
        addresses = f"{old.address},{new.address}"
        clients = [ifrt.Client(addresses, process_id=p, num_processes=2, session=False, transfer=False)
                   for p in range(2)]
        found: list = []
        threads = [threading.Thread(target=lambda c=c: found.append(c.discover())) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(found) == 2
        clients[0].kv_set(KEY, b"old", allow_overwrite=True)
        reader, writer = clients[0]._connection.stub(old.address), clients[1]._connection.stub(new.address)

        reads: list[tuple[float, float, bytes | None]] = []  # (called, answered, value) of each read `old` answered
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                called = time.monotonic()
                try:
                    answer = reader.KeyValueTryGet(pb.KeyValueTryGetRequest(client_uid=clients[0].client_uid,
                                                                           key=KEY), timeout=0.5)
                    reads.append((called, time.monotonic(), answer.value if answer.found else None))
                except grpc.RpcError:
                    pass
                time.sleep(0.005)

        with dropping(group.drop_to_ports([int(etcd.endpoint(0).rsplit(":", 1)[1])])):
            cut = time.monotonic()
            thread = threading.Thread(target=read, daemon=True)
            thread.start()
            request = pb.KeyValueSetRequest(client_uid=clients[1].client_uid, key=KEY, value=b"new",
                                            allow_overwrite=True, request_id=uuid.uuid4().hex)
            while True:  # the standby refuses until it leads; then it acknowledges the write
                assert time.monotonic() - cut < TAKEOVER_S, f"no new leader:\n{new.log}"
                try:
                    writer.KeyValueSet(request, timeout=1)
                    break
                except grpc.RpcError:
                    time.sleep(0.005)
            acknowledged = time.monotonic()
            old.wait_for_log("stepping down", timeout=TAKEOVER_S)
            time.sleep(0.5)  # reads keep trying the old leader a little longer
            stop.set()
            thread.join(5)

        answered_after_cut = [r for r in reads if r[0] > cut]
        assert answered_after_cut, "the old leader answered no read after the cut: the test shows nothing"
        stale = [(round(c - acknowledged, 3), v) for c, _, v in reads if c > acknowledged]
        assert not stale, (f"the old leader answered {len(stale)} reads called after the new leader acknowledged "
                           f"a write (seconds after the acknowledgement, value): {stale[:5]}")
        last = max(answered for _, answered, _ in reads)
        print(f"old leader's last answer {last - cut:.2f}s after the cut; new leader acknowledged at "
              f"{acknowledged - cut:.2f}s")
    finally:
        for c in clients:
            c.close()
        for r in replicas:
            r.close()
        group.remove()
