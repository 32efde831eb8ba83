"""A torchrun worker for tests/test_torchrun.py: one DDP step with gloo, started by torch.distributed's env://
(or by ifrt.torch.init_process_group with --ifrt).

Writes one JSON file per worker into --out: its torchrun ranks, the all_reduce of every rank + 1, and its
parameters after the step (equal in every worker when DDP worked). Options make it wait to be killed, so a test
can kill it by pid (--hang-node N, before the group starts; --hang-after-start N, once it has started) or until the
group grows (--until-world N).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

HANG_S = 120.0  # at most this long: the test kills the worker (or torchrun restarts the group) well before


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--hang-node", type=int, default=None,
                   help="on the first attempt, local rank 1 of this node writes its pid and waits to be killed")
    p.add_argument("--hang-after-start", type=int, default=None,
                   help="as --hang-node, but once the process group has started (a topology every worker holds)")
    p.add_argument("--until-world", type=int, default=None,
                   help="wait (until torchrun restarts the group) while the world has fewer workers than this")
    p.add_argument("--ifrt", action="store_true", help="start with ifrt.torch.init_process_group()")
    args = p.parse_args()
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT",
                                      "MASTER_ADDR", "MASTER_PORT")}
    out = Path(args.out)
    node, local = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
    if args.hang_node == node and local == 1 and env["TORCHELASTIC_RESTART_COUNT"] == "0":
        (out / "hang.pid").write_text(str(os.getpid()))
        time.sleep(HANG_S)
    if args.until_world is not None and int(env["WORLD_SIZE"]) < args.until_world:
        (out / f"waiting.{env['RANK']}").write_text(env["WORLD_SIZE"])
        time.sleep(HANG_S)
    process_id = None
    if args.ifrt:  # ifrt's process ids and store (the coordinator torchrun's handler passed on in IFRT_COORDINATOR)
        import ifrt.torch

        process_id = ifrt.torch.init_process_group("gloo").process_id
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.hang_after_start == node and env["TORCHELASTIC_RESTART_COUNT"] == "0":
        if local == 1:
            (out / "hang.pid").write_text(str(os.getpid()))
        time.sleep(HANG_S)  # every worker of the first group: the one killed, and its peers in a collective's place
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((2, 4), float(rank))
    model(x).sum().backward()
    optimizer.step()
    params = [round(v, 6) for t in model.parameters() for v in t.detach().flatten().tolist()]
    # Every rank done with the group before any tears it down: gloo aborts a process (std::terminate) whose peer
    # closes a connection while it still has work on it. A rank leaves the barrier before its peers may have, so the
    # store (its own connections) says when every rank has. The DDP goes before the group is destroyed: its reducer,
    # were it the group's last holder, would run gloo's destructor holding the GIL (see ifrt/torch/groups.py).
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()  # the group's own: a restarted group has another
    store.set(f"left-barrier/{rank}", "1")
    store.wait([f"left-barrier/{r}" for r in range(world)])
    del model, optimizer
    dist.destroy_process_group()
    report = {**env, "node_addr": os.environ.get("TEST_NODE_ADDR"), "dist_rank": rank, "dist_world": world,
              "process_id": process_id, "all_reduce": total.item(), "params": params}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
