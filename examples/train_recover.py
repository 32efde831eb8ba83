"""A failed process replaced while the others keep running: the group re-formed in place, the newcomer healed from
a peer, the step the failure broke kept nowhere, no checkpoint.

    python examples/train_recover.py --processes 4 [--signal KILL|STOP] [--moment before|after] [--second-failure]

starts a coordinator and two `ifrt run --recover replace` agents on loopback (half the processes each, as two hosts
would). Every process calls ``ifrt.torch.init_process_group(on_failure="recover")`` and trains a small model with
DDP over gloo through ``ifrt.torch.Healing`` (the lines marked in ``run_process``: all a program writes for its
recovery), each step on its shard of a fixed batch. At step FAIL_STEP process FAILED sends itself the signal, before
the step's forward pass or after its backward and before its vote: KILL (it dies; its agent sees it at once) or STOP
(it hangs; the coordinator declares it failed after the heartbeat timeout and its agent kills it). Its agent starts
a new process with the same id; the survivors' step ends (a collective that failed, or a vote that a process failed
before every vote was in), the group is re-formed with the newcomer, which receives the model and optimizer state
from a survivor, and every process runs the step again. No checkpoint exists.

It prints ``recover: outputs match reference ...`` only when every process's final parameters equal those of a
single-process run of the same steps on the whole batch (float64, within TOLERANCE: only the order of the gradient
sums differs) and are the same in every process, the survivors kept their PIDs, the newcomer took its state from a
peer, and (failure after the backward) every survivor's vote on that step kept it nowhere; it exits non-zero
otherwise.
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
"""gloo's collective timeout: what returns a survivor blocked on a peer that hangs with its sockets open (SIGSTOP),
until its agent kills it (long enough that a loaded machine's slow peer is not taken for a failed one)."""
JOB_TIMEOUT_S = 120.0
"""How long the job may take before the driver stops it (and prints what the agents said)."""
MARK_ENV = "TRAIN_RECOVER_DIR"
"""A directory the driver gives the workers: the failing process leaves a mark there, so its newcomer does not fail."""
MOMENTS = ("before", "after")
"""Where in step FAIL_STEP process FAILED signals itself: before the step's forward pass, or after its backward
(its gradients all-reduced) and before its vote."""


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
    """SGD with momentum: state that a newcomer must receive, not recompute."""
    import torch

    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def fail_here(me: int, step: int, moment: str) -> None:
    """Process FAILED, the first time it reaches ``moment`` of step FAIL_STEP, sends itself the signal."""
    mark = Path(os.environ[MARK_ENV]) / "signalled"
    if me == FAILED and step == FAIL_STEP and moment == os.environ["TRAIN_RECOVER_MOMENT"] and not mark.exists():
        mark.touch()
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ["TRAIN_RECOVER_SIGNAL"]))


def run_process() -> NoReturn:
    """One process: train with DDP on its shard, healed and re-formed in place when a peer fails; compare with the
    reference, say the result and leave."""
    import torch
    import torch.distributed as dist

    import ifrt.torch

    topology = ifrt.torch.init_process_group(on_failure="recover", collective_timeout=COLLECTIVE_TIMEOUT_S,
                                             timeout=120)
    me, world = topology.process_id, topology.num_processes
    model, x, y = model_and_batch()
    optimizer = optimizer_of(model)
    x, y = x[me * BATCH // world:(me + 1) * BATCH // world], y[me * BATCH // world:(me + 1) * BATCH // world]
    # The recovery: all a program writes for it, from here to the vote (docs/pytorch.md shows these lines)
    if me == SECOND and os.environ.get("TRAIN_RECOVER_SECOND") == "1":
        ifrt.torch.client().on_event(die_during_the_recovery)
    healing = ifrt.torch.Healing({"model": model, "optimizer": optimizer})
    ddp = healing.data_parallel(model)
    say({"event": "joined", "process_id": me, "pid": os.getpid(), "step": healing.step,
         "source": healing.healed and healing.healed.source})
    while healing.step < STEPS:
        step, recoveries, began = healing.step, healing.recoveries, time.monotonic()
        with healing.try_step():
            fail_here(me, step, "before")
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            fail_here(me, step, "after")
            if healing.should_commit():
                optimizer.step()
            say({"event": "vote", "process_id": me, "step": step, "committed": healing.step > step})
        if healing.recoveries > recoveries:
            say({"event": "recovered", "process_id": me, "pid": os.getpid(), "step": healing.step,
                 "recoveries": healing.recoveries, "seconds": round(time.monotonic() - began, 2)})
    reference, reference_x, reference_y = model_and_batch()
    reference_optimizer = optimizer_of(reference)
    for _ in range(STEPS):
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(reference_x), reference_y).backward()
        reference_optimizer.step()
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(),
                                                                 strict=True))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, flat) for g in gathered)
    dist.barrier()  # every rank done with the group before any tears it down
    dist.destroy_process_group()
    say({"event": "done", "process_id": me, "pid": os.getpid(), "max_difference": difference,
         "same_in_every_process": same, "recoveries": healing.recoveries})
    sys.exit(0)


