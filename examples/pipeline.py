"""Pipeline parallelism over the topology: stage i of a small MLP runs on process i, and activations move
between stages with ``ifrt.transfer.Channels`` over the endpoints the topology carries.

    python examples/pipeline.py --processes 4                   # numpy stages
    python examples/pipeline.py --processes 4 --runtime jax     # JAX stages started by ifrt.jax.initialize()
    python examples/pipeline.py --processes 4 --runtime torch   # torch stages in a PipelineParallel module

starts a coordinator and N stage processes on loopback, runs the batch once whole and once in microbatches
(so stages work concurrently), and prints ``pipeline: outputs match reference ...`` when the last stage's
output equals the single-process numpy reference: every element within 1e-12 of the output's largest value
(microbatches change matmul batch shapes, and JAX's matmul sums in another order than numpy's, which may change
float rounding); it exits non-zero on a mismatch.

With ``--runtime jax`` each process has 2 CPU devices; its layers are one ``jax.jit`` (float64) on its own row
of a (stage, batch) mesh of the topology, with the batch split over its 2 devices.

With ``--runtime torch`` every process builds the same ``PipelineParallel`` module (examples/pipeline_torch.py):
stage i sits on process i's first device, and ``forward`` moves each activation to the next stage's device, over
``Channels`` when another process owns it (tensors go through numpy without copies). ``--dtype bfloat16`` runs
the stages in bfloat16, which crosses processes as its 16-bit pattern; its reference is the same torch layers
on the same microbatches in one process, and every element must be within two bfloat16 steps (2**-7) of the
output's largest value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ifrt.topology import Topology
    from ifrt.transfer import Channels

WIDTH, LAYERS_PER_STAGE, BATCH, SEED = 512, 2, 1024, 1234
TOLERANCE = 1e-12
BFLOAT16_TOLERANCE = 2**-7  # two steps of bfloat16's 8-bit significand just below 1.0
JAX_DEVICES = 2  # CPU devices per stage process with --runtime jax


def weights(num_stages: int) -> list[np.ndarray]:
    """Every layer's weights, the same in every process (a fixed seed)."""
    rng = np.random.default_rng(SEED)
    return [rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH) for _ in range(num_stages * LAYERS_PER_STAGE)]


def inputs() -> np.ndarray:
    return np.random.default_rng(SEED + 1).standard_normal((BATCH, WIDTH))


