"""A worker of the go-on tests (tests/test_go_on.py): data-parallel training under ``ifrt.torch.Healing`` where the
coordinator runs ``--on-failure elastic``, one JSON line per record on stdout.

Each process takes its share of a fixed global batch by its rank and world size in the group it steps in now, so
the job goes on with fewer replicas and grows back without anything else changing. ``GO_ON_SETS``: replica sets as
JSON (default: data parallelism). ``GO_ON_STEPS`` steps of ``STEP_S`` each, and on until the group holds
``GO_ON_WHOLE`` processes (the job whole again: a test's newcomer is never too late). ``GO_ON_DIE_JOINING``: a file;
a process that finds it missing makes it and SIGKILLs itself in its group, before its Healing (set for a
newcomer).

Records ``state`` when it joins (healed, before its first step) and after each re-formed group, ``step`` every tenth
step, ``done`` at the end; each with its PID, step, rank, world size, generation and the digest of its parameters and
momentum.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

STEP_S = 0.05
GLOBAL_BATCH = 12


def main() -> None:
    import torch

    import ifrt.torch

    torch.manual_seed(0)  # the model and optimizer first: a newcomer is awaited from its registration on
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    ifrt.torch.init_process_group(on_failure="recover", collective_timeout=10, timeout=60)
    dies = os.environ.get("GO_ON_DIE_JOINING")
    if dies and not os.path.exists(dies):  # once: in its group with the survivors, before they heal it
        open(dies, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    sets = json.loads(os.environ.get("GO_ON_SETS", "null"))
    healing = ifrt.torch.Healing({"model": net, "optimizer": optimizer}, replica_sets=sets)
    model = healing.data_parallel(net)
    data = torch.Generator().manual_seed(7)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=data), torch.randn(GLOBAL_BATCH, 1, generator=data)

    def say(event: str, **more) -> None:
        h = hashlib.sha256()
        for t in (*net.state_dict().values(), *(s["momentum_buffer"] for s in optimizer.state.values())):
            h.update(t.detach().numpy().tobytes())
        print(json.dumps({"event": event, "process_id": healing.topology.process_id, "pid": os.getpid(),
                          "step": healing.step, "rank": healing.rank, "world": healing.world_size,
                          "generation": healing.topology.generation, "digest": h.hexdigest()[:16],
                          "recoveries": healing.recoveries, **more}), flush=True)

    say("state", healed_from=healing.healed and healing.healed.source)
    steps, whole = int(os.environ["GO_ON_STEPS"]), int(os.environ.get("GO_ON_WHOLE", "0"))
    while healing.step < steps or healing.world_size < whole:  # the same answer in every process of the group
        recoveries = healing.recoveries
        with healing.try_step():
            share = GLOBAL_BATCH // healing.world_size  # this replica's shard of the global batch
            mine = slice(healing.rank * share, (healing.rank + 1) * share)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            time.sleep(STEP_S)
            if healing.should_commit():
                optimizer.step()
                if healing.step % 10 == 0:
                    say("step")
        if healing.recoveries > recoveries:
            say("state", healed_from=healing.healed and healing.healed.source)
    say("done")
    os._exit(0)  # torch 2.13: a group aborted by a recovery can block its teardown (see examples/train_recover.py)


if __name__ == "__main__":
    sys.exit(main())
