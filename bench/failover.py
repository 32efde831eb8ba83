"""The cost of keeping the coordinator's state in etcd, and how long a failover takes.

    .venv/bin/python bench/failover.py [--processes 128] [--rounds 3] [--repeats 3] [--etcd-members 3]

Needs Debian's etcd-server (started here on free loopback ports, fsync on, data on the same disk and cores as
everything else). Prints one JSON object per measurement:

- ``registration``: N simulated processes (grpc.aio, one channel each) register at once; wall time until all
  hold the topology, with ``--store memory`` and ``--store etcd`` side by side, alternating for ``--rounds``
  rounds (every registration is durable in etcd before it is answered, written in batches). Each line also has
  the coordinator's CPU, etcd's (all members), and how many journal appends (etcd transactions) it took;
  ``registration_summary`` gives the medians and the etcd/memory ratio of wall time.
- ``failover``: two replicas on etcd and three live clients; SIGKILL to the leader; time until the clients'
  sessions are attached to the new leader (``CoordinatorRestored``), for two leader lease TTLs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ifrt
from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt.client_config import CHANNEL_OPTIONS
from tests.etcd_cluster import EtcdCluster
from tests.helpers import free_ports

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


def cpu_seconds(pid: int) -> float:
    """User and system CPU of ``pid``, all its threads, in seconds (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def journal_appends(metrics_port: int) -> int:
    """How many journal appends the coordinator made (its ``ifrt_journal_append_seconds`` count)."""
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("ifrt_journal_append_seconds_count"):
                return int(float(line.split()[-1]))
    raise RuntimeError("the coordinator reports no ifrt_journal_append_seconds_count")


def register_once(etcd: EtcdCluster, store: str, n: int) -> dict:
    """One registration of ``n`` processes against a fresh coordinator on ``store`` (memory or etcd's URL)."""
    (metrics_port,) = free_ports(1)
    with LocalCoordinator("--store", store, "--cluster-id", f"bench-{uuid.uuid4().hex[:8]}",
                          "--metrics-port", str(metrics_port), "--metrics-bind", "127.0.0.1",
                          num_processes=n) as coordinator:
        coordinator.wait_for_log("serving:")
        etcd_pids = [pid for i in range(etcd.size) if (pid := etcd.pid(i)) is not None]
        coordinator_cpu, etcd_cpu = cpu_seconds(coordinator.pid), sum(map(cpu_seconds, etcd_pids))
        seconds = asyncio.run(register_all(coordinator.address, n))
        coordinator_cpu = cpu_seconds(coordinator.pid) - coordinator_cpu
        etcd_cpu = sum(map(cpu_seconds, etcd_pids)) - etcd_cpu
        appends = journal_appends(metrics_port)
    return {"measure": "registration", "store": store.split(":")[0], "processes": n, "seconds": round(seconds, 3),
            "ms_per_process": round(1000 * seconds / n, 3), "coordinator_cpu_s": round(coordinator_cpu, 2),
            "etcd_cpu_s": round(etcd_cpu, 2), "journal_appends": appends}


def registration(etcd: EtcdCluster, n: int, rounds: int) -> Iterator[dict]:
    """``rounds`` rounds of memory then etcd, each as it is measured, then a summary of medians (the machine may
    be noisy)."""
    results = []
    for _ in range(rounds):
        for store in ("memory", etcd.url):
            results.append(register_once(etcd, store, n))
            yield results[-1]
    summary: dict = {"measure": "registration_summary", "processes": n, "rounds": rounds,
                     "etcd_members": etcd.size}
    for store in ("memory", "etcd"):
        mine = [r for r in results if r["store"] == store]
        for key in ("seconds", "coordinator_cpu_s", "etcd_cpu_s", "journal_appends"):
            summary[f"{store}_{key}"] = round(statistics.median(r[key] for r in mine), 3)
    summary["etcd_over_memory"] = round(summary["etcd_seconds"] / summary["memory_seconds"], 2)
    summary["etcd_over_memory_by_round"] = [round(e["seconds"] / m["seconds"], 2)
                                            for m, e in zip(results[::2], results[1::2], strict=True)]
    yield summary


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
    p.add_argument("--rounds", type=int, default=3, help="registrations per store, alternating (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="failovers per lease TTL (default %(default)s)")
    p.add_argument("--etcd-members", type=int, choices=(1, 3), default=3, help="etcd cluster size (default 3)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EtcdCluster.start(args.etcd_members, tmp_path=Path(tmp)) as etcd:
        for result in registration(etcd, args.processes, args.rounds):
            print(json.dumps(result), flush=True)
        for ttl in (2, 5):
            for _ in range(args.repeats):
                print(json.dumps(failover(etcd, ttl)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
