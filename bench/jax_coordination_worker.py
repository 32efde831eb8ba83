"""One JAX process of bench/jax_coordination.py: ``ifrt.jax.initialize(coordination=WAY)``, then small
cross-process computations in a loop, one line per step.

    python bench/jax_coordination_worker.py --way ifrt|jax [--steps N] [--step-seconds S] [--max-seconds S]
        [--barrier] [--startup]

Each step is a jitted sum over an array with one shard on every device of every process (an all-reduce over gloo
between the processes), checked against the expected value; with ``--barrier``, then a barrier of JAX's distributed
client (``wait_at_barrier``: a call to JAX's coordination service). Prints, on stdout:

    started process P way W attempt A pid PID imports 1.234s start 0.456s t 1767052800.123
    step 7 process P attempt A pid PID value 6.0 t 1767052800.456

and ``--startup``: one JSON line after the first computation (times from the parent's spawn, ``BENCH_SPAWNED_AT``),
then a normal end. ``--steps 0`` loops until ``--max-seconds`` (a peer's failure is to end it long before).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SPAWN_ENV = "BENCH_SPAWNED_AT"
"""Wall-clock ``time.time()`` of the parent just before it started this process (``--startup``)."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--way", choices=("ifrt", "jax"), default=os.environ.get("BENCH_COORDINATION", "ifrt"),
                   help="who serves JAX's coordination (default: $BENCH_COORDINATION, else ifrt)")
    p.add_argument("--steps", type=int, default=0, help="steps to compute, then a normal end (0: until --max-seconds)")
    p.add_argument("--step-seconds", type=float, default=0.05, help="pause after each step (default %(default)s)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="the longest the loop runs (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="discovery timeout (default %(default)s)")
    p.add_argument("--startup", action="store_true", help="one computation, its timings as JSON, then the end")
    p.add_argument("--barrier", action="store_true",
                   help="after each step, a barrier of JAX's own distributed client (a call to JAX's coordination "
                        "service: ifrt's stand-in, or XLA's service in process 0)")
    args = p.parse_args()
    began = time.time()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ifrt.jax

    imported = time.time()
    topology = ifrt.jax.initialize(timeout=args.timeout, coordination=args.way)
    initialized = time.time()
    n = len(topology.devices)
    mesh = ifrt.jax.mesh(topology.mesh((n,), ("p",)))
    values = np.arange(n, dtype=np.float32)
    x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("p")), lambda index: values[index])
    total = jax.jit(lambda a, s: (a + s).sum(), out_shardings=NamedSharding(mesh, P()))
    me, attempt = topology.process_id, os.environ.get("IFRT_ATTEMPT", "-")

    def step(k: int) -> float:
        got = float(total(x, np.float32(k % 16)).addressable_data(0))
        expected = float(values.sum() + n * (k % 16))
        if got != expected:
            raise AssertionError(f"step {k}: the sum is {got}, expected {expected}")
        if args.barrier:
            from jax._src import distributed

            distributed.global_state.client.wait_at_barrier(f"bench-step-{k}", 120_000)
        return got

    if args.startup:
        step(0)
        ready = time.time()
        spawned = float(os.environ[SPAWN_ENV])
        print(json.dumps({"process": me, "to_first_computation_s": ready - spawned, "interpreter_s": began - spawned,
                          "import_s": imported - began, "initialize_s": initialized - imported,
                          "first_computation_s": ready - initialized}), flush=True)
        return 0
    print(f"started process {me} way {args.way} attempt {attempt} pid {os.getpid()} imports {imported - began:.3f}s "
          f"start {initialized - imported:.3f}s t {time.time():.3f}", flush=True)
    started = time.monotonic()
    k = 0
    while (k < args.steps if args.steps else time.monotonic() - started < args.max_seconds):
        value = step(k)
        k += 1
        print(f"step {k} process {me} attempt {attempt} pid {os.getpid()} value {value} t {time.time():.3f}",
              flush=True)
        time.sleep(args.step_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
