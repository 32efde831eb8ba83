"""The ``jax`` plugin: the local devices of a real PJRT client, through ``jax.local_devices()``.

Optional extra ``ifrt-topology[jax]``. Local ids are positions in ``jax.local_devices()``; JAX's own id and
hardware id are kept as attributes, with coordinates and slice index where the platform has them (TPU).
"""

from __future__ import annotations

from collections.abc import Sequence

from ifrt.records import LocalDevice
from plugins.base import DevicePlugin, select


class JaxPlugin(DevicePlugin):
    """Whatever devices JAX's default backend has in this process."""

    name = "jax"

    def check(self) -> str | None:
        try:
            import jax  # noqa: F401
        except ImportError:
            return "jax is not installed (pip install 'ifrt-topology[jax]')"
        return None

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        reason = self.check()
        if reason is not None:
            raise ValueError(f"the jax plugin cannot list devices here: {reason}")
        import jax

        devices = []
        for local_id, d in enumerate(jax.local_devices()):
            attributes = {"jax_id": str(d.id)}
            if getattr(d, "local_hardware_id", None) is not None:
                attributes["local_hardware_id"] = str(d.local_hardware_id)
            slice_index = getattr(d, "slice_index", None)
            devices.append(LocalDevice(local_id, d.platform, d.device_kind,
                                       slice_key="" if slice_index is None else str(slice_index),
                                       coordinates=tuple(getattr(d, "coords", ()) or ()), attributes=attributes))
        return select(devices, local_device_ids)
