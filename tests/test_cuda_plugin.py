"""The cuda plugin's decisions, without a GPU: sharing GPUs between local ranks, CUDA_VISIBLE_DEVICES, NVLink peers,
NVLink domains from the fabric."""

import ctypes
import functools
import importlib.util
import logging
import re
import struct
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

import plugins.cuda as cuda
from ifrt.errors import InvalidArgument
from plugins.cuda import (
    FabricInfo,
    fabric_info,
    gpu_device,
    nvlink_domains,
    nvlink_gpu_peers,
    split_gpus,
    visible_gpus,
    visible_share,
)
from tests.requirements import require

UUIDS = [
    "GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01",
    "GPU-8a1c9d33-0e4f-4a2b-8c6d-1f2e3a4b5c6d",
    "GPU-b7d2e0f1-3c4d-4e5f-8a9b-0c1d2e3f4a5b",
    "GPU-c3e0a1b2-4d5e-4f60-9a1b-2c3d4e5f6a7b",
]
"""Four GPUs as NVML lists them; the first two share the prefix GPU-8a1c."""


# sharing a host's GPUs between its processes
@pytest.mark.parametrize(("gpus", "rank", "world", "share"), [
    (4, 0, 1, [0, 1, 2, 3]),
    (8, 0, 4, [0, 1]),
    (8, 3, 4, [6, 7]),
    (4, 3, 4, [3]),
    (8, 0, 3, [0, 1, 2]),  # 8 over 3: the first two ranks get one more
    (8, 1, 3, [3, 4, 5]),
    (8, 2, 3, [6, 7]),
    (5, 4, 5, [4]),
    (7, 1, 2, [4, 5, 6]),
])
def test_each_local_rank_gets_a_contiguous_share(gpus, rank, world, share):
    assert split_gpus(gpus, rank, world) == share


@given(st.integers(1, 64).flatmap(lambda gpus: st.tuples(st.just(gpus), st.integers(1, gpus))))
def test_shares_use_every_gpu_once_and_differ_by_at_most_one(gpus_and_world):
    gpus, world = gpus_and_world
    shares = [split_gpus(gpus, rank, world) for rank in range(world)]
    assert [i for share in shares for i in share] == list(range(gpus))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("rank", range(8))
def test_more_processes_than_gpus_is_an_error_naming_both_counts(rank):
    with pytest.raises(InvalidArgument) as info:
        split_gpus(4, rank, 8)
    assert str(info.value) == ("8 processes on this host but only 4 GPUs: expected at most one process per GPU "
                               "(or set CUDA_VISIBLE_DEVICES for each process)")


