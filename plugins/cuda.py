"""The ``cuda`` plugin: NVIDIA GPUs through NVML (package nvidia-ml-py, extra ``ifrt-topology[cuda]``).

Reports each visible GPU with its name as kind, its memory, and its NVLink domain as slice. Where every visible
GPU has joined a multi-node NVLink fabric (GB200 NVL72 and the like: NVML's fabric state is completed and the
cluster uuid is not all zero), the slice key is ``<clusterUuid>/<cliqueId>``, one slice per NVLink partition across
hosts, as XLA forms it; otherwise (an HGX board, whose NVLink reaches the GPUs of its own host, or a fabric not
started) the slice key is the hostname. Its UUID, PCI bus id, NVML index, the PCI bus ids of the GPUs it reaches
over active NVLinks and its fabric state are ``host_attributes``: they only mean something on this host, so they
stay here (``Client.local_devices``) instead of costing every process 16+ bytes per GPU in the topology. Local ids
are positions among the visible GPUs, as the CUDA runtime numbers them.

``CUDA_VISIBLE_DEVICES`` is read as CUDA reads it, e.g. ``0,2`` (NVML indices, which are CUDA's with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``), ``GPU-8a1c4f2e-...`` (a UUID) or ``GPU-8a1c`` (a prefix naming one GPU);
a negative index such as ``0,2,-1,1`` ends the list. Where CUDA would silently drop the rest of the list (an
entry that names no GPU, or names one twice), this plugin raises an error naming the entry instead.

With several processes on a host (``IFRT_LOCAL_WORLD_SIZE``) and no ``CUDA_VISIBLE_DEVICES``, each process
gets a contiguous share of the GPUs (8 GPUs over 3 processes: 3, 3, 2), set by UUID; more processes than GPUs
is an error naming both counts.

The decisions are the pure functions below (``split_gpus``, ``visible_share``, ``visible_gpus``,
``nvlink_gpu_peers``, ``nvlink_domains``, ``gpu_device``); the NVML calls around them only read the hardware.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from ifrt.errors import InvalidArgument
from ifrt.records import LocalDevice
from plugins.base import DevicePlugin, select

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"  # e.g. CUDA_VISIBLE_DEVICES=0,2 or GPU-8a1c4f2e or "" (no GPU)
UUID_PREFIX = "GPU-"  # as nvidia-smi -L prints them: GPU-8932f937-d72c-4106-c12f-20bd9faed9f6
MAX_NVLINKS = 18
FABRIC_STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
"""NVML_GPU_FABRIC_STATE_*: a GPU's registration with the NVLink fabric manager."""
FABRIC_COMPLETED = 3
FABRIC_HEALTH = (  # (shift, what the 2-bit field's value 1 means) of NVML_GPU_FABRIC_HEALTH_MASK_*
    (0, "degraded bandwidth"),
    (2, "route recovery in progress"),
    (4, "unhealthy route"),
    (6, "access timeout recovery in progress"),
)

log = logging.getLogger("ifrt.plugins.cuda")


def split_gpus(gpu_count: int, local_rank: int, local_world_size: int) -> list[int]:
    """The GPU indices of one of ``local_world_size`` processes sharing a host: contiguous, every GPU used once.

    The first ``gpu_count % local_world_size`` ranks get one GPU more, so no GPU is left idle and no process
    is left without one; InvalidArgument (naming both counts) when there are more processes than GPUs.
    """
    if local_world_size < 1:
        raise InvalidArgument(f"local world size {local_world_size} is out of range: expected at least 1 process")
    if not 0 <= local_rank < local_world_size:
        raise InvalidArgument(f"local rank {local_rank} is out of range: expected 0 <= local_rank < "
                              f"{local_world_size} (the local world size)")
    if gpu_count < local_world_size:
        raise InvalidArgument(f"{local_world_size} processes on this host but only {gpu_count} GPUs: expected at "
                              f"most one process per GPU (or set {VISIBLE_ENV} for each process)")
    share, extra = divmod(gpu_count, local_world_size)
    start = local_rank * share + min(local_rank, extra)
    return list(range(start, start + share + (local_rank < extra)))


