"""Meshes over a model fabric: which mesh axes cross racks, blocks and the spine under each peer's process order.

    .venv/bin/python bench/fabric.py                # both fabrics, every hostname form, a 2-D and a 3-D mesh
    .venv/bin/python bench/fabric.py --jaxlib-check # also runs jaxlib's own topology exchange on 4 processes

A fabric of 1,024 hosts of 8 devices: uniform (racks of 16 hosts, 8 racks a block, 8 blocks under one spine) or
non-uniform (racks of 10 to 22 hosts, drawn with a fixed seed, 8 racks a block). Hostnames take the forms real
clusters use: ``node1``..``node1024`` numbered in rack order (``node7`` next to ``node66``), cloud names made of a
host address that says nothing about the rack (``ip-10-1-7-66``), and Kubernetes pod names (``train-workers-0-17-
x2k9q``) whose position comes from the node's labels. Every order lays the mesh out the same way: hosts in the
order given, a host's 8 devices adjacent, reshaped to the mesh shape (what ``jax.make_mesh`` over
``jax.devices()`` and torch's ``init_device_mesh`` do with ranks).

Columns (process orders):

- ``ifrt``: ``Topology.mesh`` of this change (network path level by level, then hostname, both in natural order),
  over a topology whose process ids are the launcher's (explicit ids, in no network order).
- ``ifrt_ids``: the hosts in the order of the ids the coordinator assigns (its own ``assign_process_ids`` on
  registrations in arrival order: network path, then hostname, naturally), laid out as they come (what a mesh
  built from ids alone gets).
- ``hostname_text``: torch's dynamic rendezvous (``sorted`` over its ``_NodeDesc`` of the agents' FQDNs: its own
  code), which is also ifrt's id order before this change (hostname as text).
- ``launcher``: the arrival order of the processes (random), or the Kubernetes completion index for pods.
- ``xla``: XLA's ``network_nodes`` order (``topology_util.cc``): a stable sort of the launcher's process ids on the
  network path, levels compared as text; re-implemented here (one jaxlib process per host cannot run here for
  1,024 hosts). ``--jaxlib-check`` runs jaxlib's own exchange on 4 processes and checks that the process indices
  it gives agree (jaxlib 0.10.2 reads the variable: it renumbers ``process_index``, not the device ids).
- ``optimum``: a lower bound, per axis and level, on the rings that cross the level and on the all-reduce time, for
  layouts that give inner axes priority (tensor inside a host, then fsdp's rings with their tensor groups inside the
  fewest racks): for axis k with n devices a ring and a span P (the axis and those inside it), at a level whose
  domains hold s_i devices, at least F - sum(floor(s_i / P)) * P / n of its F rings cross it, and its all-reduce
  runs at the bandwidth of the highest level some ring must cross. (It bounds rings, not links: the links a
  crossing ring needs depend on how the outer axes are laid, so the column has none.)

The all-reduce time of an axis is its slowest ring's: 2 (n - 1) / n * BUCKET bytes at the bandwidth of the highest
level the ring crosses (BANDWIDTH_GBPS, one direction per device); rings of an axis run at once, contention is not
modelled. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.assignment import assign_process_ids
from coordinator.registration import Registration
from ifrt import wire
from ifrt.ids import LOCAL_ID_BITS
from ifrt.records import Device, Process, TopologyContent
from ifrt.topology import Topology

HOSTS = 1024
DEVICES = 8
RACK_HOSTS = 16
RACKS_PER_BLOCK = 8
LEVELS = ("host", "rack", "block")
"""The domains a ring can leave, innermost first; crossing the block leaves through the spine."""
BANDWIDTH_GBPS = {"inside host": 450.0, "host": 50.0, "rack": 25.0, "block": 12.5}
"""GB/s one direction per device: NVLink inside a host; a ring that crosses hosts (leaf switch, one 400 Gb/s NIC per
GPU), racks (2:1 oversubscribed uplinks) or blocks (4:1 at the spine) runs at that level's rate."""
BUCKET = 1 << 30
"""Bytes each device all-reduces (1 GiB of gradients)."""
MESHES = {"2d": ((8, 1024), ("data", "fsdp")), "3d": ((64, 16, 8), ("data", "fsdp", "tensor"))}
SEED = 31


