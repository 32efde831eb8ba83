"""JAX's own topology exchange, checked against ifrt's topology as it passes through the stand-in.

Each process's JAX inserts its local topology (its devices) and process 0's JAX writes the global one (every
process's devices, with XLA's slice numbers). A record that differs from what ifrt published (another process id, a
device count of its own, slices grouped otherwise) would make JAX number or group devices unlike ifrt's meshes: it is
refused at once, with both views named.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from ifrt._generated import xla_topology_pb2 as xla_pb
from ifrt.topology import Topology

LOCAL_KEY = re.compile(r"^(?:[^:/]+:)?local_topology/[^/]+/(\d+)$")
GLOBAL_KEY = re.compile(r"^(?:[^:/]+:)?global_topology/[^/]+$")


def is_record(key: str) -> bool:
    """Whether JAX keeps a topology record under ``key``."""
    return bool(LOCAL_KEY.match(key) or GLOBAL_KEY.match(key))


def problem(key: str, value: bytes, topology: Topology) -> str | None:
    """What is wrong with JAX's topology record ``value`` under ``key`` (None: right, or not a topology record)."""
    if (local := LOCAL_KEY.match(key)) is not None:
        record = _parse(xla_pb.LocalTopology, value)
        if record is None:
            return f"JAX's local topology under {key!r} is not a LocalTopologyProto ({len(value)} bytes)"
        if record.process_id != int(local.group(1)):
            return (f"JAX's local topology under {key!r} is process {record.process_id}'s, not process "
                    f"{local.group(1)}'s")
        return _process_problem(record, topology, "local topology")
    if GLOBAL_KEY.match(key):
        record = _parse(xla_pb.GlobalTopology, value)
        if record is None:
            return f"JAX's global topology under {key!r} is not a GlobalTopologyProto ({len(value)} bytes)"
        problems = [p for local in record.processes if (p := _process_problem(local, topology, "global topology"))]
        ours = {p.process_id for p in topology.processes}
        theirs = {local.process_id for local in record.processes}
        if ours != theirs:
            problems.append(f"JAX's global topology has processes {sorted(theirs)}, ifrt's topology (generation "
                            f"{topology.generation}) {sorted(ours)}")
        return "; ".join(problems) or _slice_problem(record, topology)
    return None


def _parse(kind: type, value: bytes) -> object | None:
    try:
        return kind.FromString(value)
    except DecodeError:
        return None


def _process_problem(record: xla_pb.LocalTopology, topology: Topology, what: str) -> str | None:
    pid = record.process_id
    try:
        process = topology.process(pid)
    except (KeyError, IndexError, ValueError):
        return (f"JAX's {what} names process {pid}, which ifrt's topology (generation {topology.generation}, "
                f"{topology.num_processes} processes) does not have")
    ours = sorted((d for d in topology.devices if d.process_id == pid), key=lambda d: d.local_id)
    if len(ours) == len(record.devices):
        return None
    return (f"JAX's {what} gives process {pid} ({process.hostname}) {_count(len(record.devices))} "
            f"[{', '.join(_jax_names(record.devices))}], ifrt's topology (generation {topology.generation}) "
            f"{_count(len(ours))} [{', '.join(f'{d.platform}:{d.local_id}' for d in ours)}]: both must list the "
            "same devices (register the devices JAX uses: plugin 'jax')")


def _slice_problem(record: xla_pb.GlobalTopology, topology: Topology) -> str | None:
    """Where ifrt's topology has several slices: JAX's slices must group the devices as ifrt's do."""
    if len({d.slice_index for d in topology.devices}) < 2:
        return None  # one slice in ifrt's view: nothing to group
    ours: dict[int, list[tuple[int, int]]] = {}
    for d in topology.devices:
        ours.setdefault(d.process_id, []).append((d.local_id, d.slice_index))
    theirs = {local.process_id: sorted((dev.local_device_ordinal, dev.partition_index) for dev in local.devices)
              for local in record.processes}
    pairs = [(ifrt_slice, jax_slice) for p in sorted(ours)  # device k of process p in each view
             for (_, ifrt_slice), (_, jax_slice) in zip(sorted(ours[p]), theirs[p], strict=True)]
    forward, backward = {}, {}
    for ifrt_slice, jax_slice in pairs:
        if forward.setdefault(ifrt_slice, jax_slice) != jax_slice or backward.setdefault(jax_slice,
                                                                                          ifrt_slice) != ifrt_slice:
            return (f"JAX's global topology groups the devices into slices {sorted({j for _, j in pairs})} otherwise "
                    f"than ifrt's topology (generation {topology.generation}, slices "
                    f"{sorted({i for i, _ in pairs})}): ifrt slice {ifrt_slice} is JAX's {forward[ifrt_slice]} for one "
                    f"device and {jax_slice} for another")
    return None


def _jax_names(devices: Sequence[xla_pb.Device]) -> list[str]:
    return [d.name or f"{d.device_kind}:{d.local_device_ordinal}" for d in devices]


def _count(n: int) -> str:
    return f"{n} device" + ("" if n == 1 else "s")
