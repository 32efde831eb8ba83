"""The compact canonical wire form of a topology, and its once-per-generation compression.

Canonical means: the same topology always encodes to the same bytes (processes by id, devices by local
id, strings tabled in first-use order), so the sha256 of these bytes is the topology's fingerprint.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from itertools import groupby

from google.protobuf.message import DecodeError

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import TopologyError
from ifrt.ids import MAX_PROCESSES_INT64, global_device_id
from ifrt.records import Device, Process

COMPRESS_ABOVE = 4096
"""Topologies larger than this many bytes are sent zlib-compressed (compressed once per generation)."""
MAX_TOPOLOGY_BYTES = 1 << 30
"""Refuse to inflate a compressed topology past this size."""


@dataclass(frozen=True)
class TopologyContent:
    """Everything the canonical bytes encode (what every process of one generation shares)."""

    cluster_id: str
    generation: int
    num_processes: int
    processes: tuple[Process, ...]
    devices: tuple[Device, ...]


def fingerprint(canonical: bytes) -> str:
    """Hex sha256 of canonical topology bytes."""
    return hashlib.sha256(canonical).hexdigest()


class _StringTable:
    def __init__(self) -> None:
        self.strings: list[str] = [""]
        self._index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        i = self._index.get(s)
        if i is None:
            i = self._index[s] = len(self.strings)
            self.strings.append(s)
        return i


def encode(content: TopologyContent) -> bytes:
    """Canonical bytes of ``content``; raises TopologyError if it is inconsistent."""
    processes = sorted(content.processes, key=lambda p: p.process_id)
    if len({p.process_id for p in processes}) != len(processes):
        raise TopologyError("topology has two processes with the same process id")
    devices = sorted(content.devices, key=lambda d: d.id)
    by_process = {pid: list(ds) for pid, ds in groupby(devices, key=lambda d: d.process_id)}
    unknown = set(by_process) - {p.process_id for p in processes}
    if unknown:
        raise TopologyError(f"devices belong to process ids {sorted(unknown)} that are not in the topology")
    table = _StringTable()
    message = pb.Topology(cluster_id=content.cluster_id, generation=content.generation,
                          num_processes=content.num_processes)
    for process in processes:
        entry = message.processes.add(process_id=process.process_id, hostname=process.hostname,
                                      address=process.address)
        owned = by_process.get(process.process_id, [])
        plugins = {d.plugin for d in owned}
        ranks = {len(d.coordinates) for d in owned}
        if len(plugins) > 1 or len(ranks) > 1:
            raise TopologyError(f"process {process.process_id} mixes plugins {sorted(plugins)} or coordinate ranks "
                                f"{sorted(ranks)}: expected one of each per process")
        entry.plugin = table(plugins.pop() if plugins else "")
        entry.coordinate_rank = ranks.pop() if ranks else 0
        for index, device in enumerate(owned):
            if device.id != global_device_id(device.process_id, device.local_id, MAX_PROCESSES_INT64):
                raise TopologyError(f"device id {device.id} is not process_id {device.process_id} << 17 | "
                                    f"local_id {device.local_id}")
            entry.local_ids.append(device.local_id)
            entry.platforms.append(table(device.platform))
            entry.kinds.append(table(device.kind))
            entry.slice_indices.append(device.slice_index)
            entry.coordinates.extend(device.coordinates)
            for key, value in sorted(device.attributes.items()):
                entry.attributes.add(device=index, key=table(key), value=table(value))
        if len(set(entry.local_ids)) != len(entry.local_ids):
            raise TopologyError(f"process {process.process_id} lists a local device id twice")
    message.strings.extend(table.strings)
    return message.SerializeToString(deterministic=True)


def decode(canonical: bytes) -> TopologyContent:
    """The content of canonical topology bytes; raises TopologyError if they are malformed."""
    try:
        message = pb.Topology.FromString(canonical)
    except DecodeError as e:
        raise TopologyError(f"topology bytes do not parse: {e}") from e
    strings = message.strings
    try:
        processes = tuple(Process(e.process_id, e.hostname, e.address) for e in message.processes)
        devices: list[Device] = []
        for entry in message.processes:
            attributes: list[dict[str, str]] = [{} for _ in entry.local_ids]
            for a in entry.attributes:
                attributes[a.device][strings[a.key]] = strings[a.value]
            rank, plugin = entry.coordinate_rank, strings[entry.plugin]
            if len(entry.coordinates) != rank * len(entry.local_ids):
                raise ValueError(f"process {entry.process_id} has {len(entry.coordinates)} coordinates for "
                                 f"{len(entry.local_ids)} devices of rank {rank}")
            for i, (local_id, platform, kind, slice_index, attrs) in enumerate(zip(
                entry.local_ids, entry.platforms, entry.kinds, entry.slice_indices, attributes, strict=True
            )):
                devices.append(Device(global_device_id(entry.process_id, local_id, MAX_PROCESSES_INT64),
                                      entry.process_id, local_id, strings[platform], strings[kind],
                                      slice_index, attrs, plugin, tuple(entry.coordinates[i * rank:(i + 1) * rank])))
    except (IndexError, ValueError) as e:
        raise TopologyError(f"topology bytes are inconsistent: {e}") from e
    return TopologyContent(message.cluster_id, message.generation, message.num_processes, processes,
                           tuple(sorted(devices, key=lambda d: d.id)))


def compress(canonical: bytes) -> tuple[int, bytes]:
    """(encoding, payload) to send for ``canonical``: zlib above COMPRESS_ABOVE bytes, raw below."""
    if len(canonical) <= COMPRESS_ABOVE:
        return pb.ENCODING_RAW, canonical
    return pb.ENCODING_ZLIB, zlib.compress(canonical, 6)


def decompress(encoding: int, payload: bytes) -> bytes:
    """The canonical bytes of a received payload; refuses unknown encodings and oversized inflation."""
    if encoding == pb.ENCODING_RAW:
        return payload
    if encoding != pb.ENCODING_ZLIB:
        raise TopologyError(f"unknown topology encoding {encoding}: expected RAW (0) or ZLIB (1)")
    inflater = zlib.decompressobj()
    try:
        canonical = inflater.decompress(payload, MAX_TOPOLOGY_BYTES)
    except zlib.error as e:
        raise TopologyError(f"compressed topology is corrupt: {e}") from e
    if inflater.unconsumed_tail or not inflater.eof:
        raise TopologyError(f"compressed topology is truncated or inflates past {MAX_TOPOLOGY_BYTES} bytes")
    return canonical

