"""One process of a fail-fast test job: ``python tests/failfast_worker.py RUNTIME SCENARIO`` (RUNTIME: jax or torch).

Each process starts its runtime through ifrt, then runs a cross-process sum in a loop, printing ``step N`` lines.
Scenarios:
  loop    loops until LOOP_S passes (a peer's failure should end it long before: exit code 75, one line on stderr)
  finish  STEPS steps, then a pause of 0.3 s per process id, then a normal end (nobody ends early)
  bug     process 2 raises an uncaught exception at step 5 (a bug in this program), the others loop
  raise   on_failure="raise": after a collective's error, waits for the typed error in the main thread, prints it as
          JSON and returns
"""

from __future__ import annotations

import json
import sys
import time

LOOP_S = 60.0
STEPS = 20
TIMEOUT = 60.0


def jax_runtime(on_failure: str):
    """(process id, one step): a jitted sum over an array with one element on each process's device."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ifrt.jax

    topology = ifrt.jax.initialize(timeout=TIMEOUT, on_failure=on_failure)
    n = len(topology.devices)
    mesh = ifrt.jax.mesh(topology.mesh((n,), ("p",)))
    values = np.arange(n, dtype=np.float32)
    x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("p")), lambda index: values[index])
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))

    def step() -> float:
        return float(total(x).addressable_data(0))

    return topology.process_id, step


def torch_runtime(on_failure: str):
    import torch
    import torch.distributed as dist

    import ifrt.torch

    topology = ifrt.torch.init_process_group(timeout=TIMEOUT, on_failure=on_failure)

    def step() -> float:
        value = torch.tensor([float(topology.process_id)])
        dist.all_reduce(value)
        return value.item()

    return topology.process_id, step


def main(runtime: str, scenario: str) -> None:
    import ifrt.errors

    process_id, step = {"jax": jax_runtime, "torch": torch_runtime}[runtime]("raise" if scenario == "raise" else "exit")
    started = time.monotonic()
    steps = 0
    try:
        try:
            while time.monotonic() - started < LOOP_S and (scenario != "finish" or steps < STEPS):
                if scenario == "bug" and process_id == 2 and steps == 5:
                    raise AssertionError("a bug in process 2")
                step()
                steps += 1
                print(f"step {steps}", flush=True)
                time.sleep(0.02)
        except (RuntimeError, ValueError):
            if scenario != "raise":
                raise
            # a collective broken by a dead peer: ifrt's error says who and why
            time.sleep(LOOP_S)
    except ifrt.errors.JobFailed as e:
        print(json.dumps({"caught": type(e).__name__, "process_id": e.process_id, "exit_code": e.exit_code,
                          "me": process_id}), flush=True)
        return
    if scenario == "finish":
        time.sleep(0.3 * process_id)
        if runtime == "torch":
            import torch.distributed as dist

            dist.destroy_process_group()
        print(json.dumps({"finished": steps, "me": process_id}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
