"""Healing in the library, side by side: a data-parallel torch job of 2 replicas (1 process each, CPU, gloo) whose
replica 1 SIGKILLs itself at a chosen moment of a step; its replacement starts as soon as the death is seen (ifrt: by
its agent, from a warm spare; torchft, which has no spares: started by the driver).
Measured per trial: the time from the kill until every replica has computed the first step after it with equal
parameters (``recovered_s``), whether a survivor was lost, equal digests, the servers and processes beside the job,
and the lines of user code the recovery needs. The job is bench/healing_model.py; the ways:

- ``ifrt``: bench/healing_ifrt.py: ``ifrt.torch.Replica`` under ``ifrt run --recover replace --spare 1``;
- ``ifrt-1agent``: the same in the default layout, one agent ``ifrt run --nproc-per-host 2 --recover replace
  --spare 1`` for both processes (``ifrt`` runs one agent per process);
- ``torchft``: torchft 0.2.0 (bench/healing_torchft.py), its Lighthouse at its default 5 s heartbeat timeout;
- ``torchft-1s``: the same with ``--heartbeat_timeout_ms 1000``.

For each size, moment and round the ways run alternating. Also measured once per size, for scale: gloo's own
broadcast of the same state tensors between 2 processes (``broadcast``: the physical limit of a healing transfer).

``--scenarios elastic`` (bench/healing_elastic.py; ways ifrt, ifrt-1s (a 1 s heartbeat timeout), torchft,
torchft-1s; ``--groups 2,3`` replica groups,
the first of ``--sizes``): a group's host lost for good, the survivors going on without it (``lost``), then the
group started again and taken back, healed (``join``). ``--scenarios replace`` (the default) is the above.

    bash bench/healing_setup.sh          # once: .venv-torchft with torchft 0.2.0
    .venv/bin/python bench/healing.py [--sizes 10,250] [--moments before,during,after,at_ms] [--rounds 2]
        [--ways ifrt,ifrt-1agent,torchft,torchft-1s] [--scenarios replace,elastic] [--groups 2,3] [--json]

Prints one JSON line per trial (``--json``; else a short line), then a summary: per way and size the median/min/max
``recovered_s`` and the state bytes over it (``effective_gbps``), survivors lost per way and moment, lines of code,
servers beside the job, and the broadcast GB/s per size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import healing_elastic, healing_ifrt, healing_model, healing_torchft  # noqa: E402

WAYS = ("ifrt", "ifrt-1agent", "torchft", "torchft-1s")
SCENARIOS = ("replace", "elastic")
BROADCAST_REPEAT = 3


def normalize_moment(moment: str) -> str:
    """``at_ms=50`` (the brief's spelling) is ``at_ms``; the 50 ms is healing_model.AT_MS."""
    if moment.startswith("at_ms"):
        if "=" in moment and int(moment.split("=", 1)[1]) != healing_model.AT_MS:
            raise SystemExit(f"--moments: at_ms is {healing_model.AT_MS} ms (healing_model.AT_MS), not {moment}")
        return "at_ms"
    if moment not in healing_model.MOMENTS:
        raise SystemExit(f"--moments: {moment!r} is not one of {', '.join(healing_model.MOMENTS)}")
    return moment


def trial_functions(ways: list[str]) -> dict[str, Callable[[int, str, int], healing_model.TrialResult]]:
    """Each way's ``run_trial(state_mb, moment, round)``; a torchft way whose environment is missing is left out,
    with a message on stderr that says how to make it."""
    functions: dict[str, Callable[[int, str, int], healing_model.TrialResult]] = {}
    for way in ways:
        if way == "ifrt":
            functions[way] = healing_ifrt.run_trial
        elif way == "ifrt-1agent":
            functions[way] = lambda mb, moment, rnd: healing_ifrt.run_trial(mb, moment, rnd, one_agent=True)
        elif way in ("torchft", "torchft-1s"):
            if missing := healing_torchft.available():
                print(f"healing: skipping way {way}: {missing}", file=sys.stderr)
                continue
            heartbeat = None if way == "torchft" else 1000
            functions[way] = (lambda mb, moment, rnd, hb=heartbeat:
                              healing_torchft.run_trial(mb, moment, rnd, heartbeat_ms=hb))
        else:
            raise SystemExit(f"--ways: {way!r} is not one of {', '.join(WAYS)}")
    return functions


# The physical limit: gloo's broadcast of the same state between 2 processes.
def broadcast_peer(rank: int, port: int, state_mb: int) -> None:
    """One of the 2 processes of ``broadcast``: rank 0 sends every state tensor, rank 1 receives; rank 1 prints the
    best and median time of BROADCAST_REPEAT rounds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, optimizer = healing_model.build(state_mb)
    tensors = [t.detach() for t in healing_model.state_tensors(model, optimizer)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    times = []
    for _ in range(BROADCAST_REPEAT):
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 1:
        best, median = min(times), statistics.median(times)
        print(json.dumps({"broadcast_mb": state_mb, "bytes": nbytes, "tensors": len(tensors), "best_s": round(best, 4),
                          "median_s": round(median, 4), "gbps": round(nbytes / best / 1e9, 3),
                          "gbps_median": round(nbytes / median / 1e9, 3)}), flush=True)
    dist.destroy_process_group()


def broadcast(state_mb: int) -> dict:
    """gloo's broadcast of ``state_mb`` MB of state (the same tensors as the job's) between 2 processes on loopback,
    in GB/s, with this interpreter's torch."""
    port = healing_torchft.free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    peers = [subprocess.Popen([sys.executable, __file__, "--broadcast-peer", str(rank), str(port), str(state_mb)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=300) for p in peers]
    except subprocess.TimeoutExpired:
        for p in peers:
            p.kill()
            p.wait()
        return {"broadcast_mb": state_mb, "error": "not within 300 s"}
    for line in outs[1][0].splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return {"broadcast_mb": state_mb, "error": (outs[0][1] + outs[1][1])[-800:]}


def summary(results: list[healing_model.TrialResult], broadcasts: list[dict]) -> dict:
    """Medians and extremes per way and size, survivors lost per way and moment, lines, servers, broadcast GB/s."""
    recovered: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    trials: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    lost: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    lines, servers = {}, {}
    for r in results:
        way, mb = r["way"], r["state_mb"]
        trials[way][mb] += 1
        if r.get("recovered_s") is not None:
            recovered[way][mb].append(r["recovered_s"])
        lost[way][r["moment"]][0] += bool(r.get("survivor_lost"))
        lost[way][r["moment"]][1] += 1
        lines[way] = r.get("lines")
        if r.get("servers") and way not in servers:
            servers[way] = r["servers"]
    per_size = {}
    for way in trials:
        per_size[way] = {}
        for mb, n in sorted(trials[way].items()):
            got = recovered[way][mb]
            state_bytes = healing_model.shape_for(mb).state_bytes
            per_size[way][mb] = {"trials": n, "recovered": len(got)} | ({
                "median_s": round(statistics.median(got), 3), "min_s": min(got), "max_s": max(got),
                "effective_gbps": round(state_bytes / statistics.median(got) / 1e9, 4)} if got else {})
    return {"summary": True, "recovered_s": per_size,
            "survivors_lost": {w: {m: f"{a}/{b}" for m, (a, b) in ms.items()} for w, ms in lost.items()},
            "lines": lines, "servers": servers, "broadcast": broadcasts}


def elastic(ways: list[str], groups: list[int], state_mb: int, rounds: int) -> None:
    """The elastic scenarios (bench/healing_elastic.py), the ways alternating: one JSON line per trial, then the
    summary."""
    runs = {"ifrt": lambda g, rnd: healing_elastic.run_ifrt(g, rnd, None, state_mb),
            "ifrt-1s": lambda g, rnd: healing_elastic.run_ifrt(g, rnd, 1.0, state_mb),
            "torchft": lambda g, rnd: healing_elastic.run_torchft(g, rnd, None, state_mb),
            "torchft-1s": lambda g, rnd: healing_elastic.run_torchft(g, rnd, 1000, state_mb)}
    results = []
    for count in groups:
        for rnd in range(rounds):
            for way in [w for w in ways if w in runs]:
                try:
                    results.append(runs[way](count, rnd))
                except Exception as e:  # one way's failure must not end the others' trials
                    results.append(healing_elastic.trial_result(way, count, rnd, state_mb)
                                   | {"error": f"{type(e).__name__}: {e}"})
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps(healing_elastic.summary(results)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,250",
                        help="state sizes in MB (parameters + momentum, float32), comma-separated "
                             "(default %(default)s)")
    parser.add_argument("--moments", default=",".join(healing_model.MOMENTS),
                        help="where in its step the victim dies: before (its collectives), during (its gradient "
                             f"all-reduce), after (its backward, before the vote), at_ms ({healing_model.AT_MS} ms "
                             "into the step); comma-separated (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="trials per way, size and moment (default %(default)s)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help="ifrt, torchft (its Lighthouse's default 5 s heartbeat timeout), torchft-1s (1 s); "
                             "comma-separated, run alternating (default %(default)s)")
    parser.add_argument("--scenarios", default="replace",
                        help="replace (a process killed and replaced, the moments above), elastic (a group lost for "
                             "good, then started again: bench/healing_elastic.py); comma-separated "
                             "(default %(default)s)")
    parser.add_argument("--groups", default="2,3",
                        help="replica groups of the elastic scenario, comma-separated (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON line per trial (else a short line)")
    parser.add_argument("--no-broadcast", action="store_true", help="skip the broadcast measurement")
    parser.add_argument("--broadcast-peer", nargs=3, type=int, metavar=("RANK", "PORT", "MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.broadcast_peer:
        broadcast_peer(*args.broadcast_peer)
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    moments = [normalize_moment(m) for m in args.moments.split(",") if m]
    scenarios = [s for s in args.scenarios.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS):
        raise SystemExit(f"--scenarios: {', '.join(sorted(unknown))} not among {', '.join(SCENARIOS)}")
    ways = [w for w in args.ways.split(",") if w]
    functions = trial_functions(ways) if "replace" in scenarios else {}
    print(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                      "ways": ways, "scenarios": scenarios, "sizes": sizes, "moments": moments,
                      "rounds": args.rounds}), flush=True)
    if "elastic" in scenarios:
        elastic(ways, [int(g) for g in args.groups.split(",") if g], sizes[0], args.rounds)
    if "replace" not in scenarios:
        return
    broadcasts = []
    if not args.no_broadcast:
        for mb in sizes:
            broadcasts.append(broadcast(mb))
            print(json.dumps(broadcasts[-1]), flush=True)
    results: list[healing_model.TrialResult] = []
    for mb in sizes:
        for moment in moments:
            for rnd in range(args.rounds):
                for way, run in functions.items():
                    try:
                        result = run(mb, moment, rnd)
                    except Exception as e:  # one way's failure must not end the others' trials
                        result = healing_model.trial_result(way, mb, moment, rnd, error=f"{type(e).__name__}: {e}")
                    results.append(result)
                    if args.json:
                        print(json.dumps(result), flush=True)
                    else:
                        print(f"{way:11} {mb:4d} MB {moment:7} round {rnd}: recovered_s={result.get('recovered_s')} "
                              f"survivor_lost={result.get('survivor_lost')} equal={result.get('equal')}"
                              + (f" error={str(result['error'])[:200]}" if result.get("error") else ""), flush=True)
    print(json.dumps(summary(results, broadcasts), indent=None if args.json else 1), flush=True)


if __name__ == "__main__":
    main()
