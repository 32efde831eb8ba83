"""The device plugin interface: what a process needs to know about its own devices."""

from __future__ import annotations

from collections.abc import Sequence

from ifrt.records import LocalDevice


class DevicePlugin:
    """Lists the devices this process owns. Subclasses override ``local_devices`` (and ``name``)."""

    name: str = ""

    def is_available(self) -> bool:
        """Whether this plugin can list devices on this machine."""
        return True

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        """This process's devices; ``local_device_ids`` keeps only those ids (for one process per device)."""
        raise NotImplementedError


def select(devices: list[LocalDevice], local_device_ids: Sequence[int] | None) -> list[LocalDevice]:
    """The devices whose local ids are in ``local_device_ids`` (all when None); ValueError names unknown ids."""
    if local_device_ids is None:
        return devices
    wanted = set(local_device_ids)
    unknown = wanted - {d.local_id for d in devices}
    if unknown:
        raise ValueError(f"local device ids {sorted(unknown)} do not exist here: this process has local ids "
                         f"{[d.local_id for d in devices]}")
    return [d for d in devices if d.local_id in wanted]
