"""JAX's own fault tolerance (``jax_enable_recoverability``, ``live_devices``) on ifrt and on plain
``jax.distributed``, side by side in one run: examples/jax_fault_tolerance.py on N CPU processes (gloo), one process
SIGKILLed once every process computed step 3, process 0 or the last one.

    .venv/bin/python bench/jax_recover.py [--processes 3,4] [--rounds 5] [--ways ifrt,jax] [--victims 0,last]
        [--collective-timeout 10]

- ``ifrt``: ``ifrt run --nproc-per-host N --recover replace`` against an ``ifrt-coordinator`` (default heartbeat);
  the agent reports its worker's death at once and starts a replacement, which the survivors take back healed.
Both ways run XLA's CPU collectives with ``--collective-timeout`` (in ``XLA_FLAGS``): in gloo's ring of 4 or more, a
survivor whose collective waits on a peer that left it, not on the dead process, gets its error only then.

- ``jax``: N processes started directly, ``jax.distributed.initialize`` with JAX's service in process 0 and the
  heartbeat timeout of JAX's example (10 s); nothing replaces the victim.

Per round: what each survivor did (``go on``: it computed a step after the kill; ``exit``: it ended, with its code;
``abort``: SIGABRT, JAX's C++ check; ``stuck``: neither), the time from the kill until a survivor's step failed
(``failed_s``) and until every survivor completed its next step (``stepped_again_s``), whether some step went on
without the victim (``without_victim``; else the survivors waited for its replacement), and for ifrt the time until
every process, the replacement included, completed one step over the whole job with the same weights
(``whole_again_s``).
Prints a JSON object with the machine, one per round, and one summary per cell.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.local import LocalCoordinator  # noqa: E402

BIN = Path(sys.executable).parent
EXAMPLE = ROOT / "examples" / "jax_fault_tolerance.py"
JAX_HEARTBEAT_S = 10
"""The heartbeat timeout JAX's own fault-tolerance example gives ``jax.distributed.initialize``."""
WATCH_S = 40.0
"""How long a round watches the survivors (and the replacement) after the kill."""
PLAIN_WORKER = """
import os, sys
sys.path.insert(0, {examples!r})
import jax
jax.config.update("jax_enable_recoverability", True)
import jax_fault_tolerance as example
example.train(lambda: jax.distributed.initialize(os.environ["JAX_ADDRESS"], int(os.environ["JAX_N"]),
                                                 int(os.environ["JAX_ID"]), heartbeat_timeout_seconds={heartbeat}),
              list)
"""


