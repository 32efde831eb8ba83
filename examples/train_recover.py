"""A failed process replaced while the others keep running: DDP re-formed in place, the newcomer brought up to date
by a peer, no checkpoint.

    python examples/train_recover.py --processes 4 [--signal KILL|STOP]

starts a coordinator and two `ifrt run --recover replace` agents on loopback (half the processes each, as two hosts
would). Every process calls ``ifrt.torch.init_process_group(on_failure="recover")`` and trains a small model with
``DistributedDataParallel`` over gloo, each step on its shard of a fixed batch. At step FAIL_STEP process FAILED
sends itself the signal: KILL (it dies; its agent sees it at once) or STOP (it hangs; the coordinator declares it
failed after the heartbeat timeout and its agent kills it). Its agent starts a new process with the same id; the
survivors' collective fails (``ifrt.CollectiveFailed``), they call ``ifrt.torch.recover()``, and every process,
the newcomer included, agrees on the most advanced step and takes the model and optimizer state from the survivor
that holds it (a broadcast, as torchft's recovery does). No checkpoint exists.

It prints ``recover: outputs match reference ...`` only when every process's final parameters equal those of a
single-process run of the same steps on the whole batch (float64, within TOLERANCE: only the order of the gradient
sums differs) and are the same in every process, the survivors kept their PIDs, and the newcomer took its state
from a peer; it exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

BATCH, FEATURES, HIDDEN, STEPS, LR, MOMENTUM, SEED = 64, 8, 16, 10, 0.05, 0.9, 7
FAIL_STEP, FAILED, SECOND = 5, 2, 3
TOLERANCE = 1e-9
"""Largest allowed |difference| between a parameter and the single-process reference's (float64)."""
HEARTBEAT_S = 1.0
"""The coordinator's heartbeat timeout: how soon a hung (STOPped) process is declared failed."""
COLLECTIVE_TIMEOUT_S = 8.0
"""gloo's collective timeout: what returns a survivor blocked on a peer whose sockets stay open (long enough that a
loaded machine's slow peer is not taken for a failed one)."""
JOB_TIMEOUT_S = 120.0
"""How long the job may take before the driver stops it (and prints what the agents said)."""
MARK_ENV = "TRAIN_RECOVER_DIR"
"""A directory the driver gives the workers: the failing process leaves a mark there, so its newcomer does not fail."""


KEPT: list = []
"""Every DDP module this process built (those of groups that recoveries replaced, and the last): never torn down."""


