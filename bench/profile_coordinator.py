"""Where the coordinator's CPU goes during discovery: py-spy attached to the real daemon for one scale run.

    .venv/bin/pip install py-spy   # not a project dependency
    .venv/bin/python bench/profile_coordinator.py --processes 4096 --devices 8

Runs one `bench/discovery.py` configuration (ifrt only) with `py-spy record` sampling the coordinator, then prints
one JSON object: the run's record (wall, CPU, ...) and the functions with the largest share of the non-idle
samples, by self time and including callees. Samples in epoll/select are idle and left out. py-spy slows the
coordinator down, so read shares, not times. `--raw PATH` keeps py-spy's collapsed stacks; `--native` adds C
frames (gRPC's core, libc), so the shares then split Python from the C underneath it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import content
import discovery

from coordinator.local import LocalCoordinator

IDLE = ("epoll_wait", "select (", "poll (")
"""Leaf frames that mean the coordinator was waiting, not working."""


def shares(collapsed: Path, top: int) -> dict[str, list[tuple[str, float]]]:
    """The ``top`` functions by share (%) of non-idle samples, self and inclusive, from py-spy's raw output."""
    own, inclusive, total = Counter[str](), Counter[str](), 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.rsplit(":", 1)[0] + ")" if ":" in f else f for f in stack.split(";")]  # function, not line
        if not frames or any(idle in frames[-1] for idle in IDLE):
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    def ranked(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / max(total, 1), 1)) for name, n in counter.most_common(top)]
    return {"self": ranked(own), "inclusive": ranked(inclusive), "samples": total}  # type: ignore[dict-item]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=4096, help="N (default %(default)s)")
    p.add_argument("--devices", type=int, default=8, help="K (default %(default)s)")
    p.add_argument("--drivers", type=int, default=2, help="driver processes (default %(default)s)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default %(default)s)")
    p.add_argument("--top", type=int, default=25, help="functions listed (default %(default)s)")
    p.add_argument("--raw", type=Path, help="also keep py-spy's collapsed stacks here")
    p.add_argument("--native", action="store_true",
                   help="sample C frames too (gRPC's Cython core, libc); py-spy then pauses the coordinator per sample")
    content.add_arguments(p)
    args = p.parse_args()
    spy_binary = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy_binary is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    if problem := discovery.raise_fd_limit(args.processes + discovery.FD_MARGIN):
        print(problem, file=sys.stderr)
        return 2
    n, k = args.processes, args.devices
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.raw or Path(tmp) / "stacks.txt"
        with LocalCoordinator(num_processes=n, log_level="WARNING") as coordinator:
            spy = subprocess.Popen([spy_binary, "record", "--pid", str(coordinator.pid), "--rate", str(args.rate),
                                    "--format", "raw", "--output", str(raw),
                                    *(["--native"] if args.native else ["--nonblocking"])],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
            commands = [[sys.executable, str(discovery.IFRT_DRIVER), "--address", coordinator.address,
                         "--first", str(first), "--count", str(count), "--num-processes", str(n), "--devices", str(k),
                         "--timeout", str(discovery.run_timeout(n) - 10), *content.driver_arguments(args)]
                        for first, count in discovery.split(n, args.drivers)]
            port = int(coordinator.address.rpartition(":")[2])
            measured = discovery.drive(coordinator.pid, port, commands, Path(tmp), discovery.run_timeout(n))
            record = discovery.summarize("ifrt", n, k, measured)
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            spy.wait(timeout=60)
        record["profile"] = shares(raw, args.top)
    print(json.dumps(record))
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
