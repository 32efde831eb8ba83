"""JAX start-up cost: from process start to a usable ``jax.sharding.Mesh`` with ``ifrt.jax.initialize()``, side
by side with a plain ``jax.distributed.initialize()`` given ids and a coordinator address by hand.

    .venv/bin/python bench/jax_startup.py [--processes 2,4,8] [--devices 2] [--repeat 5] [--kinds cold,warm]

For each N, the two ways alternate ``--repeat`` times; every run starts N fresh processes of ``--devices`` CPU
devices (gloo collectives) and ends when each holds a (2, N·devices/2) mesh over all devices. The ifrt
coordinator runs before the job starts (a daemon, like the job's launcher); JAX's own service starts inside
process 0's ``jax.distributed.initialize`` in both ways. Two kinds of run:

- cold: from process start to the mesh, imports included (what a job sees);
- warm: every process first imports what it needs (jax; ifrt.jax too in the ifrt way) and reports; the clock
  starts when the parent releases them all at once, so only the start-up protocol is timed, without the
  processes' imports competing for the cores.

Prints one JSON object per (kind, N, way), one with the differences per (kind, N), then one with the cost of
each way the ``jax`` plugin can list devices.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

SPAWN_ENV = "BENCH_SPAWNED_AT"  # wall-clock time.time() of the parent just before it started this process


def child(kind: str, way: str, process_id: int, num_processes: int, address: str) -> dict:
    """One process of a run: start JAX one way, build the mesh, report when (relative to its spawn, or to the
    parent's go for a warm run)."""
    spawned = float(os.environ[SPAWN_ENV])
    interpreter = time.time()
    import jax

    if way == "ifrt":
        import ifrt.jax

        jax_part = [0.0]  # seconds inside JAX's own start-up, to tell them from ifrt's share
        for owner, name in ((jax.distributed, "initialize"), (jax, "devices")):
            original = getattr(owner, name)

            def timed(*args, _original=original, **kwargs):
                began = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    jax_part[0] += time.perf_counter() - began

            setattr(owner, name, timed)
    imported = time.time()
    clock = spawned
    if kind == "warm":
        print("imported", flush=True)
        clock = float(sys.stdin.readline())  # the parent's go
    if way == "ifrt":
        began = time.perf_counter()
        topology = ifrt.jax.initialize(timeout=120)
        ifrt_share = time.perf_counter() - began - jax_part[0]
        mesh = ifrt.jax.mesh(topology.mesh((2, len(topology.devices) // 2), ("data", "model")))
    else:
        import numpy as np

        jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=120)
        devices = jax.devices()
        mesh = jax.sharding.Mesh(np.array(devices).reshape(2, len(devices) // 2), ("data", "model"))
        ifrt_share = 0.0
    ready = time.time()
    assert mesh.devices.size == len(jax.devices())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"interpreter_s": interpreter - spawned, "import_s": imported - interpreter, "to_mesh_s": ready - clock,
            "ifrt_share_s": ifrt_share, "cpu_s": usage.ru_utime + usage.ru_stime}


def run(kind: str, way: str, n: int, devices: int, coordinator: str | None) -> list[dict]:
    """N processes started one way; each one's timings."""
    with socket.socket() as s:  # JAX's service port for the plain way (ifrt picks its own)
        s.bind(("127.0.0.1", 0))
        jax_address = f"127.0.0.1:{s.getsockname()[1]}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
    base.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), OMP_NUM_THREADS="1")
    if coordinator:
        base["IFRT_COORDINATOR"] = coordinator
    children = []
    for rank in range(n):
        env = dict(base, IFRT_LOCAL_RANK=str(rank), **{SPAWN_ENV: repr(time.time())})
        children.append(subprocess.Popen([sys.executable, __file__, "--child", kind, way, str(rank), str(n),
                                          jax_address], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))
    if kind == "warm":
        for c in children:
            if c.stdout.readline().strip() != "imported":
                raise RuntimeError(f"{way} process {c.pid} did not report its imports:\n{c.communicate()[1][-2000:]}")
        go = f"{time.time()!r}\n"
        for c in children:
            c.stdin.write(go)
            c.stdin.flush()
    timings = []
    for c in children:
        out, err = c.communicate(timeout=300)
        if c.returncode != 0:
            raise RuntimeError(f"{way} process {c.pid} exited {c.returncode}:\n{err[-2000:]}")
        timings.append(json.loads(out.strip().splitlines()[-1]))
    return timings


def summarize(kind: str, way: str, n: int, devices: int, runs: list[list[dict]]) -> dict:
    """Medians over runs of: the slowest process's time to its mesh (when the job can compute), and per-process
    means of the rest."""
    def median_of(f) -> float:
        return round(statistics.median(f(r) for r in runs), 4)

    return {
        "kind": kind, "processes": n, "devices_per_process": devices, "way": way, "runs": len(runs),
        "job_ready_s": median_of(lambda r: max(t["to_mesh_s"] for t in r)),
        "process_to_mesh_s": median_of(lambda r: statistics.mean(t["to_mesh_s"] for t in r)),
        "interpreter_s": median_of(lambda r: statistics.mean(t["interpreter_s"] for t in r)),
        "import_s": median_of(lambda r: statistics.mean(t["import_s"] for t in r)),
        "ifrt_share_s": median_of(lambda r: statistics.mean(t["ifrt_share_s"] for t in r)),
        "cpu_per_process_s": median_of(lambda r: statistics.mean(t["cpu_s"] for t in r)),
    }


def listing_cost(devices: int, repeat: int) -> dict:
    """Milliseconds for the jax plugin to list this process's devices, from configuration and in a child."""
    os.environ.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    import jax  # noqa: F401  (imported before timing: every JAX process imports it anyway)

    from plugins import jax_plugin
    result = {"listing": "jax plugin", "devices": devices}
    for method in ("config", "child"):
        samples = []
        for _ in range(repeat):
            jax_plugin._child_listing.cache_clear()
            began = time.perf_counter()
            listed = jax_plugin.visible_devices(method)
            samples.append(time.perf_counter() - began)
            assert len(listed) == devices, (method, listed)
        result[f"{method}_ms"] = round(statistics.median(samples) * 1000, 3)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", default="2,4,8", help="process counts (default %(default)s)")
    p.add_argument("--devices", type=int, default=2, help="CPU devices per process (default %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="runs of each way per count (default %(default)s)")
    p.add_argument("--kinds", default="cold,warm", help="kinds of run (default %(default)s)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, way, pid, n, address = args.child
        print(json.dumps(child(kind, way, int(pid), int(n), address)), flush=True)
        return 0

    from coordinator.local import LocalCoordinator

    for kind in args.kinds.split(","):
        for n in (int(x) for x in args.processes.split(",")):
            runs: dict[str, list[list[dict]]] = {"jax": [], "ifrt": []}
            for _ in range(args.repeat):
                runs["jax"].append(run(kind, "jax", n, args.devices, None))
                with LocalCoordinator(num_processes=n, log_level="WARNING") as coordinator:
                    runs["ifrt"].append(run(kind, "ifrt", n, args.devices, coordinator.address))
            jax_only, ifrt = (summarize(kind, way, n, args.devices, runs[way]) for way in ("jax", "ifrt"))
            print(json.dumps(jax_only), flush=True)
            print(json.dumps(ifrt), flush=True)
            paired = [max(t["to_mesh_s"] for t in i) - max(t["to_mesh_s"] for t in j)
                      for i, j in zip(runs["ifrt"], runs["jax"], strict=True)]
            print(json.dumps({"kind": kind, "processes": n,
                              "ifrt_adds_job_ready_ms": round(statistics.median(paired) * 1000, 1),
                              "ifrt_adds_cpu_per_process_ms": round(
                                  (ifrt["cpu_per_process_s"] - jax_only["cpu_per_process_s"]) * 1000, 1),
                              "ifrt_share_ms": round(ifrt["ifrt_share_s"] * 1000, 1)}), flush=True)
    print(json.dumps(listing_cost(args.devices, args.repeat)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