def model_and_batch():
    """The same initial model and batch in every process (fixed seeds)."""
    import torch

    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(BATCH, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randn(BATCH, 1, generator=generator, dtype=torch.float64)
    return model.double(), x, y


def optimizer_of(model):
    """SGD with momentum, its buffers made at once: state that a newcomer must receive, not recompute."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def step_once(model, optimizer, x, y) -> None:
    import torch

    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def bring_up_to_date(model, optimizer, step: int) -> tuple[int, int]:
    """Every process agrees on the most advanced step and takes the model and optimizer state of the lowest rank
    that holds it; returns (that step, that rank)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(steps, torch.tensor([step]))
    latest = max(int(s) for s in steps)
    source = min(r for r in range(world) if int(steps[r]) == latest)
    for p in model.parameters():
        dist.broadcast(p.data, src=source)
        dist.broadcast(optimizer.state[p]["momentum_buffer"], src=source)
    return latest, source


def run_process() -> NoReturn:
    """One process: train with DDP on its shard, re-forming in place when a peer fails; compare with the
    reference, say the result and leave."""
    import ifrt
    import ifrt.torch

    topology = ifrt.torch.init_process_group(on_failure="recover", collective_timeout=COLLECTIVE_TIMEOUT_S,
                                             timeout=120)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    me, world = topology.process_id, topology.num_processes
    model, x, y = model_and_batch()
    optimizer = optimizer_of(model)
    shard = slice(me * BATCH // world, (me + 1) * BATCH // world)  # equal shards: DDP's mean is the batch's
    step, source = bring_up_to_date(model, optimizer, 0)
    say({"event": "joined", "process_id": me, "pid": os.getpid(), "step": step, "source": source})
    ddp = DistributedDataParallel(model)
    recoveries = 0
    while step < STEPS:
        if me == FAILED and step == FAIL_STEP:
            mark = Path(os.environ[MARK_ENV]) / "signalled"
            if not mark.exists():
                mark.touch()
                os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("TRAIN_RECOVER_SIGNAL", "KILL")))
        try:
            with ifrt.torch.recoverable():
                step_once(ddp, optimizer, x[shard], y[shard])
            step += 1
        except ifrt.CollectiveFailed as e:
            failed_at = time.monotonic()
            if me == SECOND and os.environ.get("TRAIN_RECOVER_SECOND") == "1":
                mark = Path(os.environ[MARK_ENV]) / "second"
                if not mark.exists():  # a second failure, during the recovery of the first
                    mark.touch()
                    os.kill(os.getpid(), signal.SIGKILL)
            ifrt.torch.recover()
            step, source = bring_up_to_date(model, optimizer, step)
            KEPT.append(ddp)  # built on the aborted group: never torn down (see the end)
            ddp = DistributedDataParallel(model)  # on the new group
            recoveries += 1
            say({"event": "recovered", "process_id": me, "pid": os.getpid(), "step": step, "source": source,
                 "failed": list(e.process_ids), "seconds": round(time.monotonic() - failed_at, 2)})
    reference, _, _ = model_and_batch()
    reference_optimizer = optimizer_of(reference)
    for _ in range(STEPS):
        step_once(reference, reference_optimizer, x, y)
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(),
                                                                 strict=True))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, flat) for g in gathered)
    dist.barrier()  # every rank done with the group before any tears it down
    dist.destroy_process_group()
    say({"event": "done", "process_id": me, "pid": os.getpid(), "max_difference": difference,
         "same_in_every_process": same, "recoveries": recoveries})
    # torch 2.13: a DDP built on an aborted gloo group can block in its destructor holding the GIL, so a process
    # leaves here, before this frame's objects are torn down (its group is destroyed, its output flushed)
    os._exit(0)


def say(record: dict) -> None:
    print(json.dumps(record), flush=True)


def records(lines: list[str]) -> list[dict]:
    """The workers' JSON lines among an agent's output (each behind its ``[<process id>] `` prefix)."""
    return [json.loads(m.group(1)) for line in lines if (m := re.match(r"^\[\d+\] (\{.*\})$", line))]


