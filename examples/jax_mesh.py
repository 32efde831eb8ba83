"""JAX across processes, started from ifrt's topology: a sharded matmul whose sum crosses processes.

    python examples/jax_mesh.py --processes 4

starts a coordinator and N processes of 2 CPU devices on loopback. Each calls ``ifrt.jax.initialize()`` with
no process id (the coordinator assigns them), builds ``topology.mesh((2, N), ("data", "model"))``, converts it
with ``ifrt.jax.mesh`` and runs a jitted ``x @ w`` with ``x`` sharded over both axes and ``w`` over "model", so
XLA sums partial products over "model" across processes (gloo), plus a total over every device. It prints
``jax: outputs match reference ...`` when every process's addressable shards equal numpy's result (small
integers in float32: every sum is exact, so the comparison is bit for bit); it exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROWS, INNER, COLS, SEED = 256, 512, 128, 7


def operands():
    """The same x and w in every process (a fixed seed), small integers in float32."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    return (rng.integers(-4, 5, (ROWS, INNER)).astype(np.float32),
            rng.integers(-4, 5, (INNER, COLS)).astype(np.float32))


def run_process() -> dict:
    """One process: start JAX from the topology, compute on the whole mesh, compare with numpy."""
    started = time.perf_counter()
    import ifrt.jax

    topology = ifrt.jax.initialize(timeout=120)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ifrt_mesh = topology.mesh((2, len(topology.devices) // 2), ("data", "model"))
    mesh = ifrt.jax.mesh(ifrt_mesh)
    ready = time.perf_counter() - started
    x, w = operands()
    gx = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("data", "model")), lambda i: x[i])
    gw = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("model", None)), lambda i: w[i])

    @jax.jit
    def step(a, b):
        y = jax.lax.with_sharding_constraint(a @ b, NamedSharding(mesh, P("data", None)))  # a sum over "model"
        return y, jnp.sum(y)  # a sum over every device

    y, total = step(gx, gw)
    reference = x @ w
    shards_match = all(np.array_equal(np.asarray(s.data), reference[s.index]) for s in y.addressable_shards)
    return {"process_id": topology.process_id, "jax_process_index": jax.process_index(),
            "fingerprint": topology.fingerprint, "mesh": ifrt_mesh.devices.tolist(),
            "shards": len(y.addressable_shards), "shards_match": bool(shards_match),
            "total_matches": float(total) == float(reference.sum()), "seconds_to_mesh": ready}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4, help="JAX processes (default %(default)s)")
    p.add_argument("--devices", type=int, default=2, help="CPU devices per process (default %(default)s)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(run_process()), flush=True)
        return 0
    if args.processes * args.devices % 2:
        p.error("--processes x --devices must be even: the mesh has two rows")

    from coordinator.local import LocalCoordinator

    with LocalCoordinator(num_processes=args.processes, log_level="WARNING") as coordinator:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_"))}
        base.update(IFRT_COORDINATOR=coordinator.address, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.devices),
                    OMP_NUM_THREADS="1")
        workers = [subprocess.Popen([sys.executable, __file__, "--worker"], stdout=subprocess.PIPE, text=True,
                                    env=dict(base, IFRT_LOCAL_RANK=str(rank))) for rank in range(args.processes)]
        outputs = [w.communicate(timeout=300)[0] for w in workers]
        codes = [w.returncode for w in workers]
        if any(codes):
            print(f"jax: process exit codes {codes}; coordinator log:\n{coordinator.log}", file=sys.stderr)
            return 1
    answers = sorted((json.loads(out.strip().splitlines()[-1]) for out in outputs), key=lambda a: a["process_id"])
    for a in answers:
        print(f"process {a['process_id']}: jax.process_index() {a['jax_process_index']}, {a['shards']} shards, "
              f"mesh ready {a['seconds_to_mesh']:.2f}s after start, fingerprint {a['fingerprint'][:12]}")
    wrong = [a["process_id"] for a in answers if not (a["shards_match"] and a["total_matches"])
             or a["jax_process_index"] != a["process_id"]]
    if wrong or len({a["fingerprint"] for a in answers}) != 1:
        print(f"jax: MISMATCH in processes {wrong} (or the topologies differ)", file=sys.stderr)
        return 1
    devices = args.processes * args.devices
    print(f"jax: outputs match reference (bit for bit) in all {args.processes} processes: x[{ROWS}x{INNER}] @ "
          f"w[{INNER}x{COLS}] on a (2, {devices // 2}) data x model mesh of {devices} devices, summed over 'model' "
          "across processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