def die_during_the_recovery(event) -> None:
    """``--second-failure``: process SECOND is SIGKILLed (once) when it hears that process FAILED failed, while it
    and the others recover from that."""
    import ifrt

    mark = Path(os.environ[MARK_ENV]) / "second"
    if isinstance(event, ifrt.events.ProcessFailed) and event.process_id == FAILED and not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def say(record: dict) -> None:
    print(json.dumps(record), flush=True)


def records(lines: list[str]) -> list[dict]:
    """The workers' JSON lines among an agent's output (each behind its ``[<process id>] `` prefix)."""
    return [json.loads(m.group(1)) for line in lines if (m := re.match(r"^\[\d+\] (\{.*\})$", line))]


def start_agents(processes: int, address: str, mark_dir: str, args: argparse.Namespace) -> list[subprocess.Popen]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "MASTER_", "RANK", "WORLD_SIZE"))}
    base.update(IFRT_COORDINATOR=address, IFRT_CPU_DEVICE_COUNT="1", IFRT_FAILOVER_WINDOW="10", OMP_NUM_THREADS="1",
                TRAIN_RECOVER_SIGNAL=args.signal, TRAIN_RECOVER_MOMENT=args.moment,
                TRAIN_RECOVER_SECOND="1" if args.second_failure else "0",
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
    p.add_argument("--moment", choices=MOMENTS, default="after",
                   help=f"where in step {FAIL_STEP} the signal comes: before its forward pass, or after its backward "
                        "and before its vote (default %(default)s)")
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
        if pid not in failed and (r["pid"] != first or not r["recoveries"]):
            problems.append(f"survivor {pid}: pid {first} at start, {r['pid']} at the end, {r['recoveries']} "
                            "recoveries (expected the same pid and at least 1)")
        kept = [v["committed"] for v in seen if v["event"] == "vote" and v["process_id"] == pid
                and v["step"] == FAIL_STEP]
        if pid not in failed and args.moment == "after" and kept[:1] != [False]:
            problems.append(f"survivor {pid} voted {kept} at step {FAIL_STEP}: expected its first vote there to keep "
                            f"the step nowhere (process {FAILED} died after its backward, before its vote)")
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
    voted = (f"; every survivor's vote on step {FAIL_STEP} kept it nowhere, then the step ran again"
             if args.moment == "after" else "")
    print(f"recover: outputs match reference (max |difference| {worst:.1e} <= {TOLERANCE:g}, float64) in all "
          f"{args.processes} processes after process {FAILED} got SIG{args.signal} {args.moment} its step "
          f"{FAIL_STEP}{second}: the survivors kept their PIDs and re-formed the group in place (slowest "
          f"{slowest:.1f}s from the step that failed to the step done again); the newcomers took the model and "
          f"optimizer state from a peer ({newcomers}){voted}; no checkpoint was read; {took:.1f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
