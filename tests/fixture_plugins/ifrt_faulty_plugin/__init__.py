"""Third-party device plugins with bugs: one whose check() raises, one whose local_devices() raises."""

from ifrt.records import LocalDevice
from plugins import DevicePlugin


class CheckRaises(DevicePlugin):
    name = "faulty-check"

    def check(self):
        raise RuntimeError("the accelerator driver crashed")

    def local_devices(self, local_device_ids=None):
        return [LocalDevice(0, "faulty", "fc-1")]


class DevicesRaise(DevicePlugin):
    name = "faulty-devices"

    def local_devices(self, local_device_ids=None):
        table = {}
        return table["fabric_id"]  # a bug: KeyError, neither ValueError nor ImportError
