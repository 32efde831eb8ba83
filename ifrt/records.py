"""Plain value records shared by plugins, the client, the coordinator and the topology."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field

_EMPTY: Mapping[str, str] = types.MappingProxyType({})


def _frozen(attributes: Mapping[str, str]) -> Mapping[str, str]:
    if not attributes:
        return _EMPTY  # most devices have none; one shared mapping keeps thousands of records cheap
    return types.MappingProxyType(dict(sorted(attributes.items())))


@dataclass(frozen=True)
class LocalDevice:
    """One device as the process that owns it sees it (what a device plugin reports)."""

    local_id: int
    platform: str
    kind: str
    slice_key: str = ""
    """Devices with equal keys share a slice (e.g. one TPU slice, one NVLink domain)."""
    coordinates: tuple[int, ...] = ()
    attributes: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Published in the topology: facts other processes need (memory size, core on chip, ...)."""
    host_attributes: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Never sent: facts that only mean something on this host (GPU UUID, PCI bus id, NVML index). They would
    make the topology grow by their entropy (16 bytes a UUID, per device) for no other process's use."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "coordinates", tuple(self.coordinates))
        object.__setattr__(self, "attributes", _frozen(self.attributes))
        object.__setattr__(self, "host_attributes", _frozen(self.host_attributes))


@dataclass(frozen=True)
class Device:
    """One device of the published topology; ``id`` is its global id."""

    id: int
    process_id: int
    local_id: int
    platform: str
    kind: str
    slice_index: int = 0
    attributes: Mapping[str, str] = field(default_factory=dict, hash=False)
    plugin: str = ""
    """The device plugin that reported it."""
    coordinates: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "coordinates", tuple(self.coordinates))
        object.__setattr__(self, "attributes", _frozen(self.attributes))

    @classmethod
    def trusted(cls, id: int, process_id: int, local_id: int, platform: str, kind: str, slice_index: int,
                attributes: Mapping[str, str], plugin: str, coordinates: tuple[int, ...]) -> Device:
        """A device from fields already in final form (``coordinates`` a tuple, ``attributes`` read-only and sorted),
        without ``__init__``'s conversions: topologies build and decode 100,000s of devices at once."""
        device = object.__new__(cls)
        device.__dict__.update(id=id, process_id=process_id, local_id=local_id, platform=platform, kind=kind,
                               slice_index=slice_index, attributes=attributes, plugin=plugin, coordinates=coordinates)
        return device

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "process_id": self.process_id,
            "local_id": self.local_id,
            "platform": self.platform,
            "kind": self.kind,
            "slice_index": self.slice_index,
            "attributes": dict(self.attributes),
            "plugin": self.plugin,
            "coordinates": list(self.coordinates),
        }


@dataclass(frozen=True)
class Process:
    """One process of the published topology; ``address`` is its transfer endpoint (may be empty)."""

    process_id: int
    hostname: str
    address: str = ""
    network: tuple[str, ...] = ()
    """Where its host sits in the network, root (spine) to leaf (rack), the host not included (``ifrt.network``);
    empty where nothing said."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "network", tuple(self.network))

    def to_dict(self) -> dict:
        return {"process_id": self.process_id, "hostname": self.hostname, "address": self.address,
                "network": list(self.network)}


@dataclass(frozen=True)
class TopologyContent:
    """Everything a published topology holds (what every process of one generation shares; ``ifrt.wire`` gives
    its canonical bytes)."""

    cluster_id: str
    generation: int
    num_processes: int
    processes: tuple[Process, ...]
    devices: tuple[Device, ...]
