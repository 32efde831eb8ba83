"""Device content for the discovery benchmark: identical synthetic devices, or what real GPU and TPU hosts report.

    .venv/bin/python bench/content.py --content gpu --processes 4096 --devices 8
    .venv/bin/python bench/content.py --content tpu --processes 8192 --devices 4 --publish-host-attributes

Used by bench/discovery.py and bench/ifrt_driver.py (``--content``); run alone, it builds the topology the
coordinator would publish for that content (without a coordinator) and prints one JSON object: bytes per device
raw and as sent, and the time to encode and decode it.

- ``synthetic``: every process the same: devices ``cpu``/``sim``, hostname ``host-00042``, no attributes.
- ``gpu``: hosts of K (up to 8) H100 SXM GPUs as the ``cuda`` plugin reports them: kind, memory, a random UUID
  per GPU, PCI bus ids, NVML index, NVLink peers; NVLink domain (slice) = the host. Hostnames as a cloud's
  instance group names them (a random suffix), process ids in hostname order, as the coordinator assigns them.
- ``tpu``: TPU v4 hosts of K (1, 2, 4 or 8) chips as the ``jax`` plugin reports them: 3-D torus coordinates,
  core_on_chip, slices of up to 16x16x16 chips (multislice beyond), TPU VM hostnames, process ids slice-major.

Every host has a random address in a /16 and a random ephemeral transfer port, as a cloud VPC and a port-0 bind
give. Host-only attributes (``LocalDevice.host_attributes``) are not sent; ``publish_host_attributes`` folds them
into the published attributes instead, as the plugins did before they were split, to show what they would cost.
Content is a pure function of (content, N, K, seed): every driver process builds the same hosts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from functools import cached_property

from ifrt import wire
from ifrt.ids import global_device_id
from ifrt.records import Device, LocalDevice, Process, TopologyContent
from plugins.cuda import gpu_device

CONTENTS = ("synthetic", "gpu", "tpu")
SYNTHETIC_PORT = 8477
EPHEMERAL_PORTS = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range: what a port-0 bind gets

GPU_KIND = "NVIDIA H100 80GB HBM3"
GPU_MEMORY_BYTES = 85_520_809_984  # what NVML reports as total for this kind (81559 MiB)
GPU_BUS_IDS = ("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
               "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0")
"""An 8-GPU HGX H100 board as NVML lists it (the same on every host of one machine type)."""

TPU_KIND = "TPU v4"
TPU_HOST_BLOCKS = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2)}
"""Chips per host -> the (x, y, z) box of the torus one host holds."""
TPU_MAX_SLICE_CHIPS = 4096  # a 16x16x16 v4 slice; larger jobs span several slices (multislice)


@dataclass(frozen=True)
class Host:
    """What one simulated process registers."""

    hostname: str
    address: str
    plugin: str
    devices: tuple[LocalDevice, ...]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The content options, the same in bench/discovery.py and bench/ifrt_driver.py."""
    parser.add_argument("--content", choices=CONTENTS, default="synthetic",
                        help="device content: identical synthetic devices, or realistic GPU or TPU hosts "
                             "(default %(default)s; see bench/content.py)")
    parser.add_argument("--publish-host-attributes", action="store_true",
                        help="publish the host-only attributes too (GPU UUIDs, PCI bus ids, ...), as the plugins "
                             "did before they were kept on their host")


def driver_arguments(args: argparse.Namespace) -> list[str]:
    """The command-line options that pass ``args``' content options on to a driver process."""
    return ["--content", args.content] + (["--publish-host-attributes"] if args.publish_host_attributes else [])


def describe(args: argparse.Namespace) -> str:
    """The content label a benchmark record carries, e.g. ``gpu`` or ``gpu+host-attributes``."""
    return args.content + ("+host-attributes" if args.publish_host_attributes else "")