def uniform_racks() -> list[int]:
    return [RACK_HOSTS] * (HOSTS // RACK_HOSTS)


def unequal_racks(seed: int = SEED) -> list[int]:
    """Racks of 10 to 22 hosts, 1,024 in all (a fixed draw)."""
    rng = random.Random(seed)
    racks: list[int] = []
    while sum(racks) < HOSTS:
        racks.append(min(rng.randint(10, 22), HOSTS - sum(racks)))
    if racks[-1] < 10:
        racks[-2] += racks.pop()
    return racks


def fabric(racks: Sequence[int]) -> list[tuple[str, str, str]]:
    """(spine, block, rack) of each host, hosts in rack order; names numbered from 1 (``rack9`` next to ``rack10``)."""
    paths = []
    for r, size in enumerate(racks):
        paths += [("spine", f"block{r // RACKS_PER_BLOCK + 1}", f"rack{r + 1}")] * size
    return paths


def hostnames(form: str, n: int, rng: random.Random) -> tuple[list[str], list[int]]:
    """Hostnames of ``n`` hosts (in rack order) and the launcher's order of them (arrival, or completion index)."""
    arrival = list(range(n))
    rng.shuffle(arrival)
    if form == "numbered":
        return [f"node{h + 1}" for h in range(n)], arrival
    if form == "cloud":
        addresses = rng.sample(range(16 * 254), n)  # the cloud hands out addresses without regard to racks
        return [f"ip-10-1-{a // 254}-{a % 254 + 1}" for a in addresses], arrival
    if form == "pods":
        index = list(range(n))
        rng.shuffle(index)  # the scheduler puts pod i on any node
        alphabet = "bcdfghjklmnpqrstvwxz2456789"
        names = [f"train-workers-0-{index[h]}-{''.join(rng.choices(alphabet, k=5))}" for h in range(n)]
        by_index = sorted(range(n), key=lambda h: index[h])
        return names, by_index
    raise ValueError(form)


def ifrt_topology(names: list[str], paths: list[tuple[str, ...]], launcher: list[int]) -> Topology:
    """The fabric's topology; its process ids are the launcher's (explicit ids, in no network order)."""
    pid = {h: i for i, h in enumerate(launcher)}
    processes = tuple(sorted((Process(pid[h], names[h], "", paths[h]) for h in range(len(names))),
                             key=lambda p: p.process_id))
    devices = tuple(Device(p.process_id << LOCAL_ID_BITS | i, p.process_id, i, "gpu", "H100")
                    for p in processes for i in range(DEVICES))
    content = TopologyContent("fabric", 1, len(processes), processes, devices)
    topology = Topology(wire.encode(content), 0)
    assert topology.processes == processes  # positions travel in the canonical bytes
    return topology


def ifrt_order(topology: Topology, launcher: list[int], shape: tuple[int, ...], axis_names: Sequence[str]) -> list[int]:
    """Hosts in the order of ``Topology.mesh(shape, axis_names)``."""
    mesh = topology.mesh(shape, axis_names)
    flat = mesh.devices.reshape(-1)
    return [launcher[int(d) >> LOCAL_ID_BITS] for d in flat[::DEVICES]]


def coordinator_ids(names: list[str], paths: list[tuple[str, ...]], arrival: list[int]) -> list[int]:
    """Hosts in the order of the ids the coordinator assigns (its own ``assign_process_ids``) to processes that
    registered in ``arrival`` order with no id of their own."""
    registrations = [Registration(str(h), "fabric", len(names), None, names[h], f"10.200.{h // 256}.{h % 256}", 0, "",
                                  (), network=paths[h]) for h in arrival]
    ids = assign_process_ids(registrations)
    return sorted(range(len(names)), key=lambda h: ids[str(h)])


def torch_order(names: list[str], rng: random.Random) -> list[int]:
    """torch's dynamic rendezvous: node ranks in ``sorted`` order of its node descriptors (FQDN, pid, local id)."""
    descriptors = {_NodeDesc(name, rng.randrange(1, 1 << 22), 0): h for h, name in enumerate(names)}
    return [descriptors[d] for d in sorted(descriptors)]


def xla_order(paths: list[tuple[str, ...]], launcher: list[int]) -> list[int]:
    """XLA's: the launcher's process ids stably sorted on the network path, levels compared as text."""
    return sorted(launcher, key=lambda h: list(paths[h]))


def level_keys(paths: list[tuple[str, ...]]) -> dict[str, np.ndarray]:
    """Per host, the index of its host, rack and block domain."""
    racks = {p: i for i, p in enumerate(dict.fromkeys(paths))}
    blocks = {p[:2]: i for i, p in enumerate(dict.fromkeys(p[:2] for p in paths))}
    return {"host": np.arange(len(paths)), "rack": np.array([racks[p] for p in paths]),
            "block": np.array([blocks[p[:2]] for p in paths])}


def ring_time(n: int, level: str | None) -> float:
    """Seconds for a ring all-reduce of BUCKET bytes over n devices whose highest crossing is ``level``."""
    if n < 2:
        return 0.0
    return 2 * (n - 1) / n * BUCKET / (BANDWIDTH_GBPS[level or "inside host"] * 1e9)


def measure(order: list[int], keys: dict[str, np.ndarray], shape: tuple[int, ...], names: Sequence[str]) -> dict:
    """For each axis: ring links that cross each level, rings that do, and the all-reduce time."""
    device_host = np.repeat(np.asarray(order), DEVICES)  # a host's devices adjacent
    axes = {}
    for axis, name in enumerate(names):
        n = shape[axis]
        rings = np.moveaxis(np.arange(device_host.size).reshape(shape), axis, -1).reshape(-1, n)
        hosts = device_host[rings]
        links, crossing, highest = {}, {}, np.full(len(rings), -1)
        for li, level in enumerate(LEVELS):
            k = keys[level][hosts]
            cross = k[:, 1:] != k[:, :-1]
            if n > 2:
                cross = np.concatenate([cross, k[:, :1] != k[:, -1:]], axis=1)
            per_ring = cross.sum(axis=1)
            links[level] = int(per_ring.sum())
            crossing[level] = int((per_ring > 0).sum())
            highest[per_ring > 0] = li
        worst = int(highest.max())
        axes[name] = {"size": n, "links_crossing": links, "rings_crossing": crossing,
                      "allreduce_ms": round(1e3 * ring_time(n, LEVELS[worst] if worst >= 0 else None), 3)}
    return {"axes": axes, "allreduce_ms": round(sum(a["allreduce_ms"] for a in axes.values()), 3)}


def optimum(keys: dict[str, np.ndarray], shape: tuple[int, ...], names: Sequence[str]) -> dict:
    """The lower bound of the module docstring, per axis and level."""
    axes = {}
    for axis, name in enumerate(names):
        n = shape[axis]
        span = int(np.prod(shape[axis:]))
        rings_total = int(np.prod(shape)) // n
        crossing, worst = {}, None
        for level in LEVELS:
            sizes = np.bincount(keys[level]) * DEVICES
            held = int(sum(s // span for s in sizes[sizes > 0])) * (span // n)
            crossing[level] = max(0, rings_total - held) if n > 1 else 0
            if crossing[level]:
                worst = level
        axes[name] = {"size": n, "rings_crossing": crossing, "allreduce_ms": round(1e3 * ring_time(n, worst), 3)}
    return {"axes": axes, "allreduce_ms": round(sum(a["allreduce_ms"] for a in axes.values()), 3)}


def run_case(fabric_name: str, racks: list[int], form: str) -> dict:
    rng = random.Random(f"{SEED}-{fabric_name}-{form}")
    paths = fabric(racks)
    names, launcher = hostnames(form, len(paths), rng)
    keys = level_keys(paths)
    topology = ifrt_topology(names, paths, launcher)
    ids = coordinator_ids(names, paths, launcher)
    peers = {
        "hostname_text": torch_order(names, rng),
        "launcher": launcher,
        "xla": xla_order(paths, launcher),
    }
    result: dict = {"fabric": fabric_name, "hostnames": form, "example_hostnames": names[:2] + names[-1:],
                    "meshes": {}}
    for mesh_name, (shape, axis_names) in MESHES.items():
        orders = {"ifrt": ifrt_order(topology, launcher, shape, axis_names), "ifrt_ids": ids, **peers}
        columns = {order: measure(hosts, keys, shape, axis_names) for order, hosts in orders.items()}
        columns["optimum"] = optimum(keys, shape, axis_names)
        best = columns["optimum"]["allreduce_ms"]
        ratios = {order: round(c["allreduce_ms"] / best, 3) for order, c in columns.items()}
        rings = {order: sum(a["rings_crossing"][level] for a in c["axes"].values() for level in ("rack", "block"))
                 for order, c in columns.items()}
        spine = {order: {a: x["links_crossing"]["block"] for a, x in c["axes"].items()}
                 for order, c in columns.items() if order != "optimum"}
        result["meshes"][mesh_name] = {
            "shape": dict(zip(axis_names, shape, strict=True)), "columns": columns,
            "allreduce_ratio_to_optimum": ratios,
            "rings_crossing_racks_and_blocks": rings,
            "rings_ratio_to_optimum": {order: round(r / max(rings["optimum"], 1), 3) for order, r in rings.items()},
            "spine_links_by_axis": spine}
    return result


JAX_PROBE = """
import json, os, sys
import jax
jax.config.update("jax_platforms", "cpu")
pid, n, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
devices = jax.devices()
print(json.dumps({"process_index": jax.process_index(), "local_device_ids": [d.id for d in jax.local_devices()]}))
jax.distributed.shutdown()
"""


def jaxlib_check(port: int = 29531) -> dict:
    """jaxlib's own topology exchange on 4 CPU processes (launched as 0..3), each with
    XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES set: the process index each ends with, against ``xla_order``."""
    import jaxlib

    paths = [("s", "rack10"), ("s", "rack9"), ("s", "rack2"), ("s", "rack1")]
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.py"
        probe.write_text(JAX_PROBE)
        procs = [subprocess.Popen([sys.executable, str(probe), str(i), "4", str(port)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True,
                                  env={**os.environ, "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES": ",".join(paths[i])})
                 for i in range(4)]
        answers = [json.loads(p.communicate(timeout=180)[0]) for p in procs]
    ours = xla_order(paths, list(range(4)))
    return {"jaxlib": jaxlib.__version__, "network_nodes": [",".join(p) for p in paths],
            "process_index_by_launch_id": [a["process_index"] for a in answers],
            "local_device_ids_by_launch_id": [a["local_device_ids"] for a in answers],
            "xla_order_here": {h: rank for rank, h in enumerate(ours)},
            "agrees": [a["process_index"] for a in answers] == [ours.index(h) for h in range(4)]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jaxlib-check", action="store_true", help="run jaxlib's topology exchange on 4 processes")
    args = parser.parse_args(argv)
    cases = [run_case(name, racks, form) for name, racks in (("uniform", uniform_racks()),
                                                              ("unequal", unequal_racks()))
             for form in ("numbered", "cloud", "pods")]
    out = {"hosts": HOSTS, "devices_per_host": DEVICES, "bandwidth_gbps": BANDWIDTH_GBPS, "bucket_bytes": BUCKET,
           "unequal_racks": unequal_racks(),
           "ifrt_order": "Topology.mesh over canonical topology bytes carrying each process's network path, "
                         "process ids the launcher's; ifrt_ids: coordinator.assignment.assign_process_ids on "
                         "registrations in arrival order (the coordinator's own decision, without its gRPC front)",
           "cases": cases}
    if args.jaxlib_check:
        out["jaxlib_check"] = jaxlib_check()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