@pytest.mark.parametrize(("gpus", "rank", "world", "message"), [
    (0, 0, 2, "2 processes on this host but only 0 GPUs"),
    (4, 4, 4, "local rank 4 is out of range: expected 0 <= local_rank < 4"),
    (4, -1, 4, "local rank -1 is out of range: expected 0 <= local_rank < 4"),
    (4, 0, 0, "local world size 0 is out of range: expected at least 1 process"),
])
def test_impossible_shares_say_what_is_wrong(gpus, rank, world, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        split_gpus(gpus, rank, world)


@pytest.mark.parametrize(("rank", "value"), [
    (0, "GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01,GPU-8a1c9d33-0e4f-4a2b-8c6d-1f2e3a4b5c6d"),
    (1, "GPU-b7d2e0f1-3c4d-4e5f-8a9b-0c1d2e3f4a5b,GPU-c3e0a1b2-4d5e-4f60-9a1b-2c3d4e5f6a7b"),
])
def test_a_share_is_set_by_uuid_and_read_back_as_the_same_gpus(rank, value):
    assert visible_share(UUIDS, rank, 2) == value
    assert visible_gpus(value, UUIDS) == split_gpus(4, rank, 2)


# reading CUDA_VISIBLE_DEVICES
@pytest.mark.parametrize(("raw", "indices"), [
    (None, [0, 1, 2, 3]),
    ("0,2", [0, 2]),
    ("2,1", [2, 1]),  # CUDA numbers them in the order listed
    ("3", [3]),
    (" 1 , 0 ,", [1, 0]),
    ("GPU-b7d2e0f1-3c4d-4e5f-8a9b-0c1d2e3f4a5b", [2]),
    ("GPU-b7d2", [2]),  # a prefix that names one GPU, as nvidia-smi users write it
    ("GPU-8a1c9", [1]),
    ("GPU-B7D2E0F1", [2]),
    ("GPU-c3e0,0", [3, 0]),
    ("0,2,-1,1", [0, 2]),  # CUDA's documented end of the list
])
def test_visible_devices_select_gpus_as_cuda_numbers_them(raw, indices):
    assert visible_gpus(raw, UUIDS) == indices


@pytest.mark.parametrize(("raw", "message"), [
    ("0,7", "CUDA_VISIBLE_DEVICES='0,7': '7' names no GPU here: expected an index below 4 or a UUID (or the "
            "start of one) of GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01, "),
    ("GPU-ffff", "'GPU-ffff' names no GPU here"),
    ("MIG-GPU-8a1c4f2e-6b0d-4c1e-9f3a-2d5b7e8c9a01/1/0", "names no GPU here"),
    ("gpu0", "'gpu0' names no GPU here"),
    ("GPU-8a1c", "'GPU-8a1c' starts the UUIDs of GPUs [0, 1]: expected enough characters to name one GPU"),
    ("0,0", "'0' names GPU 0 again: expected each GPU at most once"),
    ("1,GPU-8a1c9", "'GPU-8a1c9' names GPU 1 again"),
    ("", "no GPU is visible to this process (CUDA_VISIBLE_DEVICES='' hides every GPU)"),
    ("-1", "no GPU is visible to this process (CUDA_VISIBLE_DEVICES='-1' hides every GPU)"),
])
def test_visible_devices_that_cuda_would_cut_short_are_errors(raw, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        visible_gpus(raw, UUIDS)


def test_a_host_without_gpus_is_an_error():
    with pytest.raises(InvalidArgument, match=re.escape("no GPU is visible to this process (NVML sees no GPU)")):
        visible_gpus(None, [])


# NVLink peers
BUS_IDS = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0"]


@pytest.mark.parametrize(("own", "remote", "peers"), [
    ("00000000:07:00.0", ["00000000:0F:00.0", "00000000:0F:00.0", "00000000:47:00.0"],
     ["00000000:0F:00.0", "00000000:47:00.0"]),  # two links to one GPU: one peer
    ("00000000:07:00.0", ["00000000:C1:00.0", "00000000:C2:00.0"], []),  # NVSwitches: not GPUs
    ("00000000:07:00.0", ["00000000:07:00.0"], []),  # the GPU itself
    ("00000000:07:00.0", ["00000000:4e:00.0", "00000000:C1:00.0"], ["00000000:4E:00.0"]),  # case differs
    ("00000000:47:00.0", ["00000000:07:00.0", "00000000:4E:00.0"], ["00000000:07:00.0", "00000000:4E:00.0"]),
    ("00000000:07:00.0", [], []),
])
def test_nvlink_peers_are_the_other_gpus_at_the_far_end(own, remote, peers):
    assert nvlink_gpu_peers(own, remote, BUS_IDS) == peers


# what is published and what stays on the host
def test_a_gpus_host_facts_stay_on_the_host_and_what_others_need_is_published():
    device = gpu_device(1, "NVIDIA H100 80GB HBM3", 85_520_809_984, "node-17", uuid=UUIDS[2], nvml_index=2,
                        pci_bus_id=BUS_IDS[2], nvlink_peers=[BUS_IDS[0], BUS_IDS[3]])
    assert (device.local_id, device.platform, device.kind, device.slice_key) == (1, "cuda", "NVIDIA H100 80GB HBM3",
                                                                                 "node-17")
    assert dict(device.attributes) == {"memory_bytes": "85520809984"}
    assert dict(device.host_attributes) == {"uuid": UUIDS[2], "pci_bus_id": "00000000:47:00.0", "nvml_index": "2",
                                            "nvlink_peers": "00000000:07:00.0,00000000:4E:00.0"}


def test_a_gpu_without_nvlink_peers_has_no_peer_list():
    device = gpu_device(0, "NVIDIA L4", 24 << 30, "node-3", uuid=UUIDS[0], nvml_index=0, pci_bus_id=BUS_IDS[0],
                        nvlink_peers=[])
    assert "nvlink_peers" not in device.host_attributes


# NVLink domains from the fabric (nvmlDeviceGetGpuFabricInfoV), in the shapes real hosts report
NVL72 = bytes.fromhex("5c1b0e2a9f4d4c3b8e7a6d5c4b3a2918")  # one GB200 NVL72 rack's cluster uuid
COMPLETED, NOT_SUPPORTED, NOT_STARTED, IN_PROGRESS = 3, 0, 1, 2
DEGRADED_BANDWIDTH, UNHEALTHY_ROUTE = 0b01, 0b01 << 4
HEALTHY = 0b10 | 0b10 << 2 | 0b10 << 4 | 0b10 << 6  # every health field says "false": nothing wrong


def nvl72_host(clique: int, gpus: int = 4, health: int = HEALTHY) -> list[FabricInfo]:
    return [FabricInfo(COMPLETED, NVL72, clique, 0, health) for _ in range(gpus)]


def test_hosts_of_one_nvl72_domain_share_one_slice_across_hosts():
    hosts = [nvlink_domains(nvl72_host(7), f"nvl-host-{h}") for h in range(18)]
    domains = {d for host in hosts for d in host.domains}
    assert domains == {"5c1b0e2a-9f4d-4c3b-8e7a-6d5c4b3a2918/7"}
    assert all(len(host.domains) == 4 and not host.warnings for host in hosts)
    assert hosts[0].source == "NVLink fabric 5c1b0e2a-9f4d-4c3b-8e7a-6d5c4b3a2918/7"


def test_a_rack_split_into_two_partitions_gives_two_slices():
    first = [nvlink_domains(nvl72_host(1), f"h{h}").domains[0] for h in range(9)]
    second = [nvlink_domains(nvl72_host(2), f"h{h}").domains[0] for h in range(9, 18)]
    assert len(set(first)) == len(set(second)) == 1
    assert first[0] != second[0] and first[0].split("/")[0] == second[0].split("/")[0]


@pytest.mark.parametrize(("fabric", "why"), [
    ([FabricInfo(NOT_SUPPORTED)] * 8, "GPU 0 is in no NVLink fabric: fabric state not supported (and 7 more GPUs)"),
    (["NVML gives no fabric info (Not Supported)"], "GPU 0 is in no NVLink fabric: NVML gives no fabric info"),
    ([FabricInfo(NOT_STARTED, NVL72, 7)], "fabric state not started"),
    ([FabricInfo(IN_PROGRESS, NVL72, 7)], "fabric state in progress"),
    ([FabricInfo(COMPLETED, bytes(16), 0)], "fabric cluster uuid is all zero"),
    ([FabricInfo(COMPLETED, NVL72, 7, status=999)], "fabric registration failed (NVML status 999)"),
    ([*nvl72_host(7, 3), FabricInfo(NOT_STARTED, NVL72, 7)], "GPU 3 is in no NVLink fabric: fabric state not started"),
])
def test_without_a_complete_fabric_every_gpu_of_the_host_is_the_hosts_slice(fabric, why):
    found = nvlink_domains(fabric, "hgx-node-12")
    assert found.domains == ["hgx-node-12"] * len(fabric)
    assert found.source.startswith("host hgx-node-12: ") and why in found.source


def test_a_degraded_fabric_keeps_its_domain_and_says_what_is_wrong():
    fabric = nvl72_host(7, 2) + nvl72_host(7, 1, DEGRADED_BANDWIDTH | UNHEALTHY_ROUTE)
    found = nvlink_domains(fabric, "nvl-host-3")
    assert found.domains == ["5c1b0e2a-9f4d-4c3b-8e7a-6d5c4b3a2918/7"] * 3
    assert found.warnings == ["GPU 2 in NVLink domain 5c1b0e2a-9f4d-4c3b-8e7a-6d5c4b3a2918/7: degraded bandwidth, "
                              "unhealthy route"]


def test_a_gpus_fabric_state_stays_on_its_host():
    device = gpu_device(0, "NVIDIA GB200", 192 << 30, "5c1b0e2a-9f4d-4c3b-8e7a-6d5c4b3a2918/7", uuid=UUIDS[0],
                        nvml_index=0, pci_bus_id=BUS_IDS[0], nvlink_peers=[], fabric="fabric state not started")
    assert device.host_attributes["fabric"] == "fabric state not started"
    assert device.slice_key == "5c1b0e2a-9f4d-4c3b-8e7a-6d5c4b3a2918/7"


# The fabric read through each nvidia-ml-py the project accepts: that version's own pynvml module (its structure
# classes, call wrappers and errors), with only libnvidia-ml itself stood in for by C callbacks that write what nvml.h
# lays out. scripts/test.sh installs each version into .venv/nvml/<version>.
NVML_VERSIONS = ("12.535.77", "12.550.52", "12.560.30", "12.570.86", "12.575.51", "13.580.65", "13.615.71")
"""The oldest 12.x (the floor of the cuda extra), one of each way 12.x declares the structures, and 13.x."""
NVML_ROOT = Path(__file__).resolve().parents[1] / ".venv" / "nvml"
NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 0, 3, 25
FABRIC_V2 = 0x02000024  # nvmlGpuFabricInfo_v2: NVML_STRUCT_VERSION(GpuFabricInfo, 2), sizeof 36
PADDING = b"\xa5" * 3  # after the one-byte state: nvml.h promises nothing about these bytes
NvmlFunction = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p)


def nvml_fabric_v1(state: int, uuid: bytes = bytes(16), clique: int = 0) -> bytes:
    """nvmlGpuFabricInfo_t as nvml.h lays it out: unsigned char clusterUuid[16], nvmlReturn_t status, unsigned int
    cliqueId, nvmlGpuFabricState_t state (one unsigned char), padded to 28 bytes."""
    return struct.pack("=16sIIB", uuid, 0, clique, state) + PADDING


def nvml_fabric_v2(state: int, uuid: bytes = bytes(16), clique: int = 0, health: int = 0) -> bytes:
    """nvmlGpuFabricInfo_v2_t (nvmlGpuFabricInfoV_t): version, then v1's fields, then unsigned int healthMask."""
    return struct.pack("=I16sIIB", FABRIC_V2, uuid, 0, clique, state) + PADDING + struct.pack("=I", health)


class NvmlLibrary:
    """libnvidia-ml's fabric calls as C functions: each gets the bare pointer the C ABI passes (a structure passed by
    value is refused, where the real library crashed the process) and writes ``written[name]`` there, the V call
    only after checking the version its caller set. A driver older than 550 has no V call (``written`` lacks it)."""

    def __init__(self, written: dict[str, bytes], result: int = NVML_SUCCESS) -> None:
        self.calls: list[str] = []
        for name, data in written.items():
            setattr(self, name, NvmlFunction(self._function(name, data, result)))

    def _function(self, name: str, data: bytes, result: int) -> Callable[[int | None, int | None], int]:
        def call(device: int | None, info: int | None) -> int:
            self.calls.append(name)
            if result != NVML_SUCCESS:
                return result
            if name.endswith("V") and ctypes.c_uint.from_address(info).value != FABRIC_V2:
                return NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            ctypes.memmove(info, data, len(data))
            return NVML_SUCCESS
        return call


@functools.cache
def pynvml_module(version: str) -> ModuleType:
    """nvidia-ml-py ``version``'s own pynvml module, loaded from .venv/nvml under a name of its own."""
    path = NVML_ROOT / version / "pynvml.py"
    if not path.is_file():
        require(f"nvidia-ml-py {version}", f"no {path}; scripts/test.sh installs it (or run: .venv/bin/python -m pip "
                f"install --no-deps --target {NVML_ROOT / version} nvidia-ml-py=={version})")
    name = f"pynvml_{version.replace('.', '_')}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pynvml makes its error classes through sys.modules[__name__]
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=NVML_VERSIONS)
def pynvml(request: pytest.FixtureRequest) -> ModuleType:
    return pynvml_module(request.param)


