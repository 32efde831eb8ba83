"""What the status page costs at scale: bytes of the page and its SVG, and the time to build them, for N processes.

    .venv/bin/python bench/status_page.py --processes 16384 --devices 8 --per-host 1

Builds the view the coordinator's page draws (what ``ifrt status --json`` gives, plus each process's slice, device
global ids and default mesh order from real ``ifrt.records.Device`` records) with one process failed, one missing
and 1 % slow, then times, best of ``--repeat``: reading a Status answer into the view (``ifrt.status_view.to_dict``,
on the coordinator's event loop at every refresh), the per-generation topology extras (cached by the coordinator, so
paid once per generation), merging them into a view, the SVG, and the whole page (paid at every refresh). Prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from coordinator.core.status_page import fragment, page
from ifrt import status_svg, status_view
from ifrt._generated import coordinator_pb2 as pb
from ifrt.records import Device


def view_of(processes: int, per_host: int, slice_hosts: int) -> dict[str, Any]:
    """The status view of a published cluster: process 7 failed, the last one missing, every 100th slow."""
    procs = []
    for i in range(processes - 1):
        failed = i == 7
        procs.append({"process_id": i, "host": f"host-{i // per_host:05d}", "host_address": f"10.{i >> 16 & 255}."
                      f"{i >> 8 & 255}.{i & 255}", "local_rank": i % per_host, "address": f"10.0.0.1:{20000 + i}",
                      "devices": 0, "state": "failed" if failed else "alive",
                      "reason": "lost its connection and did not come back within 1.25s" if failed else "",
                      "incarnation": 0, "heartbeat_age_s": 7.5 if i % 100 == 99 else 0.4, "attached": not failed})
    return {"cluster_id": "bench", "state": "degraded", "generation": 1, "fingerprint": "ab" * 32,
            "registered": processes - 1, "expected": processes, "missing": [processes - 1], "missing_count": 1,
            "failed": [], "processes": procs, "leader": "10.0.0.1:8476", "replica": "10.0.0.1:8476",
            "store": "memory", "reason": None, "waited_s": 0.0, "time_to_publish_s": 30.0, "sessions_open": 0,
            "heartbeat_timeout_s": 10.0, "replicas": [{"address": "10.0.0.1:8476", "role": "leader"}], "attempt": 0}


def best(repeat: int, work: Callable[[], Any]) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=16384)
    p.add_argument("--devices", type=int, default=8, help="devices per process")
    p.add_argument("--per-host", type=int, default=1, help="processes per host")
    p.add_argument("--slice-hosts", type=int, default=64, help="hosts per slice")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    view = view_of(args.processes, args.per_host, args.slice_hosts)
    devices = [Device(pid << 17 | d, pid, d, "tpu", "TPU v4", (pid // args.per_host) // args.slice_hosts)
               for pid in range(args.processes - 1) for d in range(args.devices)]
    hostnames = {pid: f"host-{pid // args.per_host:05d}" for pid in range(args.processes - 1)}
    extras_s, extras = best(args.repeat, lambda: status_svg.topology_extras(devices, hostnames))
    merge_s, full = best(args.repeat, lambda: status_svg.with_extras(view, extras))
    answer = pb.StatusResponse(processes=[pb.ProcessStatus(process_id=p["process_id"], hostname=p["host"],
                                                           host_address=p["host_address"], devices=args.devices,
                                                           phase=pb.PROCESS_PHASE_ALIVE)
                                          for p in view["processes"]]).SerializeToString()
    read_s, _ = best(args.repeat, lambda: status_view.to_dict(pb.StatusResponse.FromString(answer)))
    svg_s, picture = best(args.repeat, lambda: status_svg.svg(full))
    fragment_s, part = best(args.repeat, lambda: fragment(full))
    page_s, whole = best(args.repeat, lambda: page(full))
    print(json.dumps({
        "processes": args.processes, "devices": args.processes * args.devices, "per_host": args.per_host,
        "svg_bytes": len(picture.encode()), "fragment_bytes": len(part.encode()), "page_bytes": len(whole.encode()),
        "json_bytes": len(json.dumps(full).encode()),
        "status_to_dict_s": round(read_s, 4), "topology_extras_s": round(extras_s, 4), "merge_s": round(merge_s, 4),
        "svg_s": round(svg_s, 4),
        "fragment_s": round(fragment_s, 4), "page_s": round(page_s, 4)}))


if __name__ == "__main__":
    main()
