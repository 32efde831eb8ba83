"""One process of bench/healing.py's job on ifrt: ``ifrt.torch.Healing`` heals a replacement from its peer and votes
on each step; run by ``ifrt run --recover replace --spare 1`` (bench/healing_ifrt.py).

Prints one JSON line per committed step ``{"replica", "step", "t", "digest", "pid", "world"}`` (digest of parameters
and momentum; ``world``: the processes of the group it stepped in). Process 1, with BENCH_KILL_MOMENT set, SIGKILLs
itself in the first step that starts after BENCH_KILL_FILE exists, at that moment (healing_model.MOMENTS), after
printing ``{"event": "killed", "t": ...}``; it renames the file first, so its replacement (started with the same
environment) does not die too.

Lines of user code the recovery needs: every line marked ``# [ifrt]`` below; ``RECOVERY_LINES`` lists them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ifrt.torch  # [ifrt]
from bench import healing_model

MARK = "# [ifrt]"
RECOVERY_LINES = [line.strip() for line in Path(__file__).read_text().splitlines() if line.rstrip().endswith(MARK)]
COLLECTIVE_TIMEOUT_S = 60.0
"""gloo's timeout: only a hung peer needs it (a killed one closes its sockets); long enough for 250 MB."""


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> None:
    state_mb = float(os.environ["BENCH_STATE_MB"])
    deadline = time.monotonic() + float(os.environ.get("BENCH_MAX_SECONDS", "300"))
    torch.set_num_threads(1)
    model, optimizer = healing_model.build(state_mb)  # before the group, as torchft's side: a joiner is ready
    topology = ifrt.torch.init_process_group(on_failure="recover", collective_timeout=COLLECTIVE_TIMEOUT_S)  # [ifrt]
    me = topology.process_id
    kill_file = Path(os.environ.get("BENCH_KILL_FILE", "/nonexistent"))
    moment = os.environ.get("BENCH_KILL_MOMENT", "") if me == 1 else ""
    emit(event="start", replica=me, t=time.time(), pid=os.getpid(), lines=len(RECOVERY_LINES))
    inputs, targets = healing_model.batch(state_mb, me)
    healing = ifrt.torch.Healing({"model": model, "optimizer": optimizer})  # [ifrt]
    ddp = healing.data_parallel(model)  # [ifrt]
    healed = healing.healed
    emit(event="joined", replica=me, t=time.time(), pid=os.getpid(), step=healing.step,
         healed=healed and {"source": healed.source, "bytes": healed.bytes, "seconds": healed.seconds})

    def die() -> None:
        emit(event="killed", t=time.time(), pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)

    armed = [False]
    if moment == "during":  # the victim dies right after launching its first gradient all-reduce of the step
        def allreduce_then_die(_, bucket):
            tensor = bucket.buffer().div_(dist.get_world_size())
            work = dist.all_reduce(tensor, async_op=True)
            if armed[0]:
                die()
            return work.get_future().then(lambda f: f.value()[0])

        ddp.ddp.register_comm_hook(None, allreduce_then_die)

    last, recoveries = healing.step, 0
    while time.monotonic() < deadline:
        if moment and kill_file.exists():
            kill_file.rename(kill_file.with_suffix(".done"))
            armed[0] = True
            if moment == "before":
                die()
            if moment == "at_ms":
                threading.Timer(healing_model.AT_MS / 1000, die).start()
        with healing.try_step():  # [ifrt]
            optimizer.zero_grad()
            healing_model.loss_of(ddp, inputs, targets).backward()
            if armed[0] and moment == "after":
                die()
            if healing.should_commit():  # [ifrt]
                optimizer.step()
        if healing.recoveries != recoveries:  # this process lived through one more recovery
            recoveries = healing.recoveries
            emit(event="recovered", recoveries=recoveries, t=time.time(), pid=os.getpid(), **healing_model.usage())
        if healing.step != last:
            emit(replica=me, step=healing.step, t=time.time(), digest=healing_model.digest(model, optimizer),
                 pid=os.getpid(), world=healing.world_size)
            last = healing.step


if __name__ == "__main__":
    main()
