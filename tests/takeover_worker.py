"""A PyTorch process for the lost-host tests: ``python tests/takeover_worker.py``.

Joins with ``ifrt.torch.init_process_group(on_failure="recover")``, agrees with the others on the most advanced step,
then all-reduces once a step until step ``STEPS``; a collective that a peer's failure broke re-forms the group in
place (``ifrt.torch.recover()``). Prints ``joined``, ``recovered`` and ``done`` lines naming its process id, PID,
step, generation and the hosts of the topology, then (but for ``done``) its torch rank and world size.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ifrt
import ifrt.torch

STEPS, STEP_S = 40, 0.05


def agree(step: int) -> int:
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(steps, torch.tensor([step]))
    return max(int(s) for s in steps)


def say(what: str, topology: ifrt.Topology, step: int) -> None:
    hosts = ",".join(p.hostname for p in topology.processes)
    group = f" rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else ""
    print(f"{what} process {topology.process_id} pid {os.getpid()} step {step} generation {topology.generation} "
          f"hosts {hosts}{group}", flush=True)


def main() -> None:
    topology = ifrt.torch.init_process_group(on_failure="recover", collective_timeout=8, timeout=60)
    step = agree(0)
    say("joined", topology, step)
    while step < STEPS:
        try:
            with ifrt.torch.recoverable():
                total = torch.ones(1)
                dist.all_reduce(total)
            step += 1
            time.sleep(STEP_S)
        except ifrt.CollectiveFailed:
            topology = ifrt.torch.recover()
            step = agree(step)
            say("recovered", topology, step)
    dist.barrier()
    dist.destroy_process_group()
    say("done", topology, step)
    os._exit(0)  # torch 2.13: a group aborted by a recovery can block its teardown (see examples/train_recover.py)


if __name__ == "__main__":
    main()
