"""PyTorch start-up cost: from the job's start to a usable process group (the first ``all_reduce`` done) in every
process, four ways side by side, N processes on loopback (gloo):

- tcpstore: plain ``torch.distributed.init_process_group("gloo", init_method="env://")`` with ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set by hand; rank 0 hosts the TCPStore;
- ifrt: ``ifrt.torch.init_process_group()`` against a coordinator that already serves;
- torchrun-c10d / torchrun-ifrt: ``torchrun --rdzv-backend c10d`` (its store in one agent) and
  ``--rdzv-backend ifrt`` (against a coordinator that already serves), N / ``--per-agent`` agents of
  ``--per-agent`` workers each; the workers call plain ``torch.distributed.init_process_group("gloo")``.

    .venv/bin/python bench/torch_startup.py [--processes 2,4,8] [--repeat 3] [--ways tcpstore,ifrt,...]

For each N the ways alternate ``--repeat`` times; the clock stops in each worker when its first ``all_reduce``
returns. Two kinds of run:

- cold: the clock starts just before the parent starts the job's first process (or agent): imports included;
- warm (tcpstore and ifrt only: torchrun starts its workers itself): every process first imports what it needs
  and reports; the clock starts when the parent releases them all at once, so only the start-up is timed.

Imports are also timed inside each worker, and once in an idle process; in the ifrt way, the time inside
``ifrt.torch.init_process_group`` outside torch's own ``init_process_group`` is its ifrt share, and its unary calls
to the coordinator are counted (the live session's stream is not a call). Prints one JSON
object per (kind, N, way), one with the paired differences per (kind, N), then one with the import costs.
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
import tempfile
import time
from pathlib import Path

SPAWN_ENV = "BENCH_STARTED_AT"  # wall-clock time.time() of the parent just before it started the job
OUT_ENV = "BENCH_OUT"  # the directory where each worker writes its timings, as <rank>.json
WAYS = ("tcpstore", "ifrt", "torchrun-c10d", "torchrun-ifrt")
PAIRS = (("ifrt", "tcpstore"), ("torchrun-ifrt", "torchrun-c10d"))
"""(way, baseline): each run of the way against the baseline's run just before it."""