def read_fabric(pynvml: ModuleType, library: NvmlLibrary, monkeypatch: pytest.MonkeyPatch) -> FabricInfo | str:
    """The plugin's fabric read of one GPU through ``pynvml`` with ``library`` as the loaded libnvidia-ml."""
    monkeypatch.setattr(pynvml, "nvmlLib", library)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return fabric_info(pynvml, pynvml.c_nvmlDevice_t())


def fabric_calls(v1: bytes, v2: bytes | None) -> dict[str, bytes]:
    calls = {"nvmlDeviceGetGpuFabricInfo": v1}
    if v2 is not None:
        calls["nvmlDeviceGetGpuFabricInfoV"] = v2
    return calls


def test_a_gpu_without_a_fabric_reads_as_not_supported_with_every_nvidia_ml_py(pynvml, monkeypatch):
    library = NvmlLibrary(fabric_calls(nvml_fabric_v1(NOT_SUPPORTED), nvml_fabric_v2(NOT_SUPPORTED)))
    info = read_fabric(pynvml, library, monkeypatch)
    assert info == FabricInfo(NOT_SUPPORTED, bytes(16), 0, 0, 0)
    assert nvlink_domains([info], "hgx-node-12").domains == ["hgx-node-12"]


def test_an_nvl72_gpu_reads_its_domain_with_every_nvidia_ml_py(pynvml, monkeypatch):
    library = NvmlLibrary(fabric_calls(nvml_fabric_v1(COMPLETED, NVL72, 7),
                                       nvml_fabric_v2(COMPLETED, NVL72, 7, HEALTHY | DEGRADED_BANDWIDTH << 6)))
    info = read_fabric(pynvml, library, monkeypatch)
    versioned = hasattr(pynvml, "nvmlDeviceGetGpuFabricInfoV")  # from 12.550; 12.535 has the first call only
    assert info == FabricInfo(COMPLETED, NVL72, 7, 0, (HEALTHY | DEGRADED_BANDWIDTH << 6) if versioned else 0)
    assert library.calls == ["nvmlDeviceGetGpuFabricInfoV" if versioned else "nvmlDeviceGetGpuFabricInfo"]
    assert nvlink_domains([info], "nvl-host-3").domains == ["5c1b0e2a-9f4d-4c3b-8e7a-6d5c4b3a2918/7"]