def start_agents(processes: int, address: str, mark_dir: str, args: argparse.Namespace) -> list[subprocess.Popen]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "MASTER_", "RANK", "WORLD_SIZE"))}
    base.update(IFRT_COORDINATOR=address, IFRT_CPU_DEVICE_COUNT="1", IFRT_FAILOVER_WINDOW="10", OMP_NUM_THREADS="1",
                TRAIN_RECOVER_SIGNAL=args.signal, TRAIN_RECOVER_SECOND="1" if args.second_failure else "0",
                **{MARK_ENV: mark_dir})
    max_restarts = args.max_restarts if args.max_restarts is not None else 1 + args.second_failure
    per_host = processes // 2
    return [subprocess.Popen([sys.executable, "-m", "ifrt.cli", "run", "--nproc-per-host", str(per_host),
                              "--host-rank", str(h), "--num-hosts", "2", "--recover", "replace", "--max-restarts",
                              str(max_restarts), "--grace-seconds", "2", "--", sys.executable, __file__, "--worker"],
                             env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for h in range(2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4, help="torch processes, half on each agent (default "
                                                             "%(default)s)")
    p.add_argument("--signal", choices=("KILL", "STOP"), default="KILL",
                   help=f"what process {FAILED} sends itself at step {FAIL_STEP} (default %(default)s)")
    p.add_argument("--second-failure", action="store_true",
                   help=f"process {SECOND} is SIGKILLed too, while the survivors recover from the first failure")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="the job's restart budget (default: the failures' count; 0: the failure ends the job)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_process()  # does not return
    if args.processes < 4 or args.processes % 2 or BATCH % args.processes:
        p.error(f"--processes must be even, at least 4 and divide the batch of {BATCH}")

    from coordinator.local import LocalCoordinator

    began = time.monotonic()
    with tempfile.TemporaryDirectory() as mark_dir, LocalCoordinator(
            "--heartbeat-timeout", str(HEARTBEAT_S), num_processes=args.processes, log_level="WARNING") as coordinator:
        agents = start_agents(args.processes, coordinator.address, mark_dir, args)
        texts: dict[tuple[int, str], str] = {}

        def read(i: int, stream: str) -> None:
            texts[i, stream] = getattr(agents[i], stream).read()

        readers = [threading.Thread(target=read, args=(i, stream)) for i in range(len(agents))
                   for stream in ("stdout", "stderr")]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        for agent in agents:
            try:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                agent.send_signal(signal.SIGTERM)  # the agent stops its workers, then exits
        for agent in agents:
            agent.wait()
        for reader in readers:
            reader.join()
        codes = [a.returncode for a in agents]
    errors = [texts[i, "stderr"] for i in range(len(agents))]
    seen = [r for i in range(len(agents)) for r in records(texts[i, "stdout"].splitlines())]
    if any(codes):
        print(f"recover: agent exit codes {codes}", file=sys.stderr)
        for i, text in enumerate(errors):
            print(f"agent {i}:\n{text[-4000:]}", file=sys.stderr)
        return 1
    return report(args, seen, time.monotonic() - began)


def report(args: argparse.Namespace, seen: list[dict], took: float) -> int:
    """Checks the workers' records; prints the verdict."""
    failed = [FAILED, SECOND] if args.second_failure else [FAILED]
    done = {r["process_id"]: r for r in seen if r["event"] == "done"}
    joined: dict[int, list[dict]] = {}
    for r in seen:
        if r["event"] == "joined":
            joined.setdefault(r["process_id"], []).append(r)
    recovered = [r for r in seen if r["event"] == "recovered"]
    problems = []
    if sorted(done) != list(range(args.processes)):
        problems.append(f"processes {sorted(done)} finished, expected 0-{args.processes - 1}")
    for pid, r in done.items():
        if r["max_difference"] > TOLERANCE or not r["same_in_every_process"]:
            problems.append(f"process {pid}: max |parameter - reference| {r['max_difference']:.1e}, same in every "
                            f"process: {r['same_in_every_process']}")
        first = joined.get(pid, [{}])[0].get("pid")
        if pid not in failed and (r["pid"] != first or r["recoveries"] != 1):
            problems.append(f"survivor {pid}: pid {first} at start, {r['pid']} at the end, {r['recoveries']} "
                            "recoveries (expected the same pid and 1)")
    for pid in failed:
        newcomer = joined.get(pid, [])
        if len(newcomer) != 2 or newcomer[1]["pid"] == newcomer[0]["pid"] or newcomer[1]["source"] in failed \
                or newcomer[1]["step"] < FAIL_STEP:
            problems.append(f"process {pid} joined {newcomer}: expected a newcomer with a new pid that took step "
                            f">= {FAIL_STEP} from a peer")
    if problems:
        print("recover: MISMATCH: " + "; ".join(problems), file=sys.stderr)
        return 1
    worst = max(r["max_difference"] for r in done.values())
    slowest = max(r["seconds"] for r in recovered)
    newcomers = ", ".join(f"process {pid} (pid {joined[pid][1]['pid']}) took step {joined[pid][1]['step']} from "
                          f"process {joined[pid][1]['source']}" for pid in failed)
    second = f" and process {SECOND} was SIGKILLed during the recovery" if args.second_failure else ""
    print(f"recover: outputs match reference (max |difference| {worst:.1e} <= {TOLERANCE:g}, float64) in all "
          f"{args.processes} processes after process {FAILED} got SIG{args.signal} at step {FAIL_STEP}{second}: the "
          f"survivors kept their PIDs and re-formed the group in place (slowest {slowest:.1f}s from the failed "
          f"collective); the newcomers took the model and optimizer state from a peer ({newcomers}); no checkpoint "
          f"was read; {took:.1f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