def apply(layers: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    for w in layers:
        x = np.tanh(x @ w)
    return x


def jax_layers(topology: Topology, layers: list[np.ndarray],
               row_counts: set[int]) -> Callable[[np.ndarray], np.ndarray]:
    """This stage's layers as one ``jax.jit`` on this process's devices: its row of the (stage, batch) mesh."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ifrt.jax

    per_stage = len(topology.local_devices)
    whole = topology.mesh((topology.num_processes, per_stage), ("stage", "batch"))
    row = whole.submesh((topology.process_id, 0), (1, per_stage))
    if {d.process_id for d in row.device_records()} != {topology.process_id}:
        raise RuntimeError(f"row {topology.process_id} of the mesh {whole.devices.tolist()} is not this process's")
    mesh = ifrt.jax.mesh(row)
    rows, replicated = NamedSharding(mesh, P("batch", None)), NamedSharding(mesh, P())
    placed = [jax.device_put(w, replicated) for w in layers]

    @jax.jit
    def forward(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    def compute(x: np.ndarray) -> np.ndarray:
        return np.asarray(forward(jax.device_put(x, rows), placed))

    for count in row_counts:  # compile every batch shape before the clock starts
        compute(np.zeros((count, WIDTH)))
    return compute


def torch_step(channels: Channels, dtype_name: str,
               devices: list[int]) -> Callable[[np.ndarray | None], np.ndarray | None]:
    """This process's share of a ``PipelineParallel`` whose stage i is on ``devices[i]``, numpy in and out: the
    input where stage 0 runs, the output (as float64) where the last stage runs, None elsewhere."""
    import torch
    from pipeline_torch import PipelineParallel, mlp_stage

    dtype = getattr(torch, dtype_name)
    layers = weights(len(devices))
    stages = [mlp_stage(layers[i * LAYERS_PER_STAGE:(i + 1) * LAYERS_PER_STAGE], dtype) for i in range(len(devices))]
    pipe = PipelineParallel(stages, devices, channels, dtype)

    def step(chunk: np.ndarray | None) -> np.ndarray | None:
        y = pipe(None if chunk is None else torch.from_numpy(chunk).to(dtype))
        return None if y is None else y.to(torch.float64).numpy()

    return step


def torch_reference(num_stages: int, dtype_name: str, microbatches: int) -> np.ndarray:
    """The batch through every stage's torch layers in this one process, in the same microbatches (in bfloat16
    a matmul's rounding depends on its batch shape), as float64."""
    import torch
    from pipeline_torch import mlp_stage

    dtype = getattr(torch, dtype_name)
    layers = mlp_stage(weights(num_stages), dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stages (OMP_NUM_THREADS=1): bfloat16 rounding can depend on the thread count
    try:
        with torch.no_grad():
            return np.concatenate([layers(torch.from_numpy(chunk).to(dtype)).to(torch.float64).numpy()
                                   for chunk in np.array_split(inputs(), microbatches)])
    finally:
        torch.set_num_threads(threads)


def run_stage(runtime: str, microbatches: int, out: Path, dtype: str = "float64") -> None:
    """One pipeline stage: receive from the previous stage's device, compute, send to the next one's."""
    import ifrt

    with ExitStack() as stack:
        if runtime == "jax":
            import jax

            import ifrt.jax

            jax.config.update("jax_enable_x64", True)  # float64, as the numpy reference
            topology = ifrt.jax.initialize(timeout=120)
            client = ifrt.jax.client()
        else:
            client = stack.enter_context(ifrt.Client(timeout=60))
            topology = client.discover()
        channels = stack.enter_context(client.channels())
        stage, stages = topology.process_id, topology.num_processes
        mine = weights(stages)[stage * LAYERS_PER_STAGE:(stage + 1) * LAYERS_PER_STAGE]
        if runtime == "jax":
            shapes = {len(c) for count in (1, microbatches) for c in np.array_split(inputs(), count)}
            compute = jax_layers(topology, mine, shapes)
        else:
            def compute(x: np.ndarray) -> np.ndarray:
                return apply(mine, x)
        first_device = {p.process_id: min(d.id for d in topology.devices if d.process_id == p.process_id)
                        for p in topology.processes}
        prev, nxt = first_device.get(stage - 1), first_device.get(stage + 1)

        def array_step(chunk: np.ndarray | None) -> np.ndarray | None:
            """One (micro)batch through this stage: the output where the last stage runs, None elsewhere."""
            y = compute(chunk if stage == 0 else channels.recv(prev, timeout=60))
            if nxt is None:
                return y
            channels.send(y, nxt)
            return None

        step = (torch_step(channels, dtype, [first_device[p] for p in range(stages)]) if runtime == "torch"
                else array_step)
        results = {}
        for run, count in enumerate((1, 1, microbatches)):  # the first run opens the sockets: not timed
            client.barrier(f"start-{run}", timeout=60)
            started = time.perf_counter()
            outputs = []
            for chunk in (np.array_split(inputs(), count) if stage == 0 else [None] * count):
                y = step(chunk)
                if nxt is None:
                    outputs.append(y)
            if nxt is None and run > 0:
                results[count] = {"seconds": time.perf_counter() - started}
                np.save(out / f"output-{count}.npy", np.concatenate(outputs))
        client.barrier("done", timeout=60)
        if nxt is None:
            (out / "timings.json").write_text(json.dumps(results))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=4, help="pipeline stages, one process each (default %(default)s)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per batch (default %(default)s)")
    p.add_argument("--runtime", choices=("numpy", "jax", "torch"), default="numpy",
                   help="what computes each stage's layers (default %(default)s)")
    p.add_argument("--dtype", choices=("float64", "bfloat16"), default="float64",
                   help="the stages' dtype; bfloat16 with --runtime torch only (default %(default)s)")
    p.add_argument("--stage", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        run_stage(args.runtime, args.microbatches, args.out, args.dtype)
        return 0
    if args.dtype != "float64" and args.runtime != "torch":
        p.error(f"--dtype {args.dtype} needs --runtime torch: the {args.runtime} runtime computes in float64")
    if args.runtime == "jax" and BATCH % (args.microbatches * JAX_DEVICES):
        p.error(f"--runtime jax splits each microbatch over {JAX_DEVICES} devices: --microbatches must divide "
                f"{BATCH // JAX_DEVICES}")

    from coordinator.local import LocalCoordinator

    with tempfile.TemporaryDirectory() as tmp, LocalCoordinator(num_processes=args.processes,
                                                                log_level="WARNING") as coordinator:
        out = Path(tmp)
        stages = []
        for stage in range(args.processes):
            env = dict(os.environ, IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID=str(stage),
                       IFRT_NUM_PROCESSES=str(args.processes), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            if args.runtime == "jax":
                env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(JAX_DEVICES), IFRT_PLUGIN="jax")
            stages.append(subprocess.Popen([sys.executable, __file__, "--stage", "--runtime", args.runtime,
                                            "--microbatches", str(args.microbatches), "--dtype", args.dtype,
                                            "--out", tmp], env=env))
        codes = [s.wait(timeout=300) for s in stages]
        if any(codes):
            print(f"pipeline: stage exit codes {codes}; coordinator log:\n{coordinator.log}", file=sys.stderr)
            return 1
        timings = json.loads((out / "timings.json").read_text())
        results = {int(k): np.load(out / f"output-{k}.npy") for k in timings}

    if args.dtype == "float64":
        exact = apply(weights(args.processes), inputs())
        references, tolerance = dict.fromkeys(results, exact), TOLERANCE
    else:
        references = {k: torch_reference(args.processes, args.dtype, k) for k in results}
        tolerance = BFLOAT16_TOLERANCE
    worst = max(float(np.max(np.abs(r - references[k]))) / float(np.max(np.abs(references[k])))
                for k, r in results.items())
    rows = BATCH / np.array([timings[str(k)]["seconds"] for k in sorted(results)])
    if worst > tolerance:
        print(f"pipeline: MISMATCH: largest relative error {worst:.3g} > {tolerance:g}", file=sys.stderr)
        return 1
    runtime = {"numpy": "", "jax": ", jax runtime", "torch": f", torch runtime ({args.dtype})"}[args.runtime]
    print(f"pipeline: outputs match reference (largest relative error {worst:.2g}, tolerance {tolerance:g}) "
          f"over {args.processes} stages of {LAYERS_PER_STAGE} layers, batch {BATCH}x{WIDTH}{runtime}")
    print(f"pipeline: throughput {rows[0]:.0f} rows/s without microbatching, {rows[-1]:.0f} rows/s with "
          f"{args.microbatches} microbatches ({rows[-1] / rows[0]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
