"""The partition suite, N runs per nemesis (bench/partition_nemeses.py): for each, the jobs ended that should have
survived, keys not linearizable, reads answered by a deposed leader, frames accepted from an old incarnation and
retries applied twice, summed over the runs (each should be 0), as one JSON object on stdout.

    .venv/bin/python bench/partitions.py [--runs 3] [--nemesis gray_leader ...] [--cut 7] [--keep DIR]

Needs root, iproute2, iptables and etcd (as tests/netns.py and tests/etcd_cluster.py say). Exits 1 when a count is
not 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from partition_nemeses import COUNTS, NEMESES, Timing, run_nemesis, say


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each count summed over ``runs`` (None where the nemesis does not measure it), and each run's report."""
    out: dict[str, Any] = {"runs": len(runs)}
    for k in COUNTS:
        values = [r.get(k) for r in runs if r.get(k) is not None]
        out[k] = sum(values) if values else None
    out["seconds_per_run"] = round(sum(r["seconds"] for r in runs) / max(1, len(runs)), 1)
    out["reports"] = runs
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="trials per nemesis (default %(default)s)")
    p.add_argument("--nemesis", action="append", choices=sorted(NEMESES), help="default: every one")
    p.add_argument("--leader-ttl", type=int, default=2)
    p.add_argument("--heartbeat-timeout", type=float, default=3.0)
    p.add_argument("--cut", type=float, default=7.0, help="seconds each cut holds (default %(default)s)")
    p.add_argument("--settle", type=float, default=4.0, help="seconds after a heal (default %(default)s)")
    p.add_argument("--failover-window", type=float, default=6.0,
                   help="the processes' IFRT_FAILOVER_WINDOW under etcd_minority (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", type=Path, help="keep the records and logs in this directory")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally clauses remove every rule and namespace
    names = args.nemesis or list(NEMESES)
    began = time.monotonic()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ifrt-partitions-") as scratch:
        tmp = args.keep or Path(scratch)
        for name in names:
            runs = []
            for i in range(args.runs):
                timing = Timing(leader_ttl=args.leader_ttl, heartbeat_timeout=args.heartbeat_timeout, cut=args.cut,
                                settle=args.settle, failover_window=args.failover_window, seed=args.seed + i)
                try:
                    runs.append(run_nemesis(name, tmp / f"{name}-{i}", timing))
                except Exception as e:  # a trial that could not run is reported, and the others go on
                    say(f"{name} run {i}: {type(e).__name__}: {e}"[:800])
                    runs.append({"nemesis": name, "error": f"{type(e).__name__}: {e}"[:800], "seconds": 0})
            result[name] = summary(runs)
    print(json.dumps({"measure": "partitions", "runs_per_nemesis": args.runs, "leader_ttl_s": args.leader_ttl,
                      "heartbeat_timeout_s": args.heartbeat_timeout, "cut_s": args.cut,
                      "seconds": round(time.monotonic() - began, 1), "nemeses": result}), flush=True)
    bad = any(s.get(k) for s in result.values() for k in COUNTS) or any(
        "error" in r for s in result.values() for r in s["reports"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
