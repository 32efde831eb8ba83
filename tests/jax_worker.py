"""One JAX process of a test cluster: ``python tests/jax_worker.py SCENARIO``; prints one JSON object.

Scenarios:
  mesh            ifrt.jax.initialize(), a sharded matmul reduced across processes on ifrt.jax.mesh(...)
  narrowed        ifrt.jax.initialize(local_device_ids=$NARROW), expected to fail with TopologyError
  plugin-then-jax ifrt.discover(plugin="jax"), then jax.distributed.initialize by hand
  backend-first   a JAX computation, then ifrt.jax.initialize(), expected to be refused
  token           ifrt.jax.initialize(token=$TEST_CLUSTER_TOKEN), the token given only as the argument
  network         mesh, plus this process's network path and XLA's network variable after initialize
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

TIMEOUT = 60.0


def sharded_matmul(jax_mesh, rows: int = 8, inner: int = 16, cols: int = 4):
    """x @ w with x sharded over ("data", "model") and w over "model": the result needs a sum over "model".

    Small integers in float32 keep every sum exact, so the result must equal numpy's bit for bit.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(7)
    x = rng.integers(-4, 5, (rows, inner)).astype(np.float32)
    w = rng.integers(-4, 5, (inner, cols)).astype(np.float32)
    x_sharding, w_sharding = NamedSharding(jax_mesh, P("data", "model")), NamedSharding(jax_mesh, P("model", None))
    gx = jax.make_array_from_callback(x.shape, x_sharding, lambda index: x[index])
    gw = jax.make_array_from_callback(w.shape, w_sharding, lambda index: w[index])
    y = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(jax_mesh, P("data", None)))(gx, gw)
    reference = x @ w
    return all(np.array_equal(np.asarray(s.data), reference[s.index]) for s in y.addressable_shards), \
        len(y.addressable_shards)


def mesh() -> dict:
    import jax

    import ifrt.jax

    topology = ifrt.jax.initialize(timeout=TIMEOUT)
    again = ifrt.jax.initialize(timeout=TIMEOUT)
    ifrt_mesh = topology.mesh((2, len(topology.devices) // 2), ("data", "model"))
    jax_mesh = ifrt.jax.mesh(ifrt_mesh)
    half = ifrt.jax.mesh(ifrt_mesh.submesh((1, 0), (1, ifrt_mesh.shape[1])))
    # an order that is not the ids' (as a network order need not be): JAX gets it as it is
    shuffled = topology.mesh(ifrt_mesh.shape, ("data", "model"), devices=ifrt_mesh.devices.reshape(-1)[::-1].tolist())
    matches, shards = sharded_matmul(jax_mesh)
    return {
        "process_id": topology.process_id,
        "jax_process_index": jax.process_index(),
        "fingerprint": topology.fingerprint,
        "same_topology_again": again is topology,
        "axis_names": list(jax_mesh.axis_names),
        "ifrt_mesh": ifrt_mesh.devices.tolist(),
        "jax_mesh_ids": [[d.id for d in row] for row in jax_mesh.devices],
        "jax_mesh_processes": [[d.process_index for d in row] for row in jax_mesh.devices],
        "submesh_ids": [[d.id for d in row] for row in half.devices],
        "reversed_ifrt_processes": (shuffled.devices >> 17).tolist(),
        "reversed_jax_processes": [[d.process_index for d in row] for row in ifrt.jax.mesh(shuffled).devices],
        "jax_local_ids": sorted(d.id for d in jax.local_devices()),
        "result_matches_reference": matches,
        "addressable_shards": shards,
    }


def narrowed() -> dict:
    import ifrt
    import ifrt.jax

    narrow = os.environ.get("NARROW")
    started = time.monotonic()
    try:
        ifrt.jax.initialize(timeout=TIMEOUT, local_device_ids=[int(i) for i in narrow.split(",")] if narrow else None)
    except ifrt.TopologyError as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def plugin_then_jax() -> dict:
    import jax
    from jax._src import distributed

    import ifrt

    topology = ifrt.discover(plugin="jax", timeout=TIMEOUT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0, initialization_timeout=30)
    return {"ifrt": [[d.platform, d.kind, d.local_id] for d in topology.local_devices],
            "jax": [[d.platform, d.device_kind] for d in jax.local_devices()],
            "distributed": distributed.global_state.client is not None}


def backend_first() -> dict:
    import jax

    import ifrt.jax

    jax.numpy.zeros(2).block_until_ready()
    try:
        ifrt.jax.initialize(timeout=TIMEOUT)
    except RuntimeError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def with_token() -> dict:
    import jax

    import ifrt.jax

    topology = ifrt.jax.initialize(timeout=TIMEOUT, token=os.environ["TEST_CLUSTER_TOKEN"])
    return {"process_id": topology.process_id, "jax_process_index": jax.process_index()}


def network() -> dict:
    import ifrt.jax

    answer = mesh()
    return {**answer, "network": list(ifrt.jax.topology().process(answer["process_id"]).network),
            "xla_network_nodes": os.environ.get("XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES")}


SCENARIOS = {"mesh": mesh, "narrowed": narrowed, "plugin-then-jax": plugin_then_jax, "backend-first": backend_first,
             "token": with_token, "network": network}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()), flush=True)
