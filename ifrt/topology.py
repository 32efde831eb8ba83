"""``Topology``: one generation of the cluster's devices and processes, as one process sees it."""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from functools import cached_property
from operator import attrgetter
from typing import Any

import numpy as np

from ifrt import wire
from ifrt.errors import TopologyError
from ifrt.ids import LOCAL_ID_BITS, MAX_LOCAL_DEVICES
from ifrt.mesh import Mesh, packed, topology_order
from ifrt.records import Device, Process, TopologyContent

_ID = attrgetter("id")


def _packed(ordered: Sequence[Device], networks: Mapping[int, Sequence[str]], shape: Sequence[int]) -> list[Device]:
    """Devices in network order, their processes packed (``ifrt.mesh.packed``) for the innermost axes that span
    processes, where every process has as many devices: the rings of that axis stay inside racks (then blocks) as
    far as unequal racks allow."""
    by_process: dict[int, list[Device]] = {}
    for d in ordered:
        by_process.setdefault(d.process_id, []).append(d)
    counts = {len(v) for v in by_process.values()}
    if not networks or len(counts) != 1:
        return list(ordered)
    per_process = counts.pop()
    span = 1
    for size in reversed(tuple(shape)):
        span *= int(size)
        if span > per_process:
            break
    if span % per_process:
        return list(ordered)
    order = packed(list(by_process), networks, span // per_process)
    return [d for pid in order for d in by_process[pid]]


class Topology:
    """The published topology plus which process is "this" one.

    Every process of one generation holds the same canonical bytes (``canonical_bytes``) and so the
    same ``fingerprint``; only ``process_id`` differs between them.
    """

    def __init__(self, canonical: bytes, process_id: int, *, expected_fingerprint: str | None = None) -> None:
        self._canonical = bytes(canonical)
        self._content = wire.decode(self._canonical)
        self._fingerprint = wire.fingerprint(self._canonical)
        if expected_fingerprint is not None and expected_fingerprint != self._fingerprint:
            raise TopologyError(f"topology fingerprint mismatch: expected {expected_fingerprint}, "
                                f"the bytes hash to {self._fingerprint}")
        if process_id not in self._process_by_id:
            raise TopologyError(f"process id {process_id} is not in the topology "
                                f"(process ids {sorted(self._process_by_id)})")
        self._process_id = process_id

    # What every process shares.
    @property
    def canonical_bytes(self) -> bytes:
        """The canonical serialization; identical in every process of this generation."""
        return self._canonical

    @property
    def fingerprint(self) -> str:
        """Hex sha256 of ``canonical_bytes``."""
        return self._fingerprint

    @property
    def generation(self) -> int:
        return self._content.generation

    @property
    def cluster_id(self) -> str:
        return self._content.cluster_id

    @property
    def num_processes(self) -> int:
        return self._content.num_processes

    @property
    def devices(self) -> tuple[Device, ...]:
        """All devices, sorted by global id."""
        return self._content.devices

    @property
    def processes(self) -> tuple[Process, ...]:
        """All processes, sorted by process id."""
        return self._content.processes

    @cached_property
    def global_ids(self) -> np.ndarray:
        """Global ids of all devices, sorted, as int64."""
        return np.fromiter((d.id for d in self.devices), dtype=np.int64, count=len(self.devices))

    def device(self, global_id: int) -> Device:
        """The device with this global id; KeyError naming the id if there is none."""
        try:
            return self._device_by_id[global_id]
        except KeyError:
            raise KeyError(f"no device with global id {global_id} in topology generation {self.generation}") from None

    def process(self, process_id: int) -> Process:
        """The process with this id; KeyError naming the id if there is none."""
        try:
            return self._process_by_id[process_id]
        except KeyError:
            raise KeyError(f"no process {process_id} in topology generation {self.generation}") from None

    def mesh(self, shape: Sequence[int], axis_names: Sequence[str],
             devices: Sequence[Device | int] | None = None) -> Mesh:
        """A device mesh; by default over all devices in network order (one process's devices, then one host's, one
        slice's, one rack's, one block's adjacent along the innermost axes; ring order where devices have coordinates),
        whatever the process ids. ``Mesh.describe()`` says which level of the network each axis crosses."""
        if devices is None:
            hostnames = {p.process_id: p.hostname for p in self.processes}
            networks = {p.process_id: p.network for p in self.processes if p.network}
            ordered = topology_order(self.devices, hostnames, networks)
            ids = [d.id for d in _packed(ordered, networks, shape)]
        else:
            ids = [d.id if isinstance(d, Device) else int(d) for d in devices]
        if int(np.prod(shape)) != len(ids):
            raise ValueError(f"mesh shape {list(shape)} holds {int(np.prod(shape))} devices; {len(ids)} were given")
        return Mesh(np.array(ids, dtype=np.int64).reshape(tuple(shape)), axis_names, self)

    # This process's view.
    @property
    def process_id(self) -> int:
        """This process's id."""
        return self._process_id

    @cached_property
    def local_devices(self) -> tuple[Device, ...]:
        """This process's devices, sorted by local id: what every process knows of them (their host-only attributes,
        such as GPU UUIDs, are in ``Client.local_devices``)."""
        first = self._process_id << LOCAL_ID_BITS  # devices are sorted by global id: one process's are adjacent
        start = bisect_left(self.devices, first, key=_ID)
        return self.devices[start:bisect_left(self.devices, first + MAX_LOCAL_DEVICES, lo=start, key=_ID)]

    @cached_property
    def _device_by_id(self) -> dict[int, Device]:
        return {d.id: d for d in self.devices}

    @cached_property
    def _process_by_id(self) -> dict[int, Process]:
        return {p.process_id: p for p in self.processes}

    # Conversions.
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``Topology.from_dict`` turns it back into an equal topology."""
        return {
            "process_id": self.process_id,
            "num_processes": self.num_processes,
            "generation": self.generation,
            "cluster_id": self.cluster_id,
            "fingerprint": self.fingerprint,
            "processes": [p.to_dict() for p in self.processes],
            "devices": [d.to_dict() for d in self.devices],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Topology:
        """The topology ``to_dict`` described; TopologyError if it is inconsistent or its fingerprint differs."""
        try:
            content = TopologyContent(
                cluster_id=str(d.get("cluster_id", "")),
                generation=int(d["generation"]),
                num_processes=int(d["num_processes"]),
                processes=tuple(Process(int(p["process_id"]), str(p["hostname"]), str(p.get("address", "")),
                                        tuple(str(level) for level in p.get("network", ())))
                                for p in d["processes"]),
                devices=tuple(Device(int(x["id"]), int(x["process_id"]), int(x["local_id"]), str(x["platform"]),
                                     str(x["kind"]), int(x.get("slice_index", 0)), dict(x.get("attributes", {})),
                                     str(x.get("plugin", "")), tuple(int(c) for c in x.get("coordinates", ())))
                              for x in d["devices"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TopologyError(f"topology dict is malformed: {e!r}") from e
        return cls(wire.encode(content), int(d["process_id"]), expected_fingerprint=d.get("fingerprint"))

    @classmethod
    def from_json(cls, text: str) -> Topology:
        return cls.from_dict(json.loads(text))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._canonical == other._canonical and self._process_id == other._process_id

    def __hash__(self) -> int:
        return hash((self._fingerprint, self._process_id))

    def __repr__(self) -> str:
        return (f"Topology(generation={self.generation}, process_id={self.process_id}, "
                f"processes={len(self.processes)}, devices={len(self.devices)}, fingerprint={self.fingerprint[:12]})")
