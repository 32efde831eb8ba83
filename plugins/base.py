"""The device plugin interface. The defaults describe one host with one process, so a plugin overrides
``local_devices`` and whatever else differs for its hardware."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import ClassVar

from ifrt.errors import InvalidArgument
from ifrt.records import LocalDevice

DEFAULT_PROPERTIES: Mapping[str, object] = MappingProxyType({
    "memory_bytes": None,  # device memory, when the plugin knows it
    "cores_per_chip": 1,  # compute cores behind one device id (a megacore chip shows 2 as 1)
    "interconnect": "none",  # fastest device-to-device link: none, pcie, nvlink, ici
    "direct_transfer": False,  # devices exchange buffers without staging through host memory
})
"""Named per-device-type properties a runtime may ask for, with the value that holds for plain host devices."""


class DevicePlugin:
    """Lists this process's devices and prepares the process for its runtime."""

    name: str = ""
    properties: ClassVar[Mapping[str, Mapping[str, object]]] = {}
    """Overrides of DEFAULT_PROPERTIES per device kind (``"*"`` for every kind of this plugin)."""

    def check(self) -> str | None:
        """None if this plugin can list devices here, else why not (for ``ifrt plugins``)."""
        return None

    def is_available(self) -> bool:
        return self.check() is None

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        """This process's devices; ``local_device_ids`` keeps only those ids (one process per device)."""
        raise NotImplementedError

    def library_path(self) -> str | None:
        """Where the PJRT plugin binary for this hardware is, when there is one."""
        return None

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """Called before any runtime client exists (e.g. to set visible devices for one process per device)."""

    def device_properties(self, kind: str) -> Mapping[str, object]:
        """Every named property for devices of ``kind``: defaults, then this plugin's, then the kind's."""
        return {**DEFAULT_PROPERTIES, **self.properties.get("*", {}), **self.properties.get(kind, {})}


def select(devices: list[LocalDevice], local_device_ids: Sequence[int] | None) -> list[LocalDevice]:
    """The devices whose local ids are in ``local_device_ids`` (all when None); InvalidArgument names unknown ids."""
    if local_device_ids is None:
        return devices
    wanted = set(local_device_ids)
    unknown = wanted - {d.local_id for d in devices}
    if unknown:
        raise InvalidArgument(f"local device ids {sorted(unknown)} do not exist here: this process has local ids "
                              f"{[d.local_id for d in devices]}")
    return [d for d in devices if d.local_id in wanted]
