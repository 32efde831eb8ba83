"""The device plugin interface. The defaults describe one host with one process, so a plugin overrides
``local_devices`` and whatever else differs for its hardware."""

from __future__ import annotations

from collections.abc import Sequence

from ifrt.errors import InvalidArgument
from ifrt.records import LocalDevice


class DevicePlugin:
    """Lists this process's devices and prepares the process for its runtime."""

    name: str = ""

    def check(self) -> str | None:
        """None if this plugin can list devices here, else why not (for ``ifrt plugins``)."""
        return None

    def is_available(self) -> bool:
        return self.check() is None

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        """This process's devices; ``local_device_ids`` keeps only those ids (one process per device)."""
        raise NotImplementedError

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """Called before any runtime client exists (e.g. to set visible devices for one process per device)."""


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
