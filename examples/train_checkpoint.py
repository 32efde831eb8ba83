"""A training loop that saves a checkpoint every step and resumes from it: the program ``ifrt run`` restarts.

    ifrt run --nproc-per-host 2 --max-restarts 3 -- python examples/train_checkpoint.py --runtime jax \\
        --checkpoint-dir /tmp/ckpt --steps 50

Each process starts its runtime from ifrt (``--runtime jax``: ``ifrt.jax.initialize()``; ``torch``:
``ifrt.torch.init_process_group()``; ``torch-recover``: the same with ``on_failure="recover"``, for ``ifrt run
--recover replace``: a survivor re-forms the group in place and every process takes the most advanced state from a
peer; ``torchrun``: plain ``torch.distributed`` under torchrun, for comparison),
loads its own checkpoint (``<dir>/process-<id>.json``) if there is one, and then runs steps: a cross-process sum
(every process's parameter), one update of its parameter, the checkpoint written to a temporary file and renamed
over the old one (a kill never leaves half a checkpoint). It prints how long its imports and its runtime's start
took, then one line per step:

    step 7 process 2 attempt 1 pid 4242 fingerprint 3f2a... value 12.0000 t 1767052800.123

The program is the same in every attempt: only IFRT_ATTEMPT, which ifrt reads, differs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path


def jax_runtime(timeout: float) -> tuple[object, Callable[[float], float]]:
    """(topology, sum over processes): a jitted sum over an array with one element per process."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ifrt.jax

    topology = ifrt.jax.initialize(timeout=timeout)
    n = topology.num_processes
    mesh = ifrt.jax.mesh(topology.mesh((len(topology.devices),), ("p",)))
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
    per_device = len(topology.devices) // n

    def global_sum(mine: float) -> float:
        local = np.full((per_device,), mine / per_device, dtype=np.float64)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("p")), local, (n * per_device,))
        return float(total(x).addressable_data(0))

    return topology, global_sum


def torch_runtime(timeout: float) -> tuple[object, Callable[[float], float]]:
    import torch
    import torch.distributed as dist

    import ifrt.torch

    topology = ifrt.torch.init_process_group(timeout=timeout)

    def global_sum(mine: float) -> float:
        value = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(value)
        return value.item()

    return topology, global_sum


class Resync(Exception):
    """The group was re-formed (``torch-recover``): the processes agree on the state again."""


def torch_recover_runtime(timeout: float, collective_timeout: float = 2.0) -> tuple[object, Callable[[float], float]]:
    import torch
    import torch.distributed as dist

    import ifrt
    import ifrt.torch

    topology = ifrt.torch.init_process_group(on_failure="recover", collective_timeout=collective_timeout,
                                             timeout=timeout)

    def global_sum(mine: float) -> float:
        value = torch.tensor([mine], dtype=torch.float64)
        try:
            with ifrt.torch.recoverable():
                dist.all_reduce(value)
        except ifrt.CollectiveFailed as e:
            ifrt.torch.recover(timeout)
            print(f"recovered process {topology.process_id} pid {os.getpid()} from the failure of processes "
                  f"{list(e.process_ids)} t {time.time():.3f}", flush=True)
            raise Resync() from e
        return value.item()

    return topology, global_sum


def agree(state: dict) -> dict:
    """Every process takes the state of the lowest process at the most advanced step (``torch-recover``: a
    newcomer's from a peer, not from its checkpoint)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([float(state["step"]), state["param"]], dtype=torch.float64)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    latest = max(int(t[0]) for t in every)
    source = min(r for r, t in enumerate(every) if int(t[0]) == latest)
    dist.broadcast(mine, src=source)
    return {"step": int(mine[0]), "param": float(mine[1])}


def torchrun_runtime(timeout: float) -> tuple[object, Callable[[float], float]]:
    """Plain ``torch.distributed`` from torchrun's environment (no ifrt), for comparison with torchrun's restarts.
    Restarted by torchrun (c10d rendezvous) it needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: see bench/restart.py."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))

    class Plain:
        process_id, num_processes, fingerprint = dist.get_rank(), dist.get_world_size(), "-"

    def global_sum(mine: float) -> float:
        value = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(value)
        return value.item()

    return Plain, global_sum


RUNTIMES = {"jax": ("ifrt.jax", jax_runtime), "torch": ("ifrt.torch", torch_runtime),
            "torch-recover": ("ifrt.torch", torch_recover_runtime), "torchrun": ("torch.distributed", torchrun_runtime)}


def load(path: Path) -> dict:
    """The last checkpoint, or the start."""
    if path.exists():
        return json.loads(path.read_text())
    return {"step": 0, "param": 1.0}


def save(path: Path, state: dict) -> None:
    """Writes ``state`` whole or not at all (a temporary file renamed over the old checkpoint)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(partial, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runtime", choices=tuple(RUNTIMES), default="jax",
                   help="jax, torch, torch-recover (started by ifrt; torch-recover re-forms in place under `ifrt run "
                        "--recover replace`), or torchrun (plain torch.distributed under torchrun)")
    p.add_argument("--checkpoint-dir", required=True, type=Path, help="where each process keeps its checkpoint")
    p.add_argument("--steps", type=int, default=20, help="the step the training ends at")
    p.add_argument("--step-seconds", type=float, default=0.1, help="pause after each step (stands for the work)")
    p.add_argument("--timeout", type=float, default=120.0, help="discovery timeout")
    p.add_argument("--collective-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="torch-recover: how long a collective waits for its peers (default %(default)s); with gloo it "
                        "is what returns a survivor whose collective waits on a peer other than the one that died")
    args = p.parse_args()
    began = time.time()
    module, runtime = RUNTIMES[args.runtime]
    importlib.import_module(module)
    imported = time.time()
    topology, global_sum = runtime(args.timeout, *([args.collective_timeout] if args.runtime == "torch-recover"
                                                   else []))
    attempt = os.environ.get("IFRT_ATTEMPT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "-"))
    me = topology.process_id
    print(f"started process {me} attempt {attempt} pid {os.getpid()} imports {imported - began:.3f}s start "
          f"{time.time() - imported:.3f}s t {time.time():.3f}", flush=True)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    path = args.checkpoint_dir / f"process-{me}.json"
    state = load(path)
    if args.runtime == "torch-recover":
        state = agree(state)
    if state["step"]:
        print(f"resumed process {me} at step {state['step']}", flush=True)
    while state["step"] < args.steps:
        try:
            total = global_sum(state["param"])
        except Resync:
            state = agree(state)
            continue
        state = {"step": state["step"] + 1, "param": state["param"] + 0.5 * total / topology.num_processes}
        save(path, state)
        print(f"step {state['step']} process {me} attempt {attempt} pid {os.getpid()} fingerprint "
              f"{topology.fingerprint} value {total:.4f} t {time.time():.3f}", flush=True)
        time.sleep(args.step_seconds)
    if args.runtime != "jax":
        import torch.distributed as dist

        dist.barrier()  # gloo aborts a process whose peer closes a connection it still uses
        dist.destroy_process_group()
    print(f"finished process {me} at step {state['step']}", flush=True)
    if args.runtime == "torch-recover":
        # torch 2.13: an object of a gloo group that was aborted (recover() keeps them alive) can block in its
        # destructor holding the GIL, so a process leaves here, before its objects are torn down (its group is
        # destroyed, its output flushed), as examples/train_recover.py does
        os._exit(0)


if __name__ == "__main__":
    main()
