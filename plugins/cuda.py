"""The ``cuda`` plugin: NVIDIA GPUs through NVML (package nvidia-ml-py, extra ``ifrt-topology[cuda]``).

Reports each visible GPU (``CUDA_VISIBLE_DEVICES`` by index or UUID, e.g. ``0,2`` or ``GPU-8a1c...``) with
its name as kind, UUID, memory, PCI bus id and the PCI bus ids of its active NVLink peers. Local ids are
positions among the visible GPUs, as the CUDA runtime numbers them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ifrt.records import LocalDevice
from plugins.base import DevicePlugin, select

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
MAX_NVLINKS = 18


def _nvml() -> Any:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class CudaPlugin(DevicePlugin):
    """NVIDIA GPUs as NVML sees them; unavailable without nvidia-ml-py or a driver."""

    name = "cuda"
    properties: ClassVar[Mapping[str, Mapping[str, object]]] = {"*": {"interconnect": "pcie", "direct_transfer": True}}

    def check(self) -> str | None:
        try:
            _nvml()
        except ImportError:
            return "nvidia-ml-py is not installed (pip install 'ifrt-topology[cuda]')"
        except Exception as e:
            return f"NVML did not start ({e}): is an NVIDIA driver installed?"
        return None

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        reason = self.check()
        if reason is not None:
            raise ValueError(f"the cuda plugin cannot list GPUs here: {reason}")
        nvml = _nvml()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        devices = []
        for local_id, (index, handle) in enumerate(self._visible(nvml, handles)):
            pci = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
            attributes = {
                "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                "memory_bytes": str(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                "pci_bus_id": pci,
                "nvml_index": str(index),
            }
            peers = self._nvlink_peers(nvml, handle)
            if peers:
                attributes["nvlink_peers"] = ",".join(peers)
            devices.append(LocalDevice(local_id, "cuda", _text(nvml.nvmlDeviceGetName(handle)),
                                       attributes=attributes))
        return select(devices, local_device_ids)

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """With several processes per host and no CUDA_VISIBLE_DEVICES, gives each its share of the GPUs."""
        if local_world_size <= 1 or VISIBLE_ENV in os.environ or not self.is_available():
            return
        count = _nvml().nvmlDeviceGetCount()
        share = max(1, count // local_world_size)
        mine = range(local_rank * share, min(count, (local_rank + 1) * share))
        os.environ[VISIBLE_ENV] = ",".join(map(str, mine))

    @staticmethod
    def _visible(nvml: Any, handles: list[Any]) -> list[tuple[int, Any]]:
        raw = os.environ.get(VISIBLE_ENV)
        if raw is None:
            return list(enumerate(handles))
        uuids = {_text(nvml.nvmlDeviceGetUUID(h)): i for i, h in enumerate(handles)}
        chosen = []
        for item in filter(None, (s.strip() for s in raw.split(","))):
            if item.isdigit() and int(item) < len(handles):
                chosen.append(int(item))
            elif item in uuids:
                chosen.append(uuids[item])
            else:
                break  # CUDA stops at the first invalid entry
        return [(i, handles[i]) for i in chosen]

    @staticmethod
    def _nvlink_peers(nvml: Any, handle: Any) -> list[str]:
        peers = []
        for link in range(MAX_NVLINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                    peers.append(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
            except nvml.NVMLError:
                break  # no such link, or NVLink not supported
        return sorted(set(peers))