class Lines:
    """Every JSON line the processes printed, with when it came and who (an agent's ``[id] `` prefix, or given)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, dict]] = []
        self.lock = threading.Lock()

    def read(self, stream, process: int | None = None) -> None:
        for line in stream:
            m = re.match(r"^\[(\d+)\] (\{.*\})$", line.strip()) if process is None else None
            text = m.group(2) if m else line.strip()
            if not text.startswith("{"):
                continue
            try:
                row = json.loads(text)
            except ValueError:
                continue
            with self.lock:
                self.rows.append((time.monotonic(), int(m.group(1)) if m else process, row))

    def snapshot(self) -> list[tuple[float, int, dict]]:
        with self.lock:
            return list(self.rows)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(collective_timeout: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
    env.update(OMP_NUM_THREADS="1", INTERVAL="0.1",
               XLA_FLAGS=f"--xla_cpu_collective_timeout_seconds={collective_timeout}", **extra)
    return env


def wait(found, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (result := found()) is not None:
            return result
        time.sleep(0.01)
    return None


def one_round(way: str, n: int, victim: int, collective_timeout: int) -> dict:
    lines = Lines()
    procs: list[subprocess.Popen] = []
    coordinator = None
    try:
        if way == "ifrt":
            coordinator = LocalCoordinator("--max-restarts", "5", num_processes=n, log_level="WARNING").__enter__()
            agent = subprocess.Popen([str(BIN / "ifrt"), "run", "--nproc-per-host", str(n), "--recover", "replace",
                                      "--max-restarts", "5", "--grace-seconds", "1", "--",
                                      sys.executable, str(EXAMPLE)],
                                     env=env_for(collective_timeout, IFRT_COORDINATOR=coordinator.address,
                                                 IFRT_CPU_DEVICE_COUNT="1"),
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(agent)
            threading.Thread(target=lines.read, args=(agent.stdout,), daemon=True).start()
        else:
            address = f"127.0.0.1:{free_port()}"
            code = PLAIN_WORKER.format(examples=str(ROOT / "examples"), heartbeat=JAX_HEARTBEAT_S)
            for p in range(n):
                proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True,
                                        env=env_for(collective_timeout, JAX_ADDRESS=address, JAX_N=str(n),
                                                    JAX_ID=str(p)))
                procs.append(proc)
                threading.Thread(target=lines.read, args=(proc.stdout, p), daemon=True).start()
        pids = wait(lambda: (found if len(found := {r["started"]: r["pid"] for _, _, r in lines.snapshot()
                                                    if "started" in r}) == n else None), 120)
        assert pids is not None, f"{way}: not every process started"
        assert wait(lambda: True if {p for _, p, r in lines.snapshot() if r.get("step", -1) >= 3} == set(range(n))
                    else None, 120), f"{way}: not every process reached step 3"
        seen = len(lines.snapshot())
        killed = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        survivors = [p for p in range(n) if p != victim]

        def stepped_again() -> dict[int, float] | None:
            if way == "jax" and all(procs[p].poll() is not None for p in survivors):
                return {}  # every survivor ended: nothing to wait for
            first: dict[int, float] = {}
            for at, p, r in lines.snapshot()[seen:]:
                if p in survivors and "step" in r and at > killed:
                    first.setdefault(p, at - killed)
            return first if len(first) == len(survivors) else None

        def whole() -> float | None:
            by_step: dict[int, dict[int, tuple[float, str]]] = {}
            for at, p, r in lines.snapshot()[seen:]:
                if "step" in r and len(r["live"]) == n:
                    by_step.setdefault(r["step"], {})[p] = (at, r["weights"])
            for found in by_step.values():
                if len(found) == n and len({w for _, w in found.values()}) == 1:
                    return max(at for at, _ in found.values()) - killed
            return None

        first = wait(stepped_again, WATCH_S)
        failed = [at - killed for at, p, r in lines.snapshot()[seen:] if p in survivors and "failed" in r]
        back = wait(whole, WATCH_S) if way == "ifrt" and first is not None else None
        first = first or None
        outcome = {}
        for p in survivors:
            if first is not None:
                outcome[p] = "go on"
            elif way == "jax" and procs[p].poll() is not None:
                code = procs[p].returncode
                outcome[p] = "abort" if code == -signal.SIGABRT else f"exit {code}"
            else:
                outcome[p] = "stuck"
        return {"way": way, "processes": n, "victim": victim, "survivors": outcome,
                "failed_s": round(min(failed), 3) if failed else None,
                "stepped_again_s": None if first is None else round(max(first.values()), 3),
                "without_victim": any(victim not in r["live"] for _, p, r in lines.snapshot()[seen:] if "step" in r),
                "whole_again_s": None if back is None else round(back, 3)}
    finally:
        for proc in procs:  # the agent passes SIGTERM on, then kills its workers after its grace
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if way == "ifrt" else signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if coordinator is not None:
            coordinator.__exit__(None, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="3,4", help="process counts, comma-separated (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per cell (default %(default)s)")
    parser.add_argument("--ways", default="ifrt,jax", help="ifrt, jax or both (default %(default)s)")
    parser.add_argument("--victims", default="0,last", help="0, last or both (default %(default)s)")
    parser.add_argument("--collective-timeout", type=int, default=10,
                        help="XLA's CPU collective timeout in both ways, seconds (default %(default)s: ifrt.jax's in "
                             "recoverable mode; XLA's own is 30 minutes)")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}),
          flush=True)
    results = []
    for n in map(int, args.processes.split(",")):
        for victim_name in args.victims.split(","):
            victim = 0 if victim_name == "0" else n - 1
            for _ in range(args.rounds):
                for way in args.ways.split(","):  # alternating ways, so both see the same machine
                    result = one_round(way, n, victim, args.collective_timeout)
                    results.append(result)
                    print(json.dumps(result), flush=True)
    for key in sorted({(r["way"], r["processes"], r["victim"]) for r in results}):
        cell = [r for r in results if (r["way"], r["processes"], r["victim"]) == key]
        again = [r["stepped_again_s"] for r in cell if r["stepped_again_s"] is not None]
        whole = [r["whole_again_s"] for r in cell if r["whole_again_s"] is not None]
        print(json.dumps({"summary": dict(zip(("way", "processes", "victim"), key, strict=True)),
                          "rounds": len(cell),
                          "every_survivor_went_on": sum(set(r["survivors"].values()) == {"go on"} for r in cell),
                          "outcomes": sorted({o for r in cell for o in r["survivors"].values()}),
                          "stepped_again_s": {"median": statistics.median(again), "max": max(again)} if again else None,
                          "rounds_without_victim": sum(r["without_victim"] for r in cell),
                          "whole_again_s": {"median": statistics.median(whole), "max": max(whole)} if whole else None}),
              flush=True)


if __name__ == "__main__":
    main()