class Cluster:
    """N hosts of one content; ``host(process_id)`` is what that process registers."""

    def __init__(self, content: str, num_processes: int, devices_per_process: int, *,
                 publish_host_attributes: bool = False, seed: int = 0) -> None:
        if content not in CONTENTS:
            raise ValueError(f"unknown content {content!r}: expected one of {', '.join(CONTENTS)}")
        if content == "gpu" and not 1 <= devices_per_process <= len(GPU_BUS_IDS):
            raise ValueError(f"gpu content has 1 to {len(GPU_BUS_IDS)} GPUs per host, not {devices_per_process}")
        if content == "tpu" and devices_per_process not in TPU_HOST_BLOCKS:
            raise ValueError(f"tpu content has {sorted(TPU_HOST_BLOCKS)} chips per host, not {devices_per_process}")
        self.content, self.n, self.k = content, num_processes, devices_per_process
        self.publish_host_attributes = publish_host_attributes
        self.seed = seed

    def host(self, process_id: int) -> Host:
        """The hostname, transfer address, plugin and devices of process ``process_id``."""
        if not 0 <= process_id < self.n:
            raise ValueError(f"process id {process_id} is out of range: expected 0 <= id < {self.n}")
        if self.content == "synthetic":
            return Host(f"host-{process_id:05d}", _synthetic_address(process_id), "cpu",
                        tuple(LocalDevice(i, "cpu", "sim") for i in range(self.k)))
        rng = random.Random(f"{self.seed}/{self.content}/{process_id}")  # per host: drivers build only their own
        ip = self._ips[process_id]
        address = f"{ip}:{rng.randint(*EPHEMERAL_PORTS)}"
        if self.content == "gpu":
            hostname = self._gpu_hostnames[process_id]
            return Host(hostname, address, "cuda", self._published(_gpu_devices(hostname, self.k, rng)))
        return Host(self._tpu_hostname(process_id), address, "jax", self._published(self._tpu_devices(process_id)))

    def _published(self, devices: list[LocalDevice]) -> tuple[LocalDevice, ...]:
        if not self.publish_host_attributes:
            return tuple(devices)
        return tuple(LocalDevice(d.local_id, d.platform, d.kind, d.slice_key, d.coordinates,
                                 {**d.attributes, **d.host_attributes}) for d in devices)

    @cached_property
    def _ips(self) -> list[str]:
        """A distinct random address in one /16 per host (a cloud VPC subnet hands them out in no useful order)."""
        second = {"gpu": 128, "tpu": 130}[self.content]
        picks = random.Random(f"{self.seed}/{self.content}/ips").sample(range(2, 65534), self.n)
        return [f"10.{second}.{x >> 8}.{x & 255}" for x in picks]

    @cached_property
    def _gpu_hostnames(self) -> list[str]:
        """Instance group names (a base, then 4 random characters), sorted: process ids follow hostnames."""
        rng = random.Random(f"{self.seed}/gpu/hostnames")
        alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
        names: set[str] = set()
        while len(names) < self.n:
            names.add("a3-highgpu-8g-" + "".join(rng.choices(alphabet, k=4)))
        return sorted(names)

    @cached_property
    def _tpu_slice_shape(self) -> tuple[int, int, int]:
        """The chips of one slice: the host box doubled along its shortest side up to the job or 4096 chips."""
        shape = list(TPU_HOST_BLOCKS[self.k])
        while math.prod(shape) < min(self.n * self.k, TPU_MAX_SLICE_CHIPS):
            shape[shape.index(min(shape))] *= 2
        return shape[0], shape[1], shape[2]

    def _tpu_place(self, process_id: int) -> tuple[int, int, tuple[int, int, int]]:
        """(slice, worker, the torus coordinates of the worker's first chip)."""
        hosts_per_slice = math.prod(self._tpu_slice_shape) // self.k
        slice_index, worker = divmod(process_id, hosts_per_slice)
        block = TPU_HOST_BLOCKS[self.k]
        grid = [s // b for s, b in zip(self._tpu_slice_shape, block, strict=True)]
        bx, rest = worker % grid[0], worker // grid[0]
        by, bz = rest % grid[1], rest // grid[1]
        return slice_index, worker, (bx * block[0], by * block[1], bz * block[2])

    def _tpu_hostname(self, process_id: int) -> str:
        """TPU VM worker names: ``t1v-n-<node id>-w-<worker>``, one random node id per slice."""
        slice_index, worker, _ = self._tpu_place(process_id)
        node = random.Random(f"{self.seed}/tpu/slice/{slice_index}").getrandbits(32)
        return f"t1v-n-{node:08x}-w-{worker}"

    def _tpu_devices(self, process_id: int) -> list[LocalDevice]:
        """The chips as the jax plugin lists them: x fastest within the host's box, as JAX orders them."""
        slice_index, _, (x0, y0, z0) = self._tpu_place(process_id)
        bx, by, _ = TPU_HOST_BLOCKS[self.k]
        devices = []
        for i in range(self.k):
            coordinates = (x0 + i % bx, y0 + i // bx % by, z0 + i // (bx * by))
            devices.append(LocalDevice(i, "tpu", TPU_KIND, slice_key=str(slice_index), coordinates=coordinates,
                                       attributes={"core_on_chip": "0"},
                                       host_attributes={"local_hardware_id": str(i)}))
        return devices


def on_host(cluster: Cluster, process_id: int, per_host: int) -> tuple[Host, int]:
    """Process ``process_id`` on a host of ``per_host`` processes, and its local rank: the host's name and address
    are those of its first process (a port per rank), its devices its own. ``per_host`` 1: ``cluster.host``, rank 0."""
    rank = process_id % per_host
    own = cluster.host(process_id)
    if per_host == 1:
        return own, 0
    first = cluster.host(process_id - rank)
    ip, _, port = first.address.rpartition(":")
    return Host(first.hostname, f"{ip}:{int(port) + rank}", own.plugin, own.devices), rank


def _synthetic_address(process_id: int) -> str:
    return f"10.{process_id >> 16 & 255}.{process_id >> 8 & 255}.{process_id & 255}:{SYNTHETIC_PORT}"


def _gpu_uuid(rng: random.Random) -> str:
    """A GPU UUID as NVML prints it: GPU-8932f937-d72c-4106-c12f-20bd9faed9f6 (128 random bits)."""
    h = f"{rng.getrandbits(128):032x}"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _gpu_devices(hostname: str, count: int, rng: random.Random) -> list[LocalDevice]:
    """What plugins/cuda.py reports for ``count`` GPUs of one HGX H100 host. NVLink peers: every other GPU, the
    richest list the plugin reports (through NVSwitches it reports none)."""
    bus_ids = GPU_BUS_IDS[:count]
    return [gpu_device(i, GPU_KIND, GPU_MEMORY_BYTES, hostname, uuid=_gpu_uuid(rng), nvml_index=i, pci_bus_id=bus,
                       nvlink_peers=[b for b in bus_ids if b != bus]) for i, bus in enumerate(bus_ids)]


def _natural(key: str) -> tuple:
    """The coordinator's slice-key order ("2" before "10")."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)), key


def topology_content(cluster: Cluster) -> TopologyContent:
    """The topology the coordinator publishes for ``cluster`` (explicit process ids 0..N-1), built as it builds it."""
    hosts = [cluster.host(pid) for pid in range(cluster.n)]
    slice_keys = sorted({d.slice_key for h in hosts for d in h.devices}, key=_natural)
    slice_index = {key: i for i, key in enumerate(slice_keys)}
    processes = tuple(Process(pid, h.hostname, h.address) for pid, h in enumerate(hosts))
    devices = tuple(Device(global_device_id(pid, d.local_id), pid, d.local_id, d.platform, d.kind,
                           slice_index[d.slice_key], d.attributes, h.plugin, d.coordinates)
                    for pid, h in enumerate(hosts) for d in h.devices)
    return TopologyContent("", 1, cluster.n, processes, devices)


def measure(cluster: Cluster, repeat: int = 3) -> dict:
    """Sizes of ``cluster``'s topology (raw and as sent) and the least of ``repeat`` CPU times to encode, compress,
    decompress and decode it (CPU time: a shared machine's wall time says more about its other load)."""
    content = topology_content(cluster)
    encode_s, decode_s, compress_s, decompress_s = [], [], [], []
    for _ in range(repeat):
        t0 = time.process_time()
        canonical = wire.encode(content)
        t1 = time.process_time()
        encoding, payload = wire.compress(canonical)
        t2 = time.process_time()
        again = wire.decompress(encoding, payload)
        t3 = time.process_time()
        decoded = wire.decode(again)
        t4 = time.process_time()
        encode_s.append(t1 - t0)
        compress_s.append(t2 - t1)
        decompress_s.append(t3 - t2)
        decode_s.append(t4 - t3)
    if decoded != content:
        raise AssertionError("decode(encode(content)) differs from content")
    devices = len(content.devices)
    return {"processes": cluster.n, "devices_per_process": cluster.k, "devices": devices,
            "canonical_bytes": len(canonical), "payload_bytes": len(payload),
            "bytes_per_device_raw": round(len(canonical) / devices, 2),
            "bytes_per_device_sent": round(len(payload) / devices, 2),
            "encode_cpu_ms": round(min(encode_s) * 1e3, 1), "compress_cpu_ms": round(min(compress_s) * 1e3, 1),
            "decompress_cpu_ms": round(min(decompress_s) * 1e3, 1), "decode_cpu_ms": round(min(decode_s) * 1e3, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--processes", type=int, default=4096, help="N (default %(default)s)")
    p.add_argument("--devices", type=int, default=8, help="devices per process, K (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="encode/decode runs; the fastest is reported")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cluster = Cluster(args.content, args.processes, args.devices,
                      publish_host_attributes=args.publish_host_attributes, seed=args.seed)
    print(json.dumps({"content": describe(args), **measure(cluster, args.repeat)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
