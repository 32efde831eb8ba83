"""Pipeline parallelism over the topology: stage i of a small numpy MLP runs on process i, and activations move
between stages with ``ifrt.transfer.Channels`` over the endpoints the topology carries.

    python examples/pipeline.py --processes 4

starts a coordinator and N stage processes on loopback, runs the batch once whole and once in microbatches
(so stages work concurrently), and prints ``pipeline: outputs match reference ...`` when the last stage's
output equals the single-process reference (within 1e-12 relative: microbatches change matmul batch shapes,
which may change float rounding); it exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIDTH, LAYERS_PER_STAGE, BATCH, SEED = 512, 2, 1024, 1234
TOLERANCE = 1e-12


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


def run_stage(microbatches: int, out: Path) -> None:
    """One pipeline stage: receive from the previous stage's device, compute, send to the next one's."""
    import ifrt

    with ifrt.Client(timeout=60) as client, client.channels() as channels:
        topology = client.discover()
        stage, stages = topology.process_id, topology.num_processes
        mine = weights(stages)[stage * LAYERS_PER_STAGE:(stage + 1) * LAYERS_PER_STAGE]
        first_device = {p.process_id: min(d.id for d in topology.devices if d.process_id == p.process_id)
                        for p in topology.processes}
        prev, nxt = first_device.get(stage - 1), first_device.get(stage + 1)
        results = {}
        for run, count in enumerate((1, 1, microbatches)):  # the first run opens the sockets: not timed
            client.barrier(f"start-{run}", timeout=60)
            started = time.perf_counter()
            outputs = []
            for chunk in (np.array_split(inputs(), count) if stage == 0 else range(count)):
                x = chunk if stage == 0 else channels.recv(prev, timeout=60)
                y = apply(mine, x)
                if nxt is None:
                    outputs.append(y)
                else:
                    channels.send(y, nxt)
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
    p.add_argument("--stage", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        run_stage(args.microbatches, args.out)
        return 0

    from coordinator.local import LocalCoordinator

    with tempfile.TemporaryDirectory() as tmp, LocalCoordinator(num_processes=args.processes,
                                                                log_level="WARNING") as coordinator:
        out = Path(tmp)
        stages = []
        for stage in range(args.processes):
            env = dict(os.environ, IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID=str(stage),
                       IFRT_NUM_PROCESSES=str(args.processes), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            stages.append(subprocess.Popen([sys.executable, __file__, "--stage", "--microbatches",
                                            str(args.microbatches), "--out", tmp], env=env))
        codes = [s.wait(timeout=300) for s in stages]
        if any(codes):
            print(f"pipeline: stage exit codes {codes}; coordinator log:\n{coordinator.log}", file=sys.stderr)
            return 1
        timings = json.loads((out / "timings.json").read_text())
        results = {int(k): np.load(out / f"output-{k}.npy") for k in timings}

    reference = apply(weights(args.processes), inputs())
    worst = max(float(np.max(np.abs(r - reference) / np.maximum(np.abs(reference), 1e-300))) for r in results.values())
    rows = BATCH / np.array([timings[str(k)]["seconds"] for k in sorted(results)])
    if worst > TOLERANCE:
        print(f"pipeline: MISMATCH: largest relative error {worst:.3g} > {TOLERANCE}", file=sys.stderr)
        return 1
    print(f"pipeline: outputs match reference (largest relative error {worst:.2g}, tolerance {TOLERANCE:g}) "
          f"over {args.processes} stages of {LAYERS_PER_STAGE} layers, batch {BATCH}x{WIDTH}")
    print(f"pipeline: throughput {rows[0]:.0f} rows/s without microbatching, {rows[-1]:.0f} rows/s with "
          f"{args.microbatches} microbatches ({rows[-1] / rows[0]:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
