"""Real ``ifrt run`` agents with real workers, ``--worker-link agent`` beside ``--worker-link direct`` in one run.

    .venv/bin/python bench/agents_real.py [--hosts 8] [--workers 4] [--repeats 3] [--settle 2] [--window 5]

Each run starts a fresh coordinator (``ifrt-coordinator``, its defaults, metrics on) and H agents on this machine,
``ifrt run --nproc-per-host W --host-rank h --num-hosts H --recover replace``, each worker
bench/agents_real_worker.py. The agents share this machine's hostname and loopback address and are told apart by
their host rank, as tests/test_run_host_link.py runs them. The modes alternate (agent, direct, agent, ...),
``--repeats`` runs each. Measured in each run, on CLOCK_MONOTONIC (``time.monotonic()``, one clock for every
process here):

- registration to topology: from just before the first agent starts to each worker holding the topology (its own
  timestamped line; its ``up`` and ``discover`` lines split off the interpreter's start and ifrt's import), and the
  coordinator's CPU (utime + stime of /proc/<pid>/stat, at nanoseconds) over the same span, over the registration
  window (from the first worker's ``discover`` line), and up to the steady state (``--settle`` seconds later);
  its idle CPU, read for a second before the agents start, is given apart and subtracted in ``..._less_idle_...``;
- the steady state: the coordinator's CPU over ``--window`` seconds with every session open and nothing happening
  (liveness only: keepalive pings every half heartbeat timeout); established TCP sockets to the coordinator's port
  (/proc/net/tcp), each owned by the agent or a worker of a host (its socket inode among /proc/<pid>/fd), per host;
  the coordinator's answered calls by method (its /metrics; streams count once they end, so these are the unary
  calls, long polls included: a Register or RegisterHost unanswered after its wait is called again);
- a killed worker's report: SIGKILL of process 1 (host 0, local rank 1) by its pid, then the time until each other
  worker printed ``ProcessFailed`` for it. ``--recover replace`` keeps the others running (with ``restart`` the
  agents would stop them), so the agent of host 0 starts a replacement meanwhile, in both modes.

Prints one JSON object: each run, and per mode the median with the runs' min and max. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liveness_readings import load_average, rss_mib
from proc_sockets import connections_to, sockets_of

from coordinator.local import LocalCoordinator

HERE = Path(__file__).resolve().parent
WORKER = HERE / "agents_real_worker.py"
IFRT = Path(sys.executable).parent / "ifrt"
MODES = ("agent", "direct")
VICTIM = 1
"""The process killed: host 0's local rank 1."""
TOPOLOGY_TIMEOUT_S = 300.0
FAILURE_TIMEOUT_S = 60.0
IDLE_WINDOW_S = 1.0
"""How long the coordinator's idle CPU is read before the agents start."""
LINE = re.compile(r"^\[(?:local )?(\d+)\] (up|discover|topology|event) (.*) at ([\d.]+)$")
"""A worker's line behind its agent's prefix (``[local R]`` until the agent knows the id; host ranks name it)."""


@dataclass
class Worker:
    """What one worker process (one pid) printed, times on CLOCK_MONOTONIC."""

    host: int
    process_id: int
    up: float | None = None
    discover: float | None = None
    topology: float | None = None
    fingerprint: str = ""
    via: str = ""
    failed: dict[int, float] = field(default_factory=dict)
    """The first ProcessFailed heard for each process id."""


