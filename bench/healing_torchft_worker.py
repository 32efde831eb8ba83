"""One replica group (1 process) of bench/healing.py's job on torchft 0.2.0, the way its README and train_ddp.py show:
a Manager with state_dict/load_state_dict callbacks, its DistributedDataParallel and OptimizerWrapper, gloo on CPU, the
Lighthouse at TORCHFT_LIGHTHOUSE. Runs in .venv-torchft (bench/healing_setup.sh).

Prints one JSON line per committed step ``{"replica", "step", "t", "digest", "world"}`` (digest of parameters +
momentum; ``world``: the replica groups in the step's quorum),
and once ``{"event": "servers", ...}`` (the ports it serves on, for the driver to name its listening sockets). With
BENCH_KILL_MOMENT set, it SIGKILLs itself in the first step that starts after BENCH_KILL_FILE exists, at that moment
(healing_model.MOMENTS), after printing ``{"event": "killed", "t": ...}``.

Lines of user code the recovery needs: every line marked ``# [ft]`` below (imports, the replica group's store that
the Manager requires, the callbacks, the Manager, the wrappers, the loop's quorum/commit calls and the step read
back); ``RECOVERY_LINES`` lists them as read from this file, and the first output line carries their count.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore  # [ft]
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # [ft]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import healing_model

MARK = "# [ft]"
RECOVERY_LINES = [line.strip() for line in Path(__file__).read_text().splitlines()
                  if line.rstrip().endswith(MARK)]


def emit(**fields: object) -> None:
    """One JSON line on stdout, flushed (the driver stamps it when it arrives; ``t`` is the worker's own clock)."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def die() -> None:
    """The victim's end: the kill time printed first, then SIGKILL to this process (pid-specific)."""
    emit(event="killed", t=time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    """The training loop; runs until BENCH_MAX_SECONDS or until killed."""
    replica = int(os.environ["BENCH_REPLICA"])
    state_mb = float(os.environ["BENCH_STATE_MB"])
    moment = os.environ.get("BENCH_KILL_MOMENT", "")
    kill_file = os.environ.get("BENCH_KILL_FILE", "")
    deadline = time.monotonic() + float(os.environ.get("BENCH_MAX_SECONDS", "300"))
    torch.set_num_threads(1)
    emit(event="start", replica=replica, t=time.time(), pid=os.getpid(), lines=len(RECOVERY_LINES))
    model, optimizer = healing_model.build(state_mb)
    inputs, targets = healing_model.batch(state_mb, replica)

    def load_state_dict(state_dict: dict) -> None:  # [ft]
        model.load_state_dict(state_dict["model"])  # [ft]
        optimizer.load_state_dict(state_dict["optim"])  # [ft]

    def state_dict() -> dict:  # [ft]
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}  # [ft]

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # [ft]
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,  # [ft]
                      load_state_dict=load_state_dict, state_dict=state_dict,  # [ft]
                      replica_id=f"healing_{replica}", store_addr="127.0.0.1", store_port=store.port,  # [ft]
                      rank=0, world_size=1, hostname="127.0.0.1", timeout=timedelta(seconds=30))  # [ft]
    ddp_model = DistributedDataParallel(manager, model)  # [ft]
    ft_optimizer = Optimizer(manager, optimizer)  # [ft]

    # The benchmark's own view of what this group serves (private attributes, read only to name the sockets).
    emit(event="servers", replica=replica, store=store.port, manager=manager._manager.address(),
         checkpoint=manager._checkpoint_transport.address())

    armed = [False]
    if moment == "during":  # the victim dies right after launching its first gradient all-reduce of the step
        launch = manager.allreduce

        def allreduce_then_die(tensor: torch.Tensor, *args: object, **kwargs: object):
            work = launch(tensor, *args, **kwargs)
            if armed[0]:
                die()
            return work

        manager.allreduce = allreduce_then_die  # type: ignore[method-assign]

    last = manager.current_step()
    while time.monotonic() < deadline:
        armed[0] = bool(moment) and bool(kill_file) and os.path.exists(kill_file)
        if armed[0] and moment == "before":
            die()
        if armed[0] and moment == "at_ms":
            threading.Timer(healing_model.AT_MS / 1000, die).start()
        ft_optimizer.zero_grad()  # [ft]
        loss = healing_model.loss_of(ddp_model, inputs, targets)
        loss.backward()
        if armed[0] and moment == "after":
            die()
        ft_optimizer.step()  # [ft]
        step = manager.current_step()  # [ft]
        if step != last:
            emit(replica=replica, step=step, t=time.time(), digest=healing_model.digest(model, optimizer),
                 world=manager.num_participants())
            last = step
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
