"""The ``cpu`` plugin: ``IFRT_CPU_DEVICE_COUNT`` host devices (default 1), platform ``cpu``."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_LOCAL_DEVICES
from ifrt.records import LocalDevice
from plugins.base import DevicePlugin, select

DEVICE_COUNT_ENV = "IFRT_CPU_DEVICE_COUNT"  # e.g. IFRT_CPU_DEVICE_COUNT=8


class CpuPlugin(DevicePlugin):
    """Host CPU devices, as many as ``IFRT_CPU_DEVICE_COUNT`` says (like XLA's host platform device count)."""

    name = "cpu"

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        raw = os.environ.get(DEVICE_COUNT_ENV, "1")
        try:
            count = int(raw)
        except ValueError:
            raise InvalidArgument(f"{DEVICE_COUNT_ENV}={raw!r} is not an integer: expected 0 <= count <= "
                                  f"{MAX_LOCAL_DEVICES}") from None
        if not 0 <= count <= MAX_LOCAL_DEVICES:
            raise InvalidArgument(f"{DEVICE_COUNT_ENV}={count} is out of range: expected 0 <= count <= "
                                  f"{MAX_LOCAL_DEVICES}")
        return select([LocalDevice(i, "cpu", "cpu") for i in range(count)], local_device_ids)
