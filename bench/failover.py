"""The cost of keeping the coordinator's state in etcd, and how long a failover takes.

    .venv/bin/python bench/failover.py [--processes 128] [--repeats 3]

Needs Debian's etcd-server (started here on free loopback ports). Prints one JSON object per measurement:

- ``registration``: N simulated processes (grpc.aio, one channel each) register at once; wall time until all
  hold the topology, with ``--store memory`` and ``--store etcd`` side by side (every registration is
  durable in etcd before it is answered, written in batches).
- ``failover``: two replicas on etcd and three live clients; SIGKILL to the leader; time until the clients'
  sessions are attached to the new leader (``CoordinatorRestored``), for two leader lease TTLs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ifrt
from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt.client import CHANNEL_OPTIONS
from tests.etcd_cluster import EtcdCluster

REGISTER = "/ifrt.topology.v1.Coordinator/Register"


async def register_all(address: str, n: int, timeout: float = 120) -> float:
    """Seconds until ``n`` simulated processes, registering at once, all hold the topology."""
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(n)]
    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), 30)

        async def one(pid: int, channel: grpc.aio.Channel) -> None:
            request = pb.RegisterRequest(client_uid=uuid.uuid4().hex, hostname=f"sim{pid}", process_id=pid,
                                         num_processes=n, plugin="cpu", wait_ms=30_000,
                                         devices=[pb.LocalDevice(local_id=i, platform="cpu", kind="cpu")
                                                  for i in range(8)])
            call = channel.unary_unary(REGISTER, request_serializer=pb.RegisterRequest.SerializeToString,
                                       response_deserializer=pb.RegisterResponse.FromString)
            while not (await call(request, timeout=60)).topology:
                pass

        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(i, c) for i, c in enumerate(channels))), timeout)
        return time.perf_counter() - started
    finally:
        for channel in channels:
            await channel.close()


def registration(etcd: EtcdCluster, n: int) -> list[dict]:
    results = []
    for store in ("memory", etcd.url):
        with LocalCoordinator("--store", store, "--cluster-id", f"bench-{uuid.uuid4().hex[:8]}",
                              num_processes=n) as coordinator:
            coordinator.wait_for_log("serving:")
            seconds = asyncio.run(register_all(coordinator.address, n))
        results.append({"measure": "registration", "store": store.split(":")[0], "processes": n,
                        "seconds": round(seconds, 3), "ms_per_process": round(1000 * seconds / n, 3)})
    return results


def failover(etcd: EtcdCluster, ttl: int) -> dict:
    """Seconds from SIGKILL of the leader to every client's session attached to the new leader."""
    cluster = f"bench-{uuid.uuid4().hex[:8]}"
    replicas = [LocalCoordinator("--store", etcd.url, "--cluster-id", cluster, "--leader-ttl", str(ttl),
                                 "--heartbeat-timeout", "10", num_processes=3)
                for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while not (leaders := [r for r in replicas if "serving:" in r.log]) and time.monotonic() < deadline:
            time.sleep(0.05)
        addresses = ",".join(r.address for r in replicas)
        clients = [ifrt.Client(addresses, process_id=i, num_processes=3, timeout=60) for i in range(3)]
        restored = [threading.Event() for _ in clients]
        for client, event in zip(clients, restored, strict=True):
            client.on_event(lambda e, event=event: event.set() if isinstance(e, ifrt.events.CoordinatorRestored)
                            else None)
        threads = [threading.Thread(target=c.discover) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for c in clients:
            c.wait_attached(10)
        killed = time.monotonic()
        leaders[0].stop(signal.SIGKILL)
        for event in restored:
            event.wait(60)
        took = time.monotonic() - killed
        for c in clients:
            c.close()
        return {"measure": "failover", "leader_ttl_s": ttl, "seconds_to_restored": round(took, 3)}
    finally:
        for r in replicas:
            r.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=128, help="simulated processes registering (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="failovers per lease TTL (default %(default)s)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EtcdCluster.start(3, tmp_path=Path(tmp)) as etcd:
        for result in registration(etcd, args.processes):
            print(json.dumps(result), flush=True)
        for ttl in (2, 5):
            for _ in range(args.repeats):
                print(json.dumps(failover(etcd, ttl)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
