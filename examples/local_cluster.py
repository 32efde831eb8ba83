"""A local cluster on loopback: one coordinator and N processes, each discovering the same topology.

    python examples/local_cluster.py --processes 4 --devices 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from coordinator.local import LocalCoordinator
from ifrt import render
from ifrt.topology import Topology

WORKER = Path(__file__).with_name("worker.py")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4, help="how many processes (default %(default)s)")
    p.add_argument("--devices", type=int, default=2, help="CPU devices per process (default %(default)s)")
    args = p.parse_args()

    with LocalCoordinator(num_processes=args.processes, log_level="WARNING") as coordinator:
        print(f"coordinator listening on {coordinator.address} (pid {coordinator.pid})")
        workers = []
        for process_id in range(args.processes):
            env = dict(os.environ, IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID=str(process_id),
                       IFRT_NUM_PROCESSES=str(args.processes), IFRT_CPU_DEVICE_COUNT=str(args.devices))
            workers.append(subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE, text=True))
        outputs = [w.communicate(timeout=120)[0] for w in workers]
        failed = [i for i, w in enumerate(workers) if w.returncode != 0]
        if failed:
            print(f"processes {failed} failed; coordinator log:\n{coordinator.log}", file=sys.stderr)
            return 1

    topologies = [Topology.from_json(out) for out in outputs]
    first = topologies[0]
    print(render.summary(first))
    print(render.table(first))
    print()
    for t in topologies:
        print(f"process {t.process_id}: {len(t.local_devices)} local devices, fingerprint {t.fingerprint[:16]}...")
    if len({t.canonical_bytes for t in topologies}) != 1:
        print("MISMATCH: the processes hold different topologies", file=sys.stderr)
        return 1
    print(f"all {len(topologies)} processes hold the same topology (generation {first.generation}, "
          f"fingerprint {first.fingerprint[:16]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
