"""JAX's fault-tolerant data parallelism on ifrt: when any process dies, process 0 included, the others go on, and a
replaced process is healed by a live peer. One CPU device per process::

    ifrt-coordinator --num-processes 3 &
    IFRT_COORDINATOR=127.0.0.1:8476 ifrt run --nproc 3 --recover replace -- python examples/jax_fault_tolerance.py

The program has the shape of the examples in JAX's "Fault Tolerant Distributed JAX": JAX's recoverable mode, and
every step inside ``live_devices``, which gives every live process the same live devices and raises in all of them
if one of those processes failed or was replaced during the step (the step is then taken again). A linear model
``a * x`` learns ``a = 10`` on a batch sharded over the live devices. What differs from JAX's:

- ``ifrt.jax.initialize()`` instead of ``jax.distributed.initialize(address, process_id, num_processes)``: no
  process runs the coordination service, so none is special.
- ``HEAL=1`` (default) is ``data_parallelism_with_recovery``: each step begins with an all-gather of the processes'
  step counts, and a process behind the others (a replacement) gets the weights and the step from the first live
  process that is furthest along, not from process 0 (which may be the one replaced), in one sum over the live
  devices. ``HEAL=0`` is
  ``data_parallelism``: survivors go on, a replacement starts from the initial weights.

One JSON line at the start (``{"started": process id, "pid"}``) and one per step on stdout (``{"step", "live",
"loss", "weights"}``, or ``{"failed", "error"}``);
``STEPS`` ends the program after that many steps (default: run until killed), ``INTERVAL`` seconds between steps.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import jax

jax.config.update("jax_enable_recoverability", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.multihost_utils import live_devices  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import ifrt.jax  # noqa: E402


def _mesh(devices: list) -> jax.sharding.Mesh:
    return jax.make_mesh((len(devices),), ("i",), devices=devices)


def replicated(x: jax.Array, devices: list) -> jax.Array:
    """``x`` as an array replicated over ``devices``, this process's copy being its own ``x`` (nothing moves)."""
    sharding = NamedSharding(_mesh(devices), PartitionSpec(None))
    local = [jax.device_put(x.addressable_shards[0].data, d) for d in devices if d.process_index == jax.process_index()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, local)


def sharded(x: np.ndarray | jax.Array, devices: list) -> jax.Array:
    """The global ``x`` sharded over ``devices``: each process puts the shards of its own devices."""
    sharding = NamedSharding(_mesh(devices), PartitionSpec("i"))
    indices = sharding.addressable_devices_indices_map(x.shape)
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [jax.device_put(x[i], d)
                                                                         for d, i in indices.items()])


def from_source(x: jax.Array, source: jax.Device, devices: list) -> jax.Array:
    """``source``'s ``x`` at every device: a sum over ``devices`` to which the others add zeros."""
    mine = x if jax.process_index() == source.process_index else jnp.zeros_like(x)
    psum = jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=_mesh(devices), in_specs=PartitionSpec(None),
                         out_specs=PartitionSpec(None))
    return psum(replicated(mine, devices)).addressable_shards[0].data


def allgather(value: float, devices: list) -> np.ndarray:
    """Every device's ``value`` (one per process here), in the order of ``devices``."""
    gather = jax.shard_map(lambda v: jax.lax.all_gather(v, "i", tiled=True), mesh=_mesh(devices),
                           in_specs=PartitionSpec("i"), out_specs=PartitionSpec("i"))
    gathered = gather(sharded(np.full(len(devices), value, dtype=np.float32), devices))
    return np.asarray(jax.block_until_ready(gathered).addressable_shards[0].data)


def heal(weights: jax.Array, step: int, devices: list) -> tuple[jax.Array, int]:
    """Where a process is behind the others (a replacement), every process takes the weights and the step of the
    first live process furthest along."""
    steps = allgather(step, devices)
    if steps.min() == steps.max():
        return weights, step
    return from_source(weights, devices[int(np.argmax(steps))], devices), int(steps.max())


def say(**line: object) -> None:
    print(json.dumps(line), flush=True)


def train(start: Callable[[], object], order: Callable[[list], list]) -> None:
    """The training loop, on the runtime ``start()`` begins; ``order`` puts each step's live devices in order."""
    start()
    say(started=jax.process_index(), pid=os.getpid())
    healing = os.environ.get("HEAL", "1") != "0"
    steps, interval = int(os.environ.get("STEPS", "0")), float(os.environ.get("INTERVAL", "0.2"))

    keys = iter(jax.random.split(jax.random.key(seed=42), num=3))
    weights = jax.random.normal(next(keys), shape=(1,))
    xs = jax.random.permutation(next(keys), jnp.arange(-300.0, 300.0))
    ys = 10 * xs + jax.random.normal(next(keys), xs.shape)
    loss_and_grad = jax.jit(jax.value_and_grad(lambda w, x, y: jnp.mean((w * x - y) ** 2)))
    learning_rate, per_device = 1e-6, 10

    step = 0
    while not steps or step < steps:
        try:
            with live_devices(jax.devices()) as devices:
                devices = order(devices)
                if healing:
                    weights, step = heal(weights, step, devices)
                weights = replicated(weights, devices)
                start_at = (step * per_device * len(devices)) % len(xs)
                batch = slice(start_at, start_at + per_device * len(devices))
                loss, grad = loss_and_grad(weights, sharded(xs[batch], devices), sharded(ys[batch], devices))
                new_weights = jax.block_until_ready(weights - learning_rate * grad)
        except Exception as e:  # a process failed or was replaced during the step: take it again
            say(failed=step, error=str(e)[:300])
        else:
            weights = new_weights
            say(step=step, live=sorted({d.process_index for d in devices}), loss=float(loss),
                weights=float(np.asarray(weights.addressable_shards[0].data)[0]).hex())
            step += 1
        time.sleep(interval)


def main() -> None:
    # live_order: new after a replacement, for jaxlib's CPU collectives (docs/jax.md, "Fault tolerance")
    train(ifrt.jax.initialize, ifrt.jax.live_order)


if __name__ == "__main__":
    main()
