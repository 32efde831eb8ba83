"""A worker of the healing tests (tests/test_heal.py), run by ``ifrt run --recover replace`` agents; one JSON line per
record on stdout. ``HEAL_SCENARIO``:

- ``data-parallel``: DDP over every process, Adam (its state made at its first step: a replacement has none until
  healed). Process VICTIM SIGKILLs itself once, at step KILL_STEP after its backward and before its vote.
- ``sharded``: replica sets [[0, 2], [1, 3]]: each set trains its own model (its own seed and data), no DDP; one
  all-reduce of every process per step stands for the step's collectives. Process VICTIM dies as above.
- ``leak``: 2 processes, a model of 4.7 MB of parameters; process 1 SIGKILLs itself after each LEAK_STEPS steps it
  committed, until HEAL_KILLS deaths; process 0 records its threads, descriptors and memory after each recovery.
  Both end at the step after process 1's last life committed LEAK_STEPS (process 0 may step alone meanwhile, where
  the coordinator runs --on-failure elastic).

Each process records its state's digest (parameters and optimizer state) when it joins (a newcomer: healed,
before its first step) and after each recovery (a survivor, before its next step).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

STEPS, KILL_STEP, VICTIM = 6, 3, 3
LEAK_STEPS = 2
COLLECTIVE_TIMEOUT_S = 10.0


def digest(model, optimizer) -> str:
    """The state a replica holds, as bytes hashed: every tensor of the model's and the optimizer's state dicts, and
    the optimizer's settings."""
    h = hashlib.sha256()
    for source in (model.state_dict(), optimizer.state_dict()["state"]):
        for key in sorted(source, key=str):
            values = source[key].values() if isinstance(source[key], dict) else [source[key]]
            for value in values:
                h.update(value.detach().cpu().numpy().tobytes())
    h.update(json.dumps(optimizer.state_dict()["param_groups"], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def say(**record) -> None:
    print(json.dumps(record), flush=True)


def die_once(name: str) -> None:
    mark = Path(os.environ["HEAL_DIR"]) / name
    if not mark.exists():
        mark.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def usage() -> dict:
    """This process's threads, descriptors and resident memory."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "rss_mb": round(resident / 2**20, 1)}


def main() -> None:
    import torch
    import torch.distributed as dist

    import ifrt.torch

    scenario = os.environ["HEAL_SCENARIO"]
    topology = ifrt.torch.init_process_group(on_failure="recover", collective_timeout=COLLECTIVE_TIMEOUT_S, timeout=60)
    me = topology.process_id
    own = me % 2 if scenario == "sharded" else 0  # the replica set's seed
    torch.manual_seed(own)
    width = 65536 if scenario == "leak" else 32
    net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + (me if scenario != "sharded" else own))), \
        torch.randn(8, 1, generator=torch.Generator().manual_seed(200 + own))
    sets = [[0, 2], [1, 3]] if scenario == "sharded" else None
    healing = ifrt.torch.Healing({"model": net, "optimizer": optimizer}, replica_sets=sets)
    model = net if scenario == "sharded" else healing.data_parallel(net)
    say(event="state", process_id=me, pid=os.getpid(), step=healing.step, digest=digest(net, optimizer),
        healed_from=healing.healed and healing.healed.source)
    kills = int(os.environ.get("HEAL_KILLS", "0"))
    mine, finished = 0, False
    while healing.step < STEPS or (scenario == "leak" and not finished):
        recoveries = healing.recoveries
        with healing.try_step():
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if scenario == "sharded":
                dist.all_reduce(torch.zeros(1))
            if scenario == "leak":  # every process ends at the same step: once process 1's last life stepped
                last = torch.tensor([float(me == 1 and mine >= LEAK_STEPS
                                           and len(os.listdir(os.environ["HEAL_DIR"])) >= kills)])
                dist.all_reduce(last)
            if scenario != "leak" and me == VICTIM and healing.step == KILL_STEP:
                die_once("victim")
            committed = healing.should_commit()
            say(event="vote", process_id=me, step=healing.step - committed, committed=committed)
            if committed:
                optimizer.step()
                mine += 1
                finished = scenario == "leak" and last.item() > 0
        if healing.recoveries > recoveries:
            say(event="state", process_id=me, pid=os.getpid(), step=healing.step, digest=digest(net, optimizer),
                recoveries=healing.recoveries, world=healing.world_size, **(usage() if scenario == "leak" else {}))
        if scenario == "leak" and me == 1 and mine == LEAK_STEPS:
            done = len(os.listdir(os.environ["HEAL_DIR"]))
            if done < kills:
                die_once(f"kill-{done}")
    say(event="done", process_id=me, pid=os.getpid(), step=healing.step, digest=digest(net, optimizer),
        recoveries=healing.recoveries)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
