"""A third-party device plugin, installed as its own distribution (see the .dist-info beside it)."""

from ifrt.records import LocalDevice
from plugins import DevicePlugin


class FakeAccelPlugin(DevicePlugin):
    name = "fake-accel"

    def local_devices(self, local_device_ids=None):
        devices = [LocalDevice(i, "fake", "fa-1", attributes={"serial": f"FA{i:04d}"},
                               host_attributes={"bus": f"0000:{0x41 + i:02x}:00.0"}) for i in range(3)]
        return [d for d in devices if local_device_ids is None or d.local_id in local_device_ids]
