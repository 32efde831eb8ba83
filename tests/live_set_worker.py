"""One process of a JAX job in recoverable mode that records every ``live_devices`` answer with its call's interval,
for tests/test_jax_recover.py to check (bench/live_sets.py): ``python tests/live_set_worker.py``.

``ifrt.jax.initialize()`` with ``jax_enable_recoverability``, then blocks of ``live_devices(jax.devices())``, each
a sum over the live devices and a short random pause, until the file ``STOP_FILE`` exists. JSON lines:
``{"born", "pid", "process"}`` once started, then for each of ``live_devices``' own calls (its first on entering the
first block, then one on leaving each) ``{"calling": start}`` before it and ``{"call": [start, end], "answer":
[[process, incarnation], ...]}`` once it returned, on the machine's monotonic clock, which every process shares. A
process killed in a call leaves its ``calling`` line alone.
"""

from __future__ import annotations

import json
import os
import random
import time

import jax

jax.config.update("jax_enable_recoverability", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.multihost_utils import live_devices  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import ifrt.jax  # noqa: E402


def say(**line: object) -> None:
    print(json.dumps(line), flush=True)


def answer() -> list[list[int]]:
    return sorted([d.process_index, incarnation] for d, incarnation in live_devices.devices.items())


def total(devices: list) -> float:
    """A sum over the live devices, one 1.0 from each."""
    mesh = jax.make_mesh((len(devices),), ("i",), devices=devices)
    sharding = NamedSharding(mesh, PartitionSpec("i"))
    ones = jax.make_array_from_single_device_arrays((len(devices),), sharding, [
        jax.device_put(np.ones(1, np.float32), d) for d in devices if d.process_index == jax.process_index()])
    return float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(ones))


def main() -> None:
    topology = ifrt.jax.initialize()
    say(born=time.monotonic(), pid=os.getpid(), process=topology.process_id)
    stop, first = os.environ["STOP_FILE"], True
    while not os.path.exists(stop):
        before = time.monotonic()
        if first:
            say(calling=before)
        left = None
        try:
            with live_devices(jax.devices()) as devices:
                if first:
                    say(call=[before, time.monotonic()], answer=answer())
                    first = False
                try:
                    assert total(ifrt.jax.live_order(devices)) == len(devices)
                    time.sleep(random.uniform(0, 0.05))
                finally:
                    left = time.monotonic()
                    say(calling=left)
        except Exception:  # a process failed or was replaced during the block
            pass
        if left is not None:
            say(call=[left, time.monotonic()], answer=answer())
        else:
            first = True  # the first call failed: the next block asks again on entering


if __name__ == "__main__":
    main()
