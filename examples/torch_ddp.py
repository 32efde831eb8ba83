"""PyTorch DDP across processes, started from ifrt's topology: no MASTER_ADDR, no RANK, no torchrun.

    python examples/torch_ddp.py --processes 4

starts a coordinator and N processes on loopback. Each calls ``ifrt.torch.init_process_group()`` with no rank
(the coordinator assigns process ids; the rank is the process id), wraps a small model in
``DistributedDataParallel`` and trains it for a few SGD steps on its shard of a fixed batch (gloo all-reduces the
gradients). It prints ``torch: outputs match reference ...`` when every process's parameters equal those of a
single-process run of the same steps on the whole batch, within TOLERANCE (float64: only the order of the
gradient sums differs), and exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BATCH, FEATURES, HIDDEN, STEPS, LR, SEED = 64, 8, 16, 5, 0.1, 7
TOLERANCE = 1e-9
"""Largest allowed |difference| between a DDP parameter and the single-process reference's (float64)."""


def model_and_batch():
    """The same initial model and batch in every process (fixed seeds)."""
    import torch

    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(BATCH, FEATURES, generator=generator, dtype=torch.float64)
    y = torch.randn(BATCH, 1, generator=generator, dtype=torch.float64)
    return model.double(), x, y


def train(model, x, y) -> None:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def run_process() -> dict:
    """One process: start torch.distributed from the topology, train with DDP on its shard, compare."""
    started = time.perf_counter()
    import ifrt.torch

    topology = ifrt.torch.init_process_group(timeout=120)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ready = time.perf_counter() - started
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = model_and_batch()
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # equal shards: DDP's mean is the batch's
    ddp = DistributedDataParallel(model)
    train(ddp, x[shard], y[shard])
    reference, _, _ = model_and_batch()
    train(reference, x, y)
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters(),
                                                                 strict=True))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same_everywhere = all(torch.equal(g, flat) for g in gathered)
    dist.barrier()  # every rank done with the group before any tears it down (gloo aborts a peer otherwise)
    dist.destroy_process_group()
    return {"process_id": topology.process_id, "rank": rank, "world_size": world, "max_difference": difference,
            "same_in_every_process": same_everywhere, "seconds_to_group": ready}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4, help="torch processes (default %(default)s)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(run_process()), flush=True)
        return 0
    if BATCH % args.processes:
        p.error(f"--processes must divide the batch of {BATCH}")

    from coordinator.local import LocalCoordinator

    with LocalCoordinator(num_processes=args.processes, log_level="WARNING") as coordinator:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "MASTER_", "RANK", "WORLD_SIZE"))}
        base.update(IFRT_COORDINATOR=coordinator.address, IFRT_CPU_DEVICE_COUNT="1", OMP_NUM_THREADS="1")
        workers = [subprocess.Popen([sys.executable, __file__, "--worker"], stdout=subprocess.PIPE, text=True,
                                    env=dict(base, IFRT_LOCAL_RANK=str(rank))) for rank in range(args.processes)]
        outputs = [w.communicate(timeout=300)[0] for w in workers]
        codes = [w.returncode for w in workers]
        if any(codes):
            print(f"torch: process exit codes {codes}; coordinator log:\n{coordinator.log}", file=sys.stderr)
            return 1
    answers = sorted((json.loads(out.strip().splitlines()[-1]) for out in outputs), key=lambda a: a["process_id"])
    for a in answers:
        print(f"process {a['process_id']}: rank {a['rank']} of {a['world_size']}, group ready "
              f"{a['seconds_to_group']:.2f}s after start, max |parameter - reference| {a['max_difference']:.1e}")
    wrong = [a["process_id"] for a in answers if a["rank"] != a["process_id"] or a["max_difference"] > TOLERANCE
             or not a["same_in_every_process"]]
    if wrong:
        print(f"torch: MISMATCH in processes {wrong}", file=sys.stderr)
        return 1
    worst = max(a["max_difference"] for a in answers)
    print(f"torch: outputs match reference (max |difference| {worst:.1e} <= {TOLERANCE:g}, float64) in all "
          f"{args.processes} processes: DDP over gloo, {STEPS} SGD steps on shards of a {BATCH}-sample batch equal "
          "one process's steps on the whole batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
