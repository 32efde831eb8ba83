"""The store follows etcd's quorum: a member that lost it (cut from the other members, still answering TCP) refuses
requests at once ("etcdserver: no leader") instead of holding them, and the store goes on through the members that
have it, so a minority cut never leaves the job without a leader (docs/failover.md, "A minority etcd member")."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import grpc
import pytest

import ifrt
from coordinator.local import LocalCoordinator
from coordinator.store import EtcdStore, StoreError
from ifrt._generated import coordinator_pb2 as pb
from tests.cuts import Cgroup, EtcdWithGroup, dropping, skip_without_cuts
from tests.etcd_cluster import skip_without_etcd
from tests.helpers import poll_until
from tests.replicas import serving

TTL = 2
CUT_S = 20.0
LEADERLESS_MAX_S = 10.0
"""The longest a client may find no replica that acknowledges a write during the cut. A takeover at TTL 2 takes
about 2-3 s; without following the quorum, no replica led for the whole cut (CUT_S)."""

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def raft_leader(endpoint: str) -> int:
    """The raft leader member ``endpoint`` knows of (0: none)."""
    request = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    with _opener.open(request, timeout=2) as answer:
        return int(json.load(answer).get("leader", 0))


def test_a_member_without_a_leader_refuses_the_store_at_once(etcd3):
    """The two other members frozen: the remaining one has no leader. The store's read fails in well under its
    timeout, naming why, instead of waiting it out."""
    stopped = [etcd3.pid(1), etcd3.pid(2)]
    store = EtcdStore([etcd3.endpoint(0)], "quorum", lease_ttl_s=TTL, timeout_s=5)

    async def read() -> tuple[float, str]:
        began = time.monotonic()
        try:
            await store.load()
        except StoreError as e:
            return time.monotonic() - began, str(e)
        finally:
            await store.close()
        return time.monotonic() - began, "answered"

    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        poll_until(lambda: raft_leader(etcd3.endpoint(0)), lambda leader: leader == 0, timeout=10,
                   what="member 0 to have no leader")
        took, error = asyncio.run(read())
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert "no leader" in error, error
    assert took < 1.0, f"refused after {took:.2f}s (the timeout is 5 s)"


@pytest.mark.parametrize("leader_members", ["first", "all"])
def test_a_minority_member_never_leaves_the_job_without_a_leader(tmp_path, monkeypatch, leader_members):
    """Member 0 cut from the others' peer traffic (they keep quorum; it keeps answering TCP). The leading replica
    dials member 0 only (``first``: it must step down and the standby, which dials all three, take over) or all
    three (``all``, the docs' deployment). Either way a write is acknowledged again within seconds."""
    skip_without_etcd()
    skip_without_cuts()
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "1")
    EtcdWithGroup.group = group = Cgroup("etcd-minority")
    replicas: list[LocalCoordinator] = []
    client: ifrt.Client | None = None
    etcd = EtcdWithGroup.start(3, tmp_path=tmp_path)
    try:
        common = ("--leader-ttl", str(TTL), "--heartbeat-timeout", "60", "--cluster-id", "quorum")
        first_store = f"etcd://{etcd.endpoint(0)}" if leader_members == "first" else etcd.url
        replicas.append(LocalCoordinator("--store", first_store, *common, num_processes=1))
        serving(replicas[0])
        replicas.append(LocalCoordinator("--store", etcd.url, *common, num_processes=1))
        replicas[1].wait_for_log("standing by")
        client = ifrt.Client(",".join(r.address for r in replicas), process_id=0, num_processes=1, session=False,
                             transfer=False)
        client.discover()
        stubs = [client._connection.stub(r.address) for r in replicas]

        def write(n: int) -> bool:
            request = pb.KeyValueSetRequest(client_uid=client.client_uid, key="quorum/k", value=str(n).encode(),
                                            allow_overwrite=True)
            for stub in stubs:
                try:
                    stub.KeyValueSet(request, timeout=0.5)
                    return True
                except grpc.RpcError:
                    continue
            return False

        assert write(0)
        with dropping(*etcd.isolate_first()):
            cut = last = time.monotonic()
            longest, n = 0.0, 0
            while time.monotonic() - cut < CUT_S:
                n += 1
                if write(n):
                    longest, last = max(longest, time.monotonic() - last), time.monotonic()
                else:
                    time.sleep(0.05)
            longest = max(longest, time.monotonic() - last)
            healthy = [etcd.healthy(i) for i in range(3)]
        assert healthy == [False, True, True], f"the cut did not leave member 0 alone without quorum: {healthy}"
        logs = "\n---\n".join(r.log[-3000:] for r in replicas)
        assert longest < LEADERLESS_MAX_S, (f"no replica acknowledged a write for {longest:.1f}s of a {CUT_S:.0f}s "
                                            f"minority cut:\n{logs}")
        print(f"longest without an acknowledged write during the cut: {longest:.2f}s")
    finally:
        if client is not None:
            client.close()
        for r in replicas:
            r.close()
        etcd.close()
        group.remove()