class Agent:
    """One ``ifrt run`` in a child process; its workers' lines parsed as they come, by worker pid."""

    def __init__(self, host: int, hosts: int, workers: int, mode: str, env: dict[str, str],
                 seen: dict[int, Worker], lock: threading.Lock) -> None:
        self.host, self.seen, self.lock = host, seen, lock
        self.tail: list[str] = []
        self.process = subprocess.Popen(
            [str(IFRT), "run", "--nproc-per-host", str(workers), "--host-rank", str(host), "--num-hosts", str(hosts),
             "--worker-link", mode, "--recover", "replace", "--max-restarts", "2", "--grace-seconds", "1",
             "--", sys.executable, str(WORKER)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            line = line.rstrip("\n")
            self.tail = [*self.tail[-30:], line]
            if (m := LINE.match(line)) is None:
                continue
            process_id, kind, rest, at = int(m[1]), m[2], m[3], float(m[4])
            pid = int(re.search(r"\bpid (\d+)", rest)[1])  # type: ignore[index]
            with self.lock:
                w = self.seen.setdefault(pid, Worker(self.host, process_id))
                if kind in ("up", "discover"):
                    setattr(w, kind, at)
                elif kind == "topology":
                    fields = dict(re.findall(r"(\w+) (\S+)", rest))
                    w.topology, w.process_id = at, int(fields["process"])
                    w.fingerprint, w.via = fields["fingerprint"], fields["via"]
                elif rest.startswith("ProcessFailed "):
                    w.failed.setdefault(int(rest.split()[2]), at)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()  # its workers die with it (PR_SET_PDEATHSIG)
                self.process.wait()
        self.reader.join(5)


def progress(message: str) -> None:
    """A progress line on stderr."""
    print(f"[agents_real {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def wait_until(ready: Callable[[], bool], what: str, timeout: float, agents: list[Agent]) -> None:
    """Polls ``ready`` every 10 ms; TimeoutError with each agent's last lines after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tails = "\n".join(f"agent {a.host} (exit {a.process.poll()}):\n  " + "\n  ".join(a.tail[-8:])
                              for a in agents)
            raise TimeoutError(f"{what} not within {timeout}s\n{tails}")
        time.sleep(0.01)


def connections(port: int, agents: list[Agent], workers: dict[int, Worker]) -> dict[str, Any]:
    """Established connections to the coordinator in the steady state, by owner: per host, its agent's and its
    workers'; ``unattributed``: clients' ends owned by none of them (must be 0)."""
    clients, served = connections_to(port)
    per_host = [{"agent": len(sockets_of(a.process.pid) & clients), "workers": 0} for a in agents]
    attributed = set().union(*(sockets_of(a.process.pid) for a in agents))
    for pid, w in workers.items():
        mine = sockets_of(pid) & clients
        per_host[w.host]["workers"] += len(mine)
        attributed |= mine
    return {"per_host": per_host, "coordinator_side": served, "unattributed": len(clients - attributed)}


def free_port() -> int:
    """A loopback port free now (for the coordinator's metrics)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator_calls(metrics_port: int) -> dict[str, int]:
    """The coordinator's answered calls by method, off its /metrics (a stream counts once it ended)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    calls: dict[str, int] = {}
    for m in re.finditer(r'^ifrt_rpcs_total\{([^}]*)\} ([\d.e+]+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if labels.get("service") == "ifrt.topology.v1.Coordinator":
            calls[labels["method"]] = calls.get(labels["method"], 0) + int(float(m[2]))
    return dict(sorted(calls.items()))


def process_cpu_s(pid: int) -> float:
    """``pid``'s CPU time, every thread's (ended ones too): utime + stime of /proc/<pid>/stat, read at nanoseconds
    through the process's CPU clock (clock id ``(~pid << 3) | 2``, CPUCLOCK_SCHED of the whole process)."""
    return time.clock_gettime(((~pid) << 3) | 2)


def one_run(mode: str, hosts: int, per_host: int, settle_s: float, window_s: float) -> dict[str, Any]:
    """One job of ``hosts`` agents of ``per_host`` workers with ``--worker-link mode``, against its own coordinator:
    its measurements (the module's docstring)."""
    n = hosts * per_host
    metrics = free_port()
    with LocalCoordinator("--metrics-port", str(metrics), "--metrics-bind", "127.0.0.1", num_processes=n,
                          log_level="WARNING") as coordinator:
        port = int(coordinator.address.rsplit(":", 1)[1])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
        env.update(IFRT_COORDINATOR=coordinator.address, IFRT_CPU_DEVICE_COUNT="1")
        seen: dict[int, Worker] = {}
        lock = threading.Lock()
        load = load_average()
        idle0, i0 = process_cpu_s(coordinator.pid), time.monotonic()
        time.sleep(IDLE_WINDOW_S)  # the coordinator's own idle cost (its ticks), to tell apart from the job's
        cpu0, t0 = process_cpu_s(coordinator.pid), time.monotonic()
        idle_rate = (cpu0 - idle0) / (t0 - i0)
        agents = [Agent(h, hosts, per_host, mode, env, seen, lock) for h in range(hosts)]
        try:
            marks: dict[str, float] = {}

            def all_hold() -> bool:
                with lock:
                    if "first_discover" not in marks and any(w.discover is not None for w in seen.values()):
                        marks["first_discover"] = process_cpu_s(coordinator.pid)
                    return sum(w.topology is not None for w in seen.values()) == n
            wait_until(all_hold, f"{n} workers holding the topology", TOPOLOGY_TIMEOUT_S, agents)
            cpu1, t1 = process_cpu_s(coordinator.pid), time.monotonic()
            with lock:
                workers = dict(seen)
            time.sleep(settle_s)
            cpu2, t2 = process_cpu_s(coordinator.pid), time.monotonic()
            time.sleep(window_s)
            cpu3, t3 = process_cpu_s(coordinator.pid), time.monotonic()
            steady = connections(port, agents, workers)
            calls = coordinator_calls(metrics)
            rss = rss_mib(coordinator.pid)
            agents_cpu = sum(process_cpu_s(a.process.pid) for a in agents)
            workers_cpu = sum(process_cpu_s(pid) for pid in workers)
            victim = next(pid for pid, w in workers.items() if w.process_id == VICTIM)
            others = [w for pid, w in workers.items() if pid != victim]
            t_kill = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            try:
                wait_until(lambda: all(VICTIM in w.failed for w in others), f"{len(others)} workers hearing "
                           f"process {VICTIM} failed", FAILURE_TIMEOUT_S, agents)
            except TimeoutError as e:
                progress(str(e))
            heard = sorted(w.failed[VICTIM] - t_kill for w in others if VICTIM in w.failed)
        finally:
            for a in agents:
                a.process.send_signal(signal.SIGTERM)
            for a in agents:
                a.stop()
    tops = [w.topology for w in workers.values() if w.topology is not None]
    ups = [w.up for w in workers.values() if w.up is not None]
    discovers = [w.discover for w in workers.values() if w.discover is not None]
    ms = 1000 / n
    return {
        "mode": mode, "load_average_1m": round(load, 2),
        "start_to_all_topology_s": round(max(tops) - t0, 3),
        "start_to_topology_p50_s": round(statistics.median(tops) - t0, 3),
        "start_to_last_worker_up_s": round(max(ups) - t0, 3),
        "start_to_last_discover_s": round(max(discovers) - t0, 3),
        "first_discover_to_all_topology_s": round(max(tops) - min(discovers), 3),
        "last_discover_to_all_topology_s": round(max(tops) - max(discovers), 3),
        "coordinator_cpu_to_topology_s": round(cpu1 - cpu0, 4),
        "coordinator_cpu_to_topology_per_process_ms": round((cpu1 - cpu0) * ms, 3),
        "coordinator_cpu_registration_s": round(cpu1 - marks["first_discover"], 4),
        "coordinator_cpu_to_topology_less_idle_per_process_ms": round((cpu1 - cpu0 - idle_rate * (t1 - t0)) * ms, 3),
        "coordinator_idle_cpu_ms_per_s": round(idle_rate * 1000, 2),
        "coordinator_cpu_to_steady_s": round(cpu2 - cpu0, 4),
        "coordinator_cpu_settle_ms_per_s": round((cpu2 - cpu1) / (t2 - t1) * 1000, 2),
        "coordinator_cpu_steady_ms_per_s": round((cpu3 - cpu2) / (t3 - t2) * 1000, 2),
        "coordinator_rss_mib": round(rss, 1),
        "agents_cpu_s": round(agents_cpu, 3), "workers_cpu_s": round(workers_cpu, 3),
        "fingerprints": len({w.fingerprint for w in workers.values()}),
        "via": sorted({w.via for w in workers.values()}),
        "connections": steady, "coordinator_calls": calls,
        "failure_heard_by": len(heard), "failure_expected": len(others),
        "kill_to_all_heard_s": round(heard[-1], 4) if len(heard) == len(others) else None,
        "kill_to_heard_p50_s": round(statistics.median(heard), 4) if heard else None,
        "kill_to_first_heard_s": round(heard[0], 4) if heard else None,
    }


SUMMARIZED = ("start_to_all_topology_s", "start_to_topology_p50_s", "start_to_last_worker_up_s",
              "start_to_last_discover_s", "first_discover_to_all_topology_s", "last_discover_to_all_topology_s",
              "coordinator_cpu_to_topology_s", "coordinator_cpu_to_topology_per_process_ms",
              "coordinator_cpu_registration_s", "coordinator_cpu_to_topology_less_idle_per_process_ms",
              "coordinator_idle_cpu_ms_per_s", "coordinator_cpu_to_steady_s", "coordinator_cpu_settle_ms_per_s",
              "coordinator_cpu_steady_ms_per_s", "coordinator_rss_mib", "agents_cpu_s", "workers_cpu_s",
              "kill_to_all_heard_s", "kill_to_heard_p50_s")
"""The fields given per mode as median, min and max."""


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field: the median of the runs with their min and max; connections per host as the values seen."""
    out: dict[str, Any] = {}
    for key in SUMMARIZED:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = ({"median": round(statistics.median(values), 4), "min": min(values), "max": max(values)}
                    if values else None)
    hosts = [h for r in runs for h in r["connections"]["per_host"]]
    out["connections_per_host"] = {part: sorted({h[part] for h in hosts}) for part in ("agent", "workers")}
    out["connections_per_host"]["total"] = sorted({h["agent"] + h["workers"] for h in hosts})
    out["coordinator_connections"] = sorted({r["connections"]["coordinator_side"] for r in runs})
    methods = sorted({m for r in runs for m in r["coordinator_calls"]})
    out["coordinator_calls"] = {m: sorted({r["coordinator_calls"].get(m, 0) for r in runs}) for m in methods}
    out["failure_heard_by_all"] = all(r["failure_heard_by"] == r["failure_expected"] for r in runs)
    out["one_fingerprint"] = all(r["fingerprints"] == 1 for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=8,
                   help="agents, each a host of the job, all on this machine (default %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="workers per agent (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode (default %(default)s)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds from every worker holding the topology to the steady state (default %(default)s)")
    p.add_argument("--window", type=float, default=5.0,
                   help="seconds the steady state's coordinator CPU is read over (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="worker links, alternating (default %(default)s)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    runs = []
    for repeat in range(args.repeats):
        for mode in modes:
            progress(f"run {repeat + 1}/{args.repeats}, --worker-link {mode}: {args.hosts} x {args.workers}")
            runs.append(one_run(mode, args.hosts, args.workers, args.settle, args.window))
            progress(json.dumps(runs[-1]))
    result = {"hosts": args.hosts, "workers_per_host": args.workers, "processes": args.hosts * args.workers,
              "repeats": args.repeats, "cpus": os.cpu_count(), "victim": VICTIM,
              "modes": {m: summary([r for r in runs if r["mode"] == m]) for m in modes}, "runs": runs}
    print(json.dumps(result))
    return 0 if all(s["failure_heard_by_all"] and s["one_fingerprint"] for s in result["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
