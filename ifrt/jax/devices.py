"""JAX's devices checked against the topology and mapped to ifrt's global ids: pure functions over the topology and
JAX's device lists (no backend is started here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ifrt.errors import TopologyError
from ifrt.topology import Topology

PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}
"""ifrt's platform names that JAX calls otherwise: JAX's ``Device.platform`` is ``gpu`` for NVIDIA and AMD GPUs."""


def check_devices(topology: Topology, views: Mapping[int, Sequence[Mapping[str, str]]], what: str = "has") -> None:
    """TopologyError naming each process whose JAX devices (``views``: process id -> [{platform, kind}]) differ
    in count or platform from the topology's, with both device lists."""
    problems = []
    for process in topology.processes:
        ours = [d for d in topology.devices if d.process_id == process.process_id]
        theirs = list(views.get(process.process_id, ()))
        if len(ours) == len(theirs) and all(same_platform(o.platform, t["platform"])
                                            for o, t in zip(ours, theirs, strict=True)):
            continue
        problems.append(
            f"process {process.process_id} ({process.hostname}): ifrt's topology has {_count(ours)} "
            f"[{', '.join(_name(d.platform, d.local_id) for d in ours)}] but its JAX {what} {_count(theirs)} "
            f"[{', '.join(_name(t['platform'], i) for i, t in enumerate(theirs))}]")
    if problems:
        raise TopologyError(
            f"JAX's devices do not match the topology (generation {topology.generation}): {'; '.join(problems)}. "
            "Every process needs the same number of devices on the same platform in both: register the devices "
            "JAX uses (plugin 'jax'; on CPU, JAX ignores local_device_ids and creates jax_num_cpu_devices or "
            "--xla_force_host_platform_device_count devices)")


def same_platform(ifrt_platform: str, jax_platform: str) -> bool:
    """Whether a device ifrt lists as ``ifrt_platform`` is one JAX calls ``jax_platform`` (the ``cuda`` plugin's
    GPUs are JAX's ``gpu``)."""
    return PLATFORM_ALIASES.get(ifrt_platform, ifrt_platform) == PLATFORM_ALIASES.get(jax_platform, jax_platform)


def _count(items: Sequence[Any]) -> str:
    return f"{len(items)} device" + ("" if len(items) == 1 else "s")


def _name(platform: str, local_id: int) -> str:
    return f"{platform}:{local_id}"


def match_devices(topology: Topology, jax_devices: Sequence[Any]) -> dict[int, Any]:
    """Global id -> ``jax.Device``: the k-th device (by local id) of process p is JAX's k-th device (by id) of
    process p; never by JAX's own id numbering."""
    by_process: dict[int, list[Any]] = {}
    for d in jax_devices:
        by_process.setdefault(d.process_index, []).append(d)
    matched = {}
    for process in topology.processes:
        ours = sorted((d for d in topology.devices if d.process_id == process.process_id), key=lambda d: d.local_id)
        theirs = sorted(by_process.get(process.process_id, ()), key=lambda d: d.id)
        if len(ours) != len(theirs):
            raise TopologyError(f"process {process.process_id}: ifrt's topology has {len(ours)} devices, JAX has "
                                f"{len(theirs)}")
        matched.update((o.id, t) for o, t in zip(ours, theirs, strict=True))
    return matched