def visible_share(uuids: Sequence[str], local_rank: int, local_world_size: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that gives a local rank its share (``split_gpus``), by UUID.

    UUIDs name GPUs exactly whatever ``CUDA_DEVICE_ORDER`` says, where indices could mean other GPUs to CUDA.
    """
    return ",".join(uuids[i] for i in split_gpus(len(uuids), local_rank, local_world_size))


def visible_gpus(raw: str | None, uuids: Sequence[str]) -> list[int]:
    """The NVML indices CUDA numbers 0, 1, ... under ``CUDA_VISIBLE_DEVICES=raw``, given every GPU's UUID.

    Unset means every GPU. InvalidArgument naming the entry when one names no GPU, several (an ambiguous UUID
    prefix) or a GPU listed before (CUDA would silently drop the rest of the list), and when no GPU is visible.
    """
    if raw is None:
        chosen = list(range(len(uuids)))
    else:
        chosen = []
        for entry in (part.strip() for part in raw.split(",")):
            if not entry:
                continue  # "0,1," and "0, 1" mean 0 and 1
            if re.fullmatch(r"-\d+", entry):
                break  # CUDA's documented end of the list: 0,2,-1,1 makes 0 and 2 visible
            matches = _matching_gpus(entry, uuids)
            if not matches:
                raise InvalidArgument(f"{VISIBLE_ENV}={raw!r}: {entry!r} names no GPU here: expected an index below "
                                      f"{len(uuids)} or a UUID (or the start of one) of {_listing(uuids)}")
            if len(matches) > 1:
                raise InvalidArgument(f"{VISIBLE_ENV}={raw!r}: {entry!r} starts the UUIDs of GPUs {matches}: "
                                      "expected enough characters to name one GPU")
            if matches[0] in chosen:
                raise InvalidArgument(f"{VISIBLE_ENV}={raw!r}: {entry!r} names GPU {matches[0]} again: expected "
                                      "each GPU at most once")
            chosen.append(matches[0])
    if not chosen:
        where = f"{VISIBLE_ENV}={raw!r} hides every GPU" if raw is not None and uuids else "NVML sees no GPU"
        raise InvalidArgument(f"no GPU is visible to this process ({where}): expected at least one for the cuda "
                              "plugin (use the cpu plugin for a process without GPUs)")
    return chosen


def _matching_gpus(entry: str, uuids: Sequence[str]) -> list[int]:
    """The indices of the GPUs ``entry`` names: an NVML index, a UUID, or the start of a UUID (GPU-...)."""
    if entry.isdigit():
        return [int(entry)] if int(entry) < len(uuids) else []
    if not entry.upper().startswith(UUID_PREFIX):
        return []  # MIG-... entries and anything else name no GPU this plugin lists
    return [i for i, uuid in enumerate(uuids) if uuid.lower().startswith(entry.lower())]


def _listing(uuids: Sequence[str]) -> str:
    return ", ".join(uuids) if uuids else "no GPU (NVML sees none)"


def nvlink_gpu_peers(own_bus_id: str, remote_bus_ids: Iterable[str], gpu_bus_ids: Iterable[str]) -> list[str]:
    """The PCI bus ids of the other GPUs among a GPU's NVLink remote ends, sorted and distinct.

    A remote end that is no GPU of this host (an NVSwitch, a CPU's NVLink port) or the GPU itself is no peer.
    Bus ids are compared without case and returned as ``gpu_bus_ids`` spells them (as each GPU's pci_bus_id).
    """
    remote = {_bus(b) for b in remote_bus_ids} - {_bus(own_bus_id)}
    return sorted({b for b in gpu_bus_ids if _bus(b) in remote})


def _bus(bus_id: str) -> str:
    return bus_id.strip().lower()


@dataclass(frozen=True)
class FabricInfo:
    """One GPU's registration with a multi-node NVLink fabric, as ``nvmlDeviceGetGpuFabricInfoV`` reports it."""

    state: int
    """NVML_GPU_FABRIC_STATE_*: 0 not supported, 1 not started, 2 in progress, 3 completed."""
    cluster_uuid: bytes = bytes(16)
    clique_id: int = 0
    status: int = 0
    """The NVML return code of the registration (0: success)."""
    health_mask: int = 0

    @property
    def domain(self) -> str:
        """``<clusterUuid>/<cliqueId>``: the GPUs of one NVLink partition, across hosts, share it."""
        return f"{UUID(bytes=bytes(self.cluster_uuid))}/{self.clique_id}"

    def problem(self) -> str | None:
        """Why this GPU names no fabric domain, or None where it does."""
        if self.state != FABRIC_COMPLETED:
            return f"fabric state {FABRIC_STATES.get(self.state, self.state)}"
        if self.status != 0:
            return f"fabric registration failed (NVML status {self.status})"
        if not any(self.cluster_uuid):
            return "fabric cluster uuid is all zero"
        return None

    def health(self) -> list[str]:
        """What the health mask reports as wrong (degraded bandwidth, an unhealthy route, ...); empty if nothing."""
        return [what for shift, what in FABRIC_HEALTH if (self.health_mask >> shift) & 0x3 == 1]


@dataclass(frozen=True)
class NvlinkDomains:
    """Each visible GPU's NVLink domain (its slice key), where they came from, and what the fabric reports as
    wrong with any of them."""

    domains: list[str]
    source: str
    warnings: list[str]


def nvlink_domains(fabric: Sequence[FabricInfo | str], host_domain: str) -> NvlinkDomains:
    """The NVLink domains of a process's GPUs, given per GPU its FabricInfo or why NVML gave none.

    Only when every GPU has a completed registration with a valid cluster uuid is each GPU's domain
    ``<clusterUuid>/<cliqueId>`` (one slice per NVLink partition across hosts); else every GPU's is
    ``host_domain``, as on a board whose NVLink stays in the host. A degraded health mask keeps the domain (the
    GPU is still in it) and becomes a warning.
    """
    problems = [(i, info if isinstance(info, str) else info.problem()) for i, info in enumerate(fabric)]
    problems = [(i, why) for i, why in problems if why is not None]
    if problems or not fabric:
        i, why = problems[0] if problems else (0, "no GPU")
        more = f" (and {len(problems) - 1} more GPUs)" if len(problems) > 1 else ""
        return NvlinkDomains([host_domain] * len(fabric),
                             f"host {host_domain}: GPU {i} is in no NVLink fabric: {why}{more}", [])
    infos = [info for info in fabric if isinstance(info, FabricInfo)]
    domains = [info.domain for info in infos]
    warnings = [f"GPU {i} in NVLink domain {info.domain}: {', '.join(info.health())}"
                for i, info in enumerate(infos) if info.health()]
    return NvlinkDomains(domains, f"NVLink fabric {', '.join(dict.fromkeys(domains))}", warnings)


def fabric_text(info: FabricInfo | str) -> str:
    """A GPU's fabric state in a few words: its domain, or why it has none."""
    if isinstance(info, str):
        return info
    return info.problem() or info.domain


def gpu_device(local_id: int, name: str, memory_bytes: int, nvlink_domain: str, *, uuid: str, nvml_index: int,
               pci_bus_id: str, nvlink_peers: Sequence[str], fabric: str = "") -> LocalDevice:
    """One GPU as this plugin reports it: published what other processes need (kind, memory, NVLink domain as
    slice); kept on this host what only names something here (UUID, NVML index, PCI bus ids, fabric state)."""
    host_only = {"uuid": uuid, "pci_bus_id": pci_bus_id, "nvml_index": str(nvml_index)}
    if nvlink_peers:
        host_only["nvlink_peers"] = ",".join(nvlink_peers)
    if fabric:
        host_only["fabric"] = fabric
    return LocalDevice(local_id, "cuda", name, slice_key=nvlink_domain, attributes={"memory_bytes": str(memory_bytes)},
                       host_attributes=host_only)


def _nvml() -> Any:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class CudaPlugin(DevicePlugin):
    """NVIDIA GPUs as NVML sees them; unavailable without nvidia-ml-py or a driver."""

    name = "cuda"

    def check(self) -> str | None:
        try:
            _nvml()
        except ImportError:
            return "nvidia-ml-py is not installed (pip install 'ifrt-topology[cuda]')"
        except Exception as e:
            return f"NVML did not start ({e}): is an NVIDIA driver installed?"
        return None

    def gpu_count(self) -> int:
        """How many GPUs NVML sees on this host (0 without a driver or nvidia-ml-py); starts no CUDA context."""
        return _nvml().nvmlDeviceGetCount() if self.is_available() else 0

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        nvml, handles, uuids, bus_ids, visible = self._visible()
        fabric, found = self._fabric(nvml, [handles[index] for index in visible])
        log.debug("cuda plugin: slices from %s", found.source)
        for warning in found.warnings:
            log.warning("cuda plugin: %s", warning)
        devices = []
        for local_id, index in enumerate(visible):
            handle = handles[index]
            peers = nvlink_gpu_peers(bus_ids[index], self._nvlink_remote_bus_ids(nvml, handle), bus_ids)
            devices.append(gpu_device(local_id, _text(nvml.nvmlDeviceGetName(handle)),
                                      nvml.nvmlDeviceGetMemoryInfo(handle).total, found.domains[local_id],
                                      uuid=uuids[index], nvml_index=index, pci_bus_id=bus_ids[index],
                                      nvlink_peers=peers, fabric=fabric_text(fabric[local_id])))
        return select(devices, local_device_ids)

    def nvlink_fabric(self) -> tuple[list[FabricInfo | str], NvlinkDomains]:
        """The visible GPUs' fabric registrations (or why NVML gives none) and the NVLink domains chosen from them."""
        nvml, handles, _, _, visible = self._visible()
        return self._fabric(nvml, [handles[index] for index in visible])

    @staticmethod
    def _fabric(nvml: Any, handles: Sequence[Any]) -> tuple[list[FabricInfo | str], NvlinkDomains]:
        fabric = [fabric_info(nvml, handle) for handle in handles]
        return fabric, nvlink_domains(fabric, socket.gethostname())

    def _visible(self) -> tuple[Any, list[Any], list[str], list[str], list[int]]:
        """NVML, every GPU's handle, UUID and PCI bus id, and the NVML indices of the visible GPUs in CUDA's order."""
        reason = self.check()
        if reason is not None:
            raise InvalidArgument(f"the cuda plugin cannot list GPUs here: {reason}")
        nvml = _nvml()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        bus_ids = [_text(nvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        return nvml, handles, uuids, bus_ids, visible_gpus(os.environ.get(VISIBLE_ENV), uuids)

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """With several processes per host and no CUDA_VISIBLE_DEVICES, gives each its share of the GPUs."""
        if local_world_size <= 1 or VISIBLE_ENV in os.environ or not self.is_available():
            return
        nvml = _nvml()
        uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
                 for i in range(nvml.nvmlDeviceGetCount())]
        os.environ[VISIBLE_ENV] = visible_share(uuids, local_rank, local_world_size)

    @staticmethod
    def _nvlink_remote_bus_ids(nvml: Any, handle: Any) -> list[str]:
        """The PCI bus ids at the far end of this GPU's active NVLinks (GPUs, switches or CPUs alike)."""
        remote = []
        for link in range(MAX_NVLINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                    remote.append(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
            except nvml.NVMLError:
                break  # no such link, or NVLink not supported
        return remote


FABRIC_V1 = struct.Struct("=16sIIB3x")
"""nvmlGpuFabricInfo_t as nvml.h lays it out: unsigned char clusterUuid[16], nvmlReturn_t status, unsigned int
cliqueId, nvmlGpuFabricState_t state (one unsigned char), padding to 28 bytes."""
FABRIC_V2 = struct.Struct("=I16sIIB3xI")
"""nvmlGpuFabricInfo_v2_t (nvmlGpuFabricInfoV_t): unsigned int version, v1's fields, unsigned int healthMask."""
FABRIC_V2_VERSION = FABRIC_V2.size | 2 << 24  # nvmlGpuFabricInfo_v2 = NVML_STRUCT_VERSION(GpuFabricInfo, 2)
NVML_ERROR_FUNCTION_NOT_FOUND = 13  # the driver's libnvidia-ml lacks the call (the V call came with driver 550)
_logged_fabric_failures: set[str] = set()


def fabric_info(nvml: Any, handle: Any) -> FabricInfo | str:
    """A GPU's fabric registration through NVML, or why there is none; never raises, so discovery goes on.

    The bytes NVML writes are read as nvml.h lays them out, not through nvidia-ml-py's fields: 12.x declares the
    cluster uuid as text (decoding 16 raw bytes fails) and up to 12.560 as 80 bytes, and every version reads the
    one-byte state as four. A read that fails for any reason other than NVML's answer is logged once per process.
    """
    nvml_error = getattr(nvml, "NVMLError", ())
    try:
        return _read_fabric(nvml, handle)
    except nvml_error as e:
        return f"NVML gives no fabric info ({e})"
    except Exception as e:  # a pynvml this plugin does not know: the GPU is then its host's slice, not an error
        why = f"the fabric info could not be read: {e}"
        if why not in _logged_fabric_failures:
            _logged_fabric_failures.add(why)
            log.warning("cuda plugin: %s; the GPUs' slice is their host's", why)
        return why


def _read_fabric(nvml: Any, handle: Any) -> FabricInfo | str:
    """The versioned call (with the health mask) where nvidia-ml-py and the driver have it, else the first one."""
    if hasattr(nvml, "nvmlDeviceGetGpuFabricInfoV") and hasattr(nvml, "c_nvmlGpuFabricInfoV_t"):
        try:
            raw = _call_fabric(nvml.nvmlDeviceGetGpuFabricInfoV, nvml.c_nvmlGpuFabricInfoV_t, handle, FABRIC_V2,
                               "nvmlGpuFabricInfo_v2_t", FABRIC_V2_VERSION)
            _, uuid, status, clique, state, health = FABRIC_V2.unpack(raw)
            return FabricInfo(state, uuid, clique, status, health)
        except nvml.NVMLError as e:
            if getattr(e, "value", None) != NVML_ERROR_FUNCTION_NOT_FOUND:
                raise  # a driver older than 550 lacks the V call: the first one follows
    if not hasattr(nvml, "nvmlDeviceGetGpuFabricInfo") or not hasattr(nvml, "c_nvmlGpuFabricInfo_t"):
        return "this nvidia-ml-py has no fabric info call"
    raw = _call_fabric(nvml.nvmlDeviceGetGpuFabricInfo, nvml.c_nvmlGpuFabricInfo_t, handle, FABRIC_V1,
                       "nvmlGpuFabricInfo_t", None)
    uuid, status, clique, state = FABRIC_V1.unpack(raw)
    return FabricInfo(state, uuid, clique, status)


def _call_fabric(call: Any, structure: type[ctypes.Structure], handle: Any, layout: struct.Struct, c_name: str,
                 version: int | None) -> bytes:
    """NVML's bytes from one fabric call into nvidia-ml-py's own structure, passed by pointer (NVML crashes the
    process on a structure passed by value), with the version this reader's layout is (not the one pynvml set)."""
    info = structure()
    size = ctypes.sizeof(info)
    if size < layout.size:  # NVML would write past its end
        raise ValueError(f"nvidia-ml-py's {structure.__name__} holds {size} bytes where NVML writes {layout.size} "
                         f"({c_name})")
    if version is not None:
        ctypes.c_uint.from_buffer(info).value = version
    call(handle, ctypes.byref(info))
    return ctypes.string_at(ctypes.addressof(info), layout.size)