def test_a_driver_without_the_versioned_call_reads_the_first_one(pynvml, monkeypatch):
    library = NvmlLibrary(fabric_calls(nvml_fabric_v1(COMPLETED, NVL72, 3), None))
    assert read_fabric(pynvml, library, monkeypatch) == FabricInfo(COMPLETED, NVL72, 3, 0, 0)
    assert library.calls == ["nvmlDeviceGetGpuFabricInfo"]


def test_a_gpu_nvml_gives_no_fabric_info_for_is_its_hosts_slice(pynvml, monkeypatch):
    library = NvmlLibrary(fabric_calls(b"", b""), result=NVML_ERROR_NOT_SUPPORTED)
    assert read_fabric(pynvml, library, monkeypatch) == "NVML gives no fabric info (Not Supported)"


class TooSmall(ctypes.Structure):
    """A structure smaller than NVML writes, as an nvidia-ml-py that declared it wrong would have it."""

    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_uint8 * 4)]


def test_a_fabric_read_that_fails_leaves_discovery_to_the_hosts_slice_and_is_logged_once(monkeypatch, caplog):
    pynvml = pynvml_module(NVML_VERSIONS[-1])
    monkeypatch.setattr(pynvml, "c_nvmlGpuFabricInfoV_t", TooSmall)
    monkeypatch.setattr(cuda, "_logged_fabric_failures", set())
    library = NvmlLibrary(fabric_calls(nvml_fabric_v1(COMPLETED, NVL72, 7), nvml_fabric_v2(COMPLETED, NVL72, 7)))
    with caplog.at_level(logging.WARNING, logger="ifrt.plugins.cuda"):
        found = [read_fabric(pynvml, library, monkeypatch) for _ in range(2)]
    why = ("the fabric info could not be read: nvidia-ml-py's TooSmall holds 8 bytes where NVML writes 36 "
           "(nvmlGpuFabricInfo_v2_t)")
    assert found == [why, why]
    assert library.calls == []  # never handed to NVML, which would write past its end
    assert [r.getMessage() for r in caplog.records] == [f"cuda plugin: {why}; the GPUs' slice is their host's"]
    assert nvlink_domains(found, "node-3").domains == ["node-3", "node-3"]


def test_the_versions_tested_are_the_ones_installed_and_the_extras_floor():
    script = (Path(__file__).resolve().parents[1] / "scripts" / "test.sh").read_text()
    assert f"nvml_versions=({' '.join(NVML_VERSIONS)})" in script
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["cuda"] == [f"nvidia-ml-py>={NVML_VERSIONS[0]}"]
