"""Connections per host: the TCP connections to the coordinator's port that each host's processes hold during a real
start-up of 2 hosts x 2 workers on loopback (torch: tests/torch_worker.py, ``ifrt.torch.init_process_group`` and its
collectives; JAX: tests/jax_worker.py ``mesh``, ``ifrt.jax.initialize`` and a sharded matmul), by how the workers
reach the coordinator:

- agent: ``ifrt run`` (``--worker-link agent``, the default), each worker through its agent's socket;
- direct: ``ifrt run --worker-link direct``, each worker on its own connection, beside its agent's;
- none: the workers alone, no agent (two local ranks counted as each host).

    .venv/bin/python bench/connections_per_host.py [--runtimes torch,jax] [--links agent,direct,none]

Sockets are read off ``/proc/net/tcp`` and ``/proc/net/tcp6`` (the client ends of established connections to the
coordinator's port) and attributed to processes by ``/proc/<pid>/fd``, every ``--interval`` seconds from the start
until every process has exited. One JSON object per (runtime, link): for each host the most connections open at once
and the distinct connections opened over the run, and the same split by its agent and its workers; ``coordinator``:
the most established connections the coordinator's port held at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proc_sockets import connections_to, sockets_of  # noqa: E402

from coordinator.local import LocalCoordinator  # noqa: E402

WORKERS = {"torch": [str(ROOT / "tests" / "torch_worker.py")], "jax": [str(ROOT / "tests" / "jax_worker.py"), "mesh"]}
HOSTS, PER_HOST = 2, 2
TIMEOUT_S = 300.0


def runtime_env(runtime: str, address: str) -> dict[str, str]:
    """What tests/test_torch.py and tests/workers.py give their workers, less any IFRT_ setting but the coordinator."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("IFRT_", "JAX_", "XLA_", "GLOO_", "NCCL_", "MASTER_"))}
    env.update(IFRT_COORDINATOR=address, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if runtime == "torch":
        env["IFRT_CPU_DEVICE_COUNT"] = "1"
    else:
        env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return env


def children() -> dict[int, list[int]]:
    """Every process's children, by pid (from each process's parent in ``/proc/<pid>/stat``)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(parent, []).append(int(name))
    return tree


def descendants(pid: int, tree: dict[int, list[int]]) -> list[int]:
    found, todo = [], list(tree.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(tree.get(child, ()))
    return found


class Tally:
    """One role's connections (a host's agent, its workers, or the host): the most at once, and every one seen."""

    def __init__(self) -> None:
        self.peak, self.seen = 0, set()

    def add(self, inodes: set[int]) -> None:
        self.peak = max(self.peak, len(inodes))
        self.seen |= inodes

    def record(self) -> dict[str, int]:
        return {"peak": self.peak, "opened": len(self.seen)}


def start_hosts(runtime: str, link: str, address: str, log: IO[bytes]) -> list[subprocess.Popen]:
    """The root processes: each host's ``ifrt run`` agent, or (``none``) every worker, host by host; their output
    goes to ``log``."""
    env = runtime_env(runtime, address)
    command = [sys.executable, *WORKERS[runtime]]
    if link == "none":
        return [subprocess.Popen(command, env={**env, "IFRT_LOCAL_RANK": str(rank)}, stdout=log, stderr=log)
                for rank in range(HOSTS * PER_HOST)]
    ifrt = str(Path(sys.executable).with_name("ifrt"))
    return [subprocess.Popen([ifrt, "run", "--nproc-per-host", str(PER_HOST), "--host-rank", str(host), "--num-hosts",
                              str(HOSTS), "--worker-link", link, "--grace-seconds", "1", "--", *command], env=env,
                             stdout=log, stderr=log) for host in range(HOSTS)]


def measure(runtime: str, link: str, interval: float) -> dict:
    """One start-up, sampled until every process of it has exited."""
    with LocalCoordinator(num_processes=HOSTS * PER_HOST, log_level="WARNING") as coordinator, \
            tempfile.TemporaryFile() as log:
        port = int(coordinator.address.rsplit(":", 1)[1])
        began = time.monotonic()
        roots = start_hosts(runtime, link, coordinator.address, log)
        agents = link != "none"
        hosts = [{"host": Tally(), "agent": Tally(), "workers": Tally()} for _ in range(HOSTS)]
        served_peak, samples = 0, 0
        while any(p.poll() is None for p in roots):
            if time.monotonic() - began > TIMEOUT_S:
                for p in roots:
                    p.kill()
                raise SystemExit(f"{runtime}/{link}: still running after {TIMEOUT_S:g}s")
            clients, served = connections_to(port)
            tree = children()
            for h, tally in enumerate(hosts):
                if agents:
                    agent = roots[h].pid
                    mine = {"agent": sockets_of(agent) & clients, "workers": set()}
                    for pid in descendants(agent, tree):  # a worker between fork and exec holds its agent's too
                        mine["workers"] |= (sockets_of(pid) & clients) - mine["agent"]
                else:
                    mine = {"agent": set(), "workers": set()}
                    for p in roots[h * PER_HOST:(h + 1) * PER_HOST]:
                        for pid in (p.pid, *descendants(p.pid, tree)):
                            mine["workers"] |= sockets_of(pid) & clients
                tally["agent"].add(mine["agent"])
                tally["workers"].add(mine["workers"])
                tally["host"].add(mine["agent"] | mine["workers"])
            served_peak, samples = max(served_peak, served), samples + 1
            time.sleep(interval)
        failed = {p.pid: p.returncode for p in roots if p.returncode != 0}
        if failed:
            log.seek(0)
            output = log.read()[-4000:].decode(errors="replace")
            raise SystemExit(f"{runtime}/{link}: processes failed {failed}\n{output}")
        return {"runtime": runtime, "link": link, "hosts": HOSTS, "workers_per_host": PER_HOST,
                "per_host": [{"host": h, **t["host"].record(), "agent": t["agent"].record(),
                              "workers": t["workers"].record()} for h, t in enumerate(hosts)],
                "coordinator_peak": served_peak, "seconds": round(time.monotonic() - began, 1), "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtimes", default="torch,jax", help="torch and/or jax (default both)")
    parser.add_argument("--links", default="agent,direct,none", help="agent, direct and/or none (default all)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between samples (default 0.02)")
    args = parser.parse_args()
    for runtime in args.runtimes.split(","):
        for link in args.links.split(","):
            print(json.dumps(measure(runtime, link, args.interval)), flush=True)


if __name__ == "__main__":
    main()