def worker(kind: str, way: str) -> None:
    """One process of the job: import, start the process group one way, all_reduce once, report when."""
    started = float(os.environ[SPAWN_ENV])
    interpreter = time.time()
    import torch
    import torch.distributed as dist

    torch_part = [0.0]  # seconds inside torch's own init_process_group, to tell them from ifrt's share
    calls: list[str] = []  # the ifrt way's calls to the coordinator (every unary call goes through Connection.call)
    if way == "ifrt":
        import ifrt.torch
        from ifrt.connection import Connection

        call = Connection.call

        def counted(self, method, *args, **kwargs):
            calls.append(method)
            return call(self, method, *args, **kwargs)

        Connection.call = counted
        original = dist.init_process_group

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                torch_part[0] += time.perf_counter() - began

        dist.init_process_group = timed
    imported = time.time()
    interpreter_s, import_s = interpreter - started, imported - interpreter
    if kind == "warm":
        print("imported", flush=True)
        started = imported = float(sys.stdin.readline())  # the parent's go
    if way == "ifrt":
        began = time.perf_counter()
        ifrt.torch.init_process_group(timeout=120)
        ifrt_share = time.perf_counter() - began - torch_part[0]
    else:  # tcpstore: the environment set by hand; torchrun-*: set by torchrun's agent
        dist.init_process_group("gloo", init_method="env://")
        ifrt_share = 0.0
    total = torch.ones(1)
    dist.all_reduce(total)
    ready = time.time()
    if total.item() != dist.get_world_size():
        raise RuntimeError(f"all_reduce of ones gave {total.item()}, expected {dist.get_world_size()}")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    timings = {"rank": dist.get_rank(), "interpreter_s": interpreter_s, "import_s": import_s,
               "init_s": ready - imported, "to_group_s": ready - started, "ifrt_share_s": ifrt_share,
               "cpu_s": usage.ru_utime + usage.ru_stime, "calls": len(calls)}
    Path(os.environ[OUT_ENV], f"{dist.get_rank()}.json").write_text(json.dumps(timings))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(kind: str, way: str, n: int, per_agent: int, coordinator: str | None, attempt: str) -> list[dict]:
    """One start of N processes one way; each worker's timings."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("IFRT_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC_"))}
    base.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    if coordinator:
        base["IFRT_COORDINATOR"] = coordinator
    with tempfile.TemporaryDirectory() as out:
        base[OUT_ENV] = out
        commands: list[tuple[list[str], dict[str, str]]] = []
        script = [__file__, "--worker", kind, way]
        if way.startswith("torchrun-"):
            endpoint = coordinator if way == "torchrun-ifrt" else f"127.0.0.1:{free_port()}"
            agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n // per_agent),
                     "--nproc-per-node", str(per_agent), "--rdzv-backend", way.removeprefix("torchrun-"),
                     "--rdzv-endpoint", endpoint, "--rdzv-id", attempt, "--max-restarts", "0",
                     "--monitor-interval", "0.1", *script]
            commands = [(agent, dict(base)) for _ in range(n // per_agent)]
        else:
            port = free_port()
            for rank in range(n):
                env = dict(base, IFRT_LOCAL_RANK=str(rank)) if way == "ifrt" else dict(
                    base, RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                commands.append(([sys.executable, *script], env))
        started = repr(time.time())
        pipe = subprocess.PIPE if kind == "warm" else subprocess.DEVNULL
        processes = [subprocess.Popen(command, env=dict(env, **{SPAWN_ENV: started}), stdin=pipe, stdout=pipe,
                                      stderr=subprocess.PIPE, text=True) for command, env in commands]
        if kind == "warm":
            for p in processes:
                if p.stdout.readline().strip() != "imported":
                    raise RuntimeError(f"{way} process {p.pid} did not report its imports:\n"
                                       f"{p.communicate()[1][-3000:]}")
            go = f"{time.time()!r}\n"
            for p in processes:
                p.stdin.write(go)
                p.stdin.flush()
        for p in processes:
            _, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"{way} process {p.pid} exited {p.returncode}:\n{err[-3000:]}")
        timings = [json.loads(f.read_text()) for f in sorted(Path(out).glob("*.json"))]
    if sorted(t["rank"] for t in timings) != list(range(n)):
        raise RuntimeError(f"{way}: ranks {sorted(t['rank'] for t in timings)} reported, expected 0..{n - 1}")
    return timings


def summarize(kind: str, way: str, n: int, runs: list[list[dict]]) -> dict:
    """Medians over runs of: the slowest worker's time to its group (when the job can compute), and per-worker
    means of the rest."""
    def median_of(f) -> float:
        return round(statistics.median(f(r) for r in runs), 4)

    return {
        "kind": kind, "processes": n, "way": way, "runs": len(runs),
        "job_ready_s": median_of(lambda r: max(t["to_group_s"] for t in r)),
        "interpreter_s": median_of(lambda r: statistics.mean(t["interpreter_s"] for t in r)),
        "import_s": median_of(lambda r: statistics.mean(t["import_s"] for t in r)),
        "init_s": median_of(lambda r: statistics.mean(t["init_s"] for t in r)),
        "ifrt_share_s": median_of(lambda r: statistics.mean(t["ifrt_share_s"] for t in r)),
        "cpu_per_worker_s": median_of(lambda r: statistics.mean(t["cpu_s"] for t in r)),
        "coordinator_calls_per_worker": median_of(lambda r: statistics.mean(t["calls"] for t in r)),
    }


def import_costs(repeat: int, ways: list[str]) -> dict:
    """Seconds to import torch.distributed, and then ifrt.torch, in an idle fresh process (median of runs)."""
    with_ifrt = "ifrt" in ways
    code = ("import time; t = time.perf_counter(); import torch, torch.distributed; u = time.perf_counter(); "
            + ("import ifrt.torch; " if with_ifrt else "") + "print(u - t, time.perf_counter() - u)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    samples = []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        samples.append([float(x) for x in out])
    result = {"imports": "idle process", "torch_distributed_s": round(statistics.median(s[0] for s in samples), 4)}
    if with_ifrt:
        result["ifrt_torch_after_torch_s"] = round(statistics.median(s[1] for s in samples), 4)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", default="2,4,8", help="process counts (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each way per count (default %(default)s)")
    p.add_argument("--ways", default=",".join(WAYS), help="ways to start (default %(default)s)")
    p.add_argument("--kinds", default="cold,warm", help="kinds of run (default %(default)s)")
    p.add_argument("--per-agent", type=int, default=2, help="workers per torchrun agent (default %(default)s)")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    ways = args.ways.split(",")
    if unknown := sorted(set(ways) - set(WAYS)):
        p.error(f"unknown ways {unknown}: expected some of {','.join(WAYS)}")
    counts = [int(x) for x in args.processes.split(",")]
    if uneven := [n for n in counts if n % args.per_agent]:
        p.error(f"--processes {uneven} do not split into agents of --per-agent {args.per_agent}")

    from coordinator.local import LocalCoordinator

    for kind, n in ((kind, n) for kind in args.kinds.split(",") for n in counts):
        timed = [way for way in ways if kind == "cold" or not way.startswith("torchrun-")]
        runs: dict[str, list[list[dict]]] = {way: [] for way in timed}
        for attempt in range(args.repeat):
            for way in timed:
                rdzv_id = f"bench-{kind}-{n}-{attempt}"
                if way in ("ifrt", "torchrun-ifrt"):
                    with LocalCoordinator(num_processes=n, log_level="WARNING") as coordinator:
                        runs[way].append(run(kind, way, n, args.per_agent, coordinator.address, rdzv_id))
                else:
                    runs[way].append(run(kind, way, n, args.per_agent, None, rdzv_id))
        for way in timed:
            print(json.dumps(summarize(kind, way, n, runs[way])), flush=True)
        differences: dict[str, object] = {"kind": kind, "processes": n}
        for way, baseline in PAIRS:
            if way in runs and baseline in runs:
                paired = [max(t["to_group_s"] for t in a) - max(t["to_group_s"] for t in b)
                          for a, b in zip(runs[way], runs[baseline], strict=True)]
                differences[f"{way}_vs_{baseline}_job_ready_ms"] = round(statistics.median(paired) * 1000, 1)
        print(json.dumps(differences), flush=True)
    print(json.dumps(import_costs(args.repeat, ways)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
