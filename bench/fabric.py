"""Meshes over a model fabric: which mesh axes cross racks, blocks and the spine under each peer's process order.

    .venv/bin/python bench/fabric.py                # every fabric and hostname form, a 2-D and a 3-D mesh (~3 s)
    .venv/bin/python bench/fabric.py --jaxlib-check # also runs jaxlib's own topology exchange on 4 processes

A fabric of 1,024 hosts of 8 devices under one spine, 8 racks a block: ``uniform`` (racks of 16 hosts), ``unequal``
(racks of 10 to 22 hosts drawn with a fixed seed, so blocks of unequal size), ``unequal_full_blocks`` (racks of 10
to 22 hosts, every block 128 hosts). Each process is told its place as a path (spine, block, rack), or, in the
``positions: rack`` case, by its rack's name alone (``rack1``..``rack64``, the block implied by the numbering, as in a
data hall). Hostnames take the forms real clusters use: ``node1``..``node1024`` numbered in rack order (``node7``
next to ``node66``), cloud names made of a host address that says nothing about the rack (``ip-10-1-7-66``), and
Kubernetes pod names (``train-workers-0-17-x2k9q``) whose position comes from the node's labels. Every order lays
the mesh out the same way: hosts in the order given, a host's 8 devices adjacent, reshaped to the mesh shape (what
``jax.make_mesh`` over ``jax.devices()`` and torch's ``init_device_mesh`` do with ranks).

Columns (process orders):

- ``ifrt``: ``Topology.mesh`` (network path level by level, then hostname, both in natural order), over a topology
  whose process ids are the launcher's (explicit ids, in no network order).
- ``ifrt_ids``: the hosts in the order of the ids the coordinator assigns (its own ``assign_process_ids`` on
  registrations in arrival order: network path, then hostname, naturally), laid out as they come.
- ``hostname_text``: torch's dynamic rendezvous (``sorted`` over its ``_NodeDesc`` of the agents' FQDNs: its own
  code), which is also ifrt's id order before network order (hostname as text).
- ``launcher``: the arrival order of the processes (random), or the Kubernetes completion index for pods.
- ``xla``: XLA's ``network_nodes`` order (``topology_util.cc``), given the same positions as ifrt: a stable sort of
  the launcher's process ids on the path, levels compared as text; re-implemented here (one jaxlib process per host
  cannot run here for 1,024 hosts). ``--jaxlib-check`` runs jaxlib's own exchange on 4 processes and checks that the
  process indices it gives agree (jaxlib 0.10.2 renumbers ``process_index``, not the device ids).
- ``bound_order``: a host order that attains the bound below, built by the packing of its proof.

The all-reduce time of an axis is its slowest ring's: 2 (n - 1) / n * BUCKET bytes at the bandwidth of the highest
level the ring crosses (BANDWIDTH_GBPS, one direction per device); rings of an axis run at once, contention is not
modelled, so how many rings cross a level does not change the time (the counts are reported beside it). The cost
of an order is the sum over the axes.

The bound (``bound``), the least cost of any host order, and its proof. A ring's host positions (its places in the
order) are fixed by the shape; an axis whose rings lie in one position stays inside a host in every order; any
other ring spans distinct hosts, so it crosses hosts at least. Write l_a (host, rack or block) for the highest
level some ring of axis a crosses in an order; its cost is sum_a t_a(l_a), t_a increasing in the level. In that
order every ring of an axis with l_a = host lies in one rack, and every ring of an axis with l_a <= rack in one
block; so each connected component of the positions joined by the first axes' rings (c positions each) lies in one
rack, and each component joined by the second axes' rings (q of the first each) in one block. Block j then holds at
most floor(sum_{racks r of j} floor(s_r / c) / q) second components (s_r the hosts of rack r), and all must be held:
a vector l that fails this count has no order. ``bound`` tries the vectors from the cheapest up and stops at the
first that passes; any order's own vector passes, so its cost is at least the bound. The count also suffices
(``place`` fills each block's racks first-fit and returns the order), so the bound is attained: the bench measures
that order like the others and asserts that it costs the bound and that no column costs less (equal component
sizes are checked, not assumed). Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import itertools
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

from coordinator.core.assignment import assign_process_ids
from coordinator.core.registration import Registration
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


def unequal_racks_full_blocks(seed: int = SEED) -> list[int]:
    """Racks of 10 to 22 hosts, 8 to a block of 128 hosts (a fixed draw): racks unequal, blocks equal."""
    rng = random.Random(seed)
    racks: list[int] = []
    for _ in range(HOSTS // (RACK_HOSTS * RACKS_PER_BLOCK)):
        block = [RACK_HOSTS] * RACKS_PER_BLOCK
        for _ in range(100):
            i, j = rng.sample(range(RACKS_PER_BLOCK), 2)
            d = rng.randint(1, 6)
            if block[i] - d >= 10 and block[j] + d <= 22:
                block[i], block[j] = block[i] - d, block[j] + d
        racks += block
    return racks


def fabric(racks: Sequence[int]) -> list[tuple[str, str, str]]:
    """(spine, block, rack) of each host, hosts in rack order; names numbered from 1 (``rack9`` next to ``rack10``)."""
    paths = []
    for r, size in enumerate(racks):
        paths += [("spine", f"block{r // RACKS_PER_BLOCK + 1}", f"rack{r + 1}")] * size
    return paths


FABRICS = (("uniform", uniform_racks(), "path"), ("unequal", unequal_racks(), "path"),
           ("unequal_full_blocks", unequal_racks_full_blocks(), "path"), ("uniform", uniform_racks(), "rack"))
"""(name, rack sizes, what each process is told of its place): see ``run_case``."""


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
    """For each axis: ring links that cross each level, rings that do, the highest level a ring crosses, and the
    all-reduce time."""
    device_host = np.repeat(np.asarray(order), DEVICES)  # a host's devices adjacent
    axes, total = {}, 0.0
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
        worst = LEVELS[int(highest.max())] if highest.max() >= 0 else None
        total += ring_time(n, worst)
        axes[name] = {"size": n, "highest_level": worst, "links_crossing": links, "rings_crossing": crossing,
                      "allreduce_ms": round(1e3 * ring_time(n, worst), 3)}
    return {"axes": axes, "allreduce_ms": round(1e3 * total, 3), "allreduce_s": total}


def ring_positions(shape: tuple[int, ...], axis: int) -> np.ndarray:
    """The host positions (places in a host order) of each ring of ``axis``: one row a ring."""
    n = shape[axis]
    rings = np.moveaxis(np.arange(int(np.prod(shape))).reshape(shape), axis, -1).reshape(-1, n)
    return rings // DEVICES


def components(shape: tuple[int, ...], axes: Sequence[int]) -> np.ndarray:
    """Per host position, the least position joined to it by rings of ``axes`` (a connected-component label)."""
    labels = np.arange(int(np.prod(shape)) // DEVICES)
    rings = [ring_positions(shape, a) for a in axes]
    while True:
        before = labels.copy()
        for r in rings:
            np.minimum.at(labels, r, np.broadcast_to(labels[r].min(axis=1)[:, None], r.shape))
        labels = labels[labels]
        if (labels == before).all():
            return labels


def place(keys: dict[str, np.ndarray], shape: tuple[int, ...], allowed: dict[int, str]) -> list[int] | None:
    """A host order in which no ring of axis a crosses a level above ``allowed[a]`` ("host": its rings stay in a
    rack; "rack": in a block; "block": anywhere), or None where none exists (the packing of the docstring)."""
    rack_comp = components(shape, [a for a, level in allowed.items() if level == "host"])
    block_comp = components(shape, [a for a, level in allowed.items() if level in ("host", "rack")])
    rack_members = {c: np.flatnonzero(rack_comp == c) for c in np.unique(rack_comp)}
    block_racks = {c: np.unique(rack_comp[block_comp == c]) for c in np.unique(block_comp)}
    sizes = {len(m) for m in rack_members.values()}
    per_block = {len(r) for r in block_racks.values()}
    if len(sizes) != 1 or len(per_block) != 1:
        raise ValueError(f"components of unequal sizes ({sizes}, {per_block}): the packing argument needs equal ones")
    c_r, q = sizes.pop(), per_block.pop()
    rack_hosts: dict[int, list[int]] = {}
    for h, r in enumerate(keys["rack"]):
        rack_hosts.setdefault(int(r), []).append(h)
    racks_of_block: dict[int, list[int]] = {}
    for r, hs in rack_hosts.items():
        racks_of_block.setdefault(int(keys["block"][hs[0]]), []).append(r)
    pending = list(block_racks.values())
    order = np.full(len(rack_comp), -1)
    for racks in racks_of_block.values():
        free = {r: len(rack_hosts[r]) // c_r for r in racks}
        for _ in range(sum(free.values()) // q):
            if not pending:
                break
            for comp in pending.pop():
                r = next(r for r in racks if free[r])
                free[r] -= 1
                taken = (len(rack_hosts[r]) // c_r - free[r] - 1) * c_r  # hosts of r given before this one
                order[rack_members[comp]] = rack_hosts[r][taken:taken + c_r]
    if pending:
        return None
    assert sorted(order.tolist()) == list(range(len(order)))
    return order.tolist()


def bound(keys: dict[str, np.ndarray], shape: tuple[int, ...], names: Sequence[str]) -> dict:
    """The least all-reduce time of any host order (the module docstring's bound), the highest level each axis
    crosses there, and one host order that attains it."""
    free = [a for a in range(len(shape))  # an axis whose rings lie in one host stays there in every order
            if not (ring_positions(shape, a) == ring_positions(shape, a)[:, :1]).all()]
    choices = []
    for levels in itertools.product(LEVELS, repeat=len(free)):
        allowed = dict(zip(free, levels, strict=True))
        cost = sum(ring_time(shape[a], allowed.get(a)) for a in range(len(shape)))
        choices.append((cost, allowed))
    for cost, allowed in sorted(choices, key=lambda c: c[0]):
        order = place(keys, shape, allowed)
        if order is not None:
            levels = {name: allowed.get(a) for a, name in enumerate(names)}
            return {"allreduce_ms": round(1e3 * cost, 3), "allreduce_s": cost, "highest_level": levels,
                    "order": order}
    raise AssertionError("the order that lets every ring cross the spine always exists")


def run_case(fabric_name: str, racks: list[int], form: str, positions: str = "path") -> dict:
    """One fabric and hostname form. ``positions``: what each process is told of its place ("path": spine, block
    and rack; "rack": the rack's name alone, the block implied by rack numbering as in a data hall)."""
    rng = random.Random(f"{SEED}-{fabric_name}-{form}")
    paths = fabric(racks)
    told = paths if positions == "path" else [p[-1:] for p in paths]
    names, launcher = hostnames(form, len(paths), rng)
    keys = level_keys(paths)  # the fabric as it is, whatever the processes are told
    topology = ifrt_topology(names, told, launcher)
    ids = coordinator_ids(names, told, launcher)
    peers = {
        "hostname_text": torch_order(names, rng),
        "launcher": launcher,
        "xla": xla_order(told, launcher),
    }
    result: dict = {"fabric": fabric_name, "positions": positions, "hostnames": form,
                    "example_hostnames": names[:2] + names[-1:], "example_position": list(told[0]), "meshes": {}}
    for mesh_name, (shape, axis_names) in MESHES.items():
        least = bound(keys, shape, axis_names)
        orders = {"ifrt": ifrt_order(topology, launcher, shape, axis_names), "ifrt_ids": ids, **peers,
                  "bound_order": least.pop("order")}
        columns = {order: measure(hosts, keys, shape, axis_names) for order, hosts in orders.items()}
        for order, c in columns.items():  # a bound that some order beats is no bound: fail the run
            assert c["allreduce_s"] >= least["allreduce_s"] * (1 - 1e-12), (fabric_name, form, mesh_name, order)
        assert abs(columns["bound_order"]["allreduce_s"] - least["allreduce_s"]) < 1e-12, "the bound is attained"
        ratios = {order: round(c.pop("allreduce_s") / least["allreduce_s"], 3) for order, c in columns.items()}
        rings = {order: sum(a["rings_crossing"][level] for a in c["axes"].values() for level in ("rack", "block"))
                 for order, c in columns.items()}
        spine = {order: {a: x["links_crossing"]["block"] for a, x in c["axes"].items()}
                 for order, c in columns.items()}
        result["meshes"][mesh_name] = {
            "shape": dict(zip(axis_names, shape, strict=True)), "columns": columns,
            "bound_ms": least["allreduce_ms"], "bound_highest_level": least["highest_level"],
            "allreduce_ratio_to_bound": ratios,
            "rings_crossing_racks_and_blocks": rings,
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
    cases = [run_case(name, racks, form, positions) for name, racks, positions in FABRICS
             for form in ("numbered", "cloud", "pods")]
    out = {"hosts": HOSTS, "devices_per_host": DEVICES, "bandwidth_gbps": BANDWIDTH_GBPS, "bucket_bytes": BUCKET,
           "unequal_racks": unequal_racks(), "unequal_racks_full_blocks": unequal_racks_full_blocks(),
           "ifrt_order": "Topology.mesh over canonical topology bytes carrying each process's network path, "
                         "process ids the launcher's; ifrt_ids: coordinator.core.assignment.assign_process_ids on "
                         "registrations in arrival order (the coordinator's own decision, without its gRPC front)",
           "cases": cases}
    if args.jaxlib_check:
        out["jaxlib_check"] = jaxlib_check()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
