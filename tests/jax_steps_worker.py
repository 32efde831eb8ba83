"""One process of a JAX job that computes across processes step by step: ``python tests/jax_steps_worker.py``.

``ifrt.jax.initialize()`` (``COORDINATION``: "ifrt", the default, or "jax"), then ``STEPS`` steps (default 1000),
``INTERVAL`` seconds apart (default 0.05): each a cross-process gather of every process's step number, checked, a
vote (``ifrt.jax.should_commit``) and a line ``step <n>`` on stdout. At the end one JSON object: the process id, the
steps done, the steps the vote kept, and whether JAX's service ran in this process.

``SCENARIO=refuse``: JAX's client only, on a stand-in of this process; process 1 inserts a local topology of 3
devices where ifrt registered 1, process 0 waits for it; each prints what JAX's client raised and after how long.
"""

from __future__ import annotations

import json
import os
import time

import ifrt.jax


def main() -> None:
    topology = ifrt.jax.initialize(timeout=60, coordination=os.environ.get("COORDINATION", "ifrt"))
    import jax.numpy as jnp
    from jax._src import distributed
    from jax.experimental import multihost_utils

    steps, interval = int(os.environ.get("STEPS", "1000")), float(os.environ.get("INTERVAL", "0.05"))
    committed = 0
    for step in range(steps):
        gathered = multihost_utils.process_allgather(jnp.array([step]))
        assert gathered.reshape(-1).tolist() == [step] * topology.num_processes, gathered
        committed += ifrt.jax.should_commit()
        print(f"step {step}", flush=True)
        time.sleep(interval)
    print(json.dumps({"process_id": topology.process_id, "steps": steps, "committed": committed,
                      "service_here": distributed.global_state.service is not None}), flush=True)


def refuse() -> None:
    from jax._src import distributed

    from ifrt._generated import xla_topology_pb2 as xla_pb
    from ifrt.jax.xla_standin.server import StandInServer
    from ifrt.jax.xla_standin.service import CoordinationStandIn

    client = ifrt.Client(timeout=60)
    topology = client.discover()
    server = StandInServer(CoordinationStandIn(client, topology, f"test/{topology.fingerprint[:16]}"))
    ifrt.jax.connect_client(server.address, client, time.monotonic() + 60)
    jax_client = distributed.global_state.client
    started = time.monotonic()
    try:
        if topology.process_id == 1:
            three = xla_pb.LocalTopology(process_id=1, devices=[
                xla_pb.Device(local_device_ordinal=i, name=f"TFRT_CPU_{i}", device_kind="cpu") for i in range(3)])
            jax_client.key_value_set_bytes("cpu:local_topology/cpu/1", three.SerializeToString())
        else:
            jax_client.blocking_key_value_get_bytes("cpu:local_topology/cpu/1", 30_000)
        error = ""
    except Exception as e:  # JAX's client raises its own runtime error, with the service's words in it
        error = str(e)
    print(json.dumps({"process_id": topology.process_id, "error": error,
                      "after_s": time.monotonic() - started}), flush=True)
    os._exit(0)  # JAX's client would wait in its shutdown barrier for a peer that is gone


if __name__ == "__main__":
    refuse() if os.environ.get("SCENARIO") == "refuse" else main()
