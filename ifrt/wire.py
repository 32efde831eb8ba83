"""The compact canonical wire form of a topology, its once-per-generation compression, and a local device as a
registration sends it.

Canonical means: the same topology always encodes to the same bytes (processes by id, devices by global id,
strings tabled in first-use order, integer columns delta and run-length coded with maximal runs), so the
sha256 of these bytes is the topology's fingerprint. The layout is columnar (see ``Topology`` in the proto):
what repeats or steps evenly from one device to the next costs almost nothing once compressed, and both
directions are vectorized, which keeps a 131,072-device topology to a fraction of a second each way.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import types
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import TopologyError
from ifrt.ids import LOCAL_ID_BITS, MAX_LOCAL_DEVICES, MAX_PROCESSES_INT64
from ifrt.network import MAX_LEVELS
from ifrt.protocol import MAX_TOPOLOGY_BYTES
from ifrt.records import Device, LocalDevice, Process, TopologyContent

FRONT_CODING_WIDTH = 64
"""Hostnames and addresses up to this many characters are front coded with numpy (longer ones in a loop)."""
COMPRESS_ABOVE = 4096
"""Topologies larger than this many bytes are sent zlib-compressed (compressed once per generation)."""
MAX_DEVICES = 1 << 24
"""Refuse to decode more devices than this: run lengths could otherwise ask for any number in a few bytes."""


def add_local_device(request: pb.RegisterRequest, device: LocalDevice, slice_key: str = "") -> None:
    """Appends ``device`` to a registration (``slice_key``: its slice where the device names none); its host
    attributes stay on its host."""
    request.devices.add(local_id=device.local_id, platform=device.platform, kind=device.kind,
                        slice_key=device.slice_key or slice_key, coordinates=device.coordinates,
                        attributes=device.attributes)


def fingerprint(canonical: bytes) -> str:
    """Hex sha256 of canonical topology bytes."""
    return hashlib.sha256(canonical).hexdigest()


class _StringTable:
    """Strings in first-use order; entry 0 is ""."""

    def __init__(self) -> None:
        self.index: dict[str | None, int] = {"": 0}

    def column(self, values: Sequence[str | None]) -> np.ndarray:
        """The index of each value (-1 for None, which is never tabled), tabling new values in order."""
        index = self.index
        for s in dict.fromkeys(values):  # C loops: a column of 131,072 values has few distinct ones
            if s is not None and s not in index:
                index[s] = len(index)
        index[None] = -1  # absent (attribute columns): never tabled
        try:
            return np.fromiter(map(index.__getitem__, values), dtype=np.int64, count=len(values))
        finally:
            del index[None]

    @property
    def strings(self) -> list[str]:
        return list(self.index)  # type: ignore[arg-type]  # dicts keep insertion order: first use


def encode(content: TopologyContent) -> bytes:
    """Canonical bytes of ``content``; raises TopologyError if it is inconsistent."""
    try:
        return _encode(content)
    except OverflowError as e:  # a Python int past int64 in a column
        raise TopologyError(f"topology holds a number out of range: {e}") from e


def _encode(content: TopologyContent) -> bytes:
    processes = sorted(content.processes, key=attrgetter("process_id"))
    pids = _ints(map(attrgetter("process_id"), processes), len(processes))
    if len(pids) and (pids[0] < 0 or pids[-1] >= MAX_PROCESSES_INT64):
        raise TopologyError(f"process ids {int(pids[0])}..{int(pids[-1])} are out of range: expected 0 <= id < "
                            f"{MAX_PROCESSES_INT64}")
    if np.any(pids[1:] == pids[:-1]):
        raise TopologyError("topology has two processes with the same process id")
    devices = sorted(content.devices, key=attrgetter("id"))
    n = len(devices)
    ids = _ints(map(attrgetter("id"), devices), n)
    owners = _ints(map(attrgetter("process_id"), devices), n)
    local_ids = _ints(map(attrgetter("local_id"), devices), n)
    _check_ids(devices, ids, owners, local_ids)
    # Devices are sorted by id, so by process id then local id: each process's devices are one run.
    position = np.searchsorted(pids, owners)
    known = pids[np.minimum(position, len(pids) - 1)] == owners if len(pids) else np.zeros(n, dtype=bool)
    if not known.all():
        raise TopologyError(f"devices belong to process ids {sorted(set(owners[~known].tolist()))} that are not in "
                            "the topology")
    counts = np.bincount(position, minlength=len(pids))
    starts = np.cumsum(counts) - counts

    table = _StringTable()
    coordinates = [d.coordinates for d in devices]
    ranks = _ints(map(len, coordinates), n)
    plugins = _per_process(table.column([d.plugin for d in devices]), starts, counts)
    process_ranks = _per_process(ranks, starts, counts)
    mixed = np.flatnonzero((plugins < 0) | (process_ranks < 0))
    if len(mixed):
        owned = devices[starts[mixed[0]]:starts[mixed[0]] + counts[mixed[0]]]
        raise TopologyError(f"process {int(pids[mixed[0]])} mixes plugins {sorted({d.plugin for d in owned})} or "
                            f"coordinate ranks {sorted({len(d.coordinates) for d in owned})}: expected one of each "
                            "per process")

    message = pb.Topology(cluster_id=content.cluster_id, generation=content.generation,
                          num_processes=content.num_processes)
    columns = message.processes
    _put(columns.process_ids, pids)
    _put_front_coded(columns.hostname_shared, columns.hostname_suffixes, [p.hostname for p in processes])
    _put_front_coded(columns.address_shared, columns.address_suffixes, [p.address for p in processes])
    _put(columns.device_counts, counts)
    _put(columns.plugins, plugins)
    _put(columns.coordinate_ranks, process_ranks)

    columns = message.devices
    _put(columns.local_ids, local_ids)
    _put(columns.platforms, table.column([d.platform for d in devices]))
    _put(columns.kinds, table.column([d.kind for d in devices]))
    slices = _ints(map(attrgetter("slice_index"), devices), n)
    _check_int32(slices, "slice index")
    _put(columns.slice_indices, slices)
    rank = int(ranks.max()) if n else 0
    if n and ranks.min() == rank:  # the common case: every device has as many coordinates
        grid = np.array(coordinates, dtype=np.int64).reshape(n, rank).T
        axes = list(grid)
    else:
        axes = [_ints((c[axis] for c in coordinates if len(c) > axis), int((ranks > axis).sum()))
                for axis in range(rank)]
    for axis in axes:
        _check_int32(axis, "coordinate")
        _put(columns.coordinates.add(), axis)
    attributes = [d.attributes for d in devices]
    keys = sorted(set().union(*attributes))
    key_indices = table.column(keys).tolist()
    for key, key_index in zip(keys, key_indices, strict=True):
        _put(columns.attributes.add(key=key_index).values, table.column([m.get(key) for m in attributes]) + 1)
    _put_network(message.processes, table, processes)
    message.strings.extend(table.strings)
    return message.SerializeToString(deterministic=True)


def _put_network(columns: pb.ProcessColumns, table: _StringTable, processes: Sequence[Process]) -> None:
    """Each process's network path: its depth, then its levels as string indices (tabled after every other string,
    so a topology without positions has the bytes it had before they existed); nothing when no process has one."""
    depths = _ints(map(len, map(attrgetter("network"), processes)), len(processes))
    if not depths.any():
        return
    if depths.max() > MAX_LEVELS:
        raise TopologyError(f"a process has a network path of {int(depths.max())} levels: expected at most "
                            f"{MAX_LEVELS}")
    levels = table.column([level for p in processes for level in p.network])
    if not levels.all():  # index 0 is ""
        raise TopologyError("a process's network path has an empty level: expected a name at every level")
    _put(columns.network_depths, depths)
    _put(columns.network_levels, levels)


def _ints(values: Iterable[int], count: int) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=count)


def _check_int32(values: np.ndarray, what: str) -> None:
    if len(values) and (values.min() < -(1 << 31) or values.max() >= 1 << 31):
        raise TopologyError(f"a {what} is out of range ({int(values.min())}..{int(values.max())}): expected a "
                            "32-bit signed integer")


def _check_ids(devices: Sequence[Device], ids: np.ndarray, owners: np.ndarray, local_ids: np.ndarray) -> None:
    bad = np.flatnonzero((owners < 0) | (owners >= MAX_PROCESSES_INT64) | (local_ids < 0)
                         | (local_ids >= MAX_LOCAL_DEVICES) | (ids != (owners << LOCAL_ID_BITS | local_ids)))
    if len(bad):
        d = devices[bad[0]]
        raise TopologyError(f"device id {d.id} is not process_id {d.process_id} << 17 | local_id {d.local_id} "
                            f"(with 0 <= local_id < {MAX_LOCAL_DEVICES})")
    twice = np.flatnonzero(ids[1:] == ids[:-1])
    if len(twice):
        raise TopologyError(f"process {devices[twice[0]].process_id} lists a local device id twice")


def _per_process(values: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each process's value of a per-device column (0 without devices, -1 where its devices differ)."""
    out = np.zeros(len(counts), dtype=np.int64)
    owning = np.flatnonzero(counts)
    if len(owning):
        first = values[starts[owning]]
        lowest = np.minimum.reduceat(values, starts[owning])
        highest = np.maximum.reduceat(values, starts[owning])
        out[owning] = np.where(lowest == highest, first, -1)
    return out


def _put(column: pb.IntColumn, values: np.ndarray) -> None:
    """Delta, then run-length: maximal runs of equal deltas; no runs when each is 1 long."""
    if not len(values):
        return
    deltas = np.diff(values, prepend=0)
    starts = np.flatnonzero(np.diff(deltas, prepend=deltas[0] - 1))
    if len(starts) == len(deltas):
        column.deltas.extend(deltas.tolist())
    else:
        column.deltas.extend(deltas[starts].tolist())
        column.runs.extend(np.diff(starts, append=len(deltas)).tolist())


def _put_front_coded(shared: pb.IntColumn, suffixes: Any, texts: Sequence[str]) -> None:
    """Each text as the characters it shares with the one before (the longest such start), then the rest."""
    lengths = _shared_starts(texts)
    suffixes.extend([text[i:] for text, i in zip(texts, lengths, strict=True)])
    _put(shared, np.array(lengths, dtype=np.int64))


def _shared_starts(texts: Sequence[str]) -> list[int]:
    """How many leading characters each text shares with the one before (0 for the first)."""
    if not texts:
        return []
    width = max(map(len, texts))
    if width > FRONT_CODING_WIDTH:  # long texts: character by character, rather than a wide array
        lengths, previous = [], ""
        for text in texts:
            i, limit = 0, min(len(text), len(previous))
            while i < limit and text[i] == previous[i]:
                i += 1
            lengths.append(i)
            previous = text
        return lengths
    # One row of code points per text, zero-padded: the first column where neighbours differ, at most the
    # shorter one's length (padding and a NUL character look alike, the lengths tell them apart).
    grid = np.array(texts, dtype=f"<U{max(width, 1)}").view(np.uint32).reshape(len(texts), -1)
    differ = grid[1:] != grid[:-1]
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
    sizes = _ints(map(len, texts), len(texts))
    return [0, *np.minimum(first, np.minimum(sizes[1:], sizes[:-1])).tolist()]


def _values(column: pb.IntColumn, count: int, what: str) -> np.ndarray:
    """The ``count`` integers of a column; ValueError naming ``what`` if it does not hold that many."""
    deltas = np.fromiter(column.deltas, dtype=np.int64, count=len(column.deltas))
    if column.runs:
        runs = np.fromiter(column.runs, dtype=np.int64, count=len(column.runs))
        if len(runs) != len(deltas) or runs.sum() != count:
            raise ValueError(f"{what} has {len(deltas)} runs of {int(runs.sum())} entries in all (with "
                             f"{len(runs)} run lengths): expected {count} entries")
        deltas = np.repeat(deltas, runs)
    elif len(deltas) != count:
        raise ValueError(f"{what} has {len(deltas)} entries: expected {count}")
    return np.cumsum(deltas)


def _indices(column: pb.IntColumn, count: int, what: str, limit: int, lowest: int = 0) -> np.ndarray:
    values = _values(column, count, what)
    if len(values) and (values.min() < lowest or values.max() >= limit):
        raise ValueError(f"{what} holds {int(values.min())}..{int(values.max())}: expected {lowest} <= value < "
                         f"{limit}")
    return values


def _front_decoded(shared: pb.IntColumn, suffixes: Sequence[str], count: int, what: str) -> list[str]:
    if len(suffixes) != count:
        raise ValueError(f"{what} has {len(suffixes)} entries: expected {count}")
    texts = []
    previous = ""
    for length, suffix in zip(_values(shared, count, what).tolist(), suffixes, strict=True):
        if not 0 <= length <= len(previous):
            raise ValueError(f"{what} shares {length} characters with a text of {len(previous)}")
        previous = previous[:length] + suffix
        texts.append(previous)
    return texts


def decode(canonical: bytes) -> TopologyContent:
    """The content of canonical topology bytes; raises TopologyError if they are malformed."""
    try:
        message = pb.Topology.FromString(canonical)
    except DecodeError as e:
        raise TopologyError(f"topology bytes do not parse: {e}") from e
    try:
        with gc_paused():
            return _decode(message)
    except (IndexError, ValueError, OverflowError) as e:
        raise TopologyError(f"topology bytes are inconsistent: {e}") from e


def _decode(message: pb.Topology) -> TopologyContent:
    strings = list(message.strings)
    if not strings or strings[0] != "":
        raise ValueError('the string table does not start with ""')
    columns = message.processes
    count = len(columns.hostname_suffixes)
    pids = _indices(columns.process_ids, count, "process_ids", MAX_PROCESSES_INT64)
    if np.any(pids[1:] <= pids[:-1]):
        raise ValueError("process ids are not strictly increasing")
    hostnames = _front_decoded(columns.hostname_shared, columns.hostname_suffixes, count, "hostnames")
    addresses = _front_decoded(columns.address_shared, columns.address_suffixes, count, "addresses")
    counts = _indices(columns.device_counts, count, "device_counts", MAX_LOCAL_DEVICES + 1)
    plugins = _indices(columns.plugins, count, "plugins", len(strings))
    ranks = _indices(columns.coordinate_ranks, count, "coordinate_ranks", len(message.devices.coordinates) + 1)
    pid_list = pids.tolist()
    networks = _networks(columns, count, strings)
    processes = tuple(Process(*p) for p in zip(pid_list, hostnames, addresses, networks, strict=True))

    columns = message.devices
    n = int(counts.sum())
    if n > MAX_DEVICES:
        raise ValueError(f"device_counts add up to {n} devices: expected at most {MAX_DEVICES}")
    local_ids = _indices(columns.local_ids, n, "local_ids", MAX_LOCAL_DEVICES)
    owners = np.repeat(pids, counts)
    ids = owners << LOCAL_ID_BITS | local_ids
    if np.any(ids[1:] <= ids[:-1]):
        raise ValueError("local ids are not strictly increasing within a process")
    platforms = _indices(columns.platforms, n, "platforms", len(strings))
    kinds = _indices(columns.kinds, n, "kinds", len(strings))
    slices = _indices(columns.slice_indices, n, "slice_indices", 1 << 31, lowest=-(1 << 31))
    device_ranks = np.repeat(ranks, counts)
    coordinates = _coordinates(columns.coordinates, device_ranks)
    attributes = _attributes(columns.attributes, n, strings)
    device_plugins = np.repeat(plugins, counts)

    # With the GC paused (see decode) and no __init__ conversions, a topology of 131,072 devices decodes several
    # times faster.
    trusted = Device.trusted
    devices = [trusted(i, p, lid, strings[pf], strings[k], s, a, strings[pl], c)
               for i, p, lid, pf, k, s, a, pl, c in zip(ids.tolist(), owners.tolist(), local_ids.tolist(),
                                                        platforms.tolist(), kinds.tolist(), slices.tolist(), attributes,
                                                        device_plugins.tolist(), coordinates, strict=True)]
    return TopologyContent(message.cluster_id, message.generation, message.num_processes, processes, tuple(devices))


def _networks(columns: pb.ProcessColumns, count: int, strings: list[str]) -> list[tuple[str, ...]]:
    """Each process's network path (all empty when the topology carries none); a level is never the empty string."""
    if not columns.network_depths.deltas:
        if columns.network_levels.deltas:
            raise ValueError("network_levels holds levels but network_depths is empty")
        return [()] * count
    depths = _indices(columns.network_depths, count, "network_depths", MAX_LEVELS + 1).tolist()
    levels = [strings[i] for i in
              _indices(columns.network_levels, sum(depths), "network_levels", len(strings), lowest=1).tolist()]
    paths, start = [], 0
    for depth in depths:
        paths.append(tuple(levels[start:start + depth]))
        start += depth
    return paths


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses the cyclic GC while a decode makes its objects: none can be garbage yet, and every collection on
    the way would walk all of them again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _coordinates(axes: Sequence[pb.IntColumn], ranks: np.ndarray) -> list[tuple[int, ...]]:
    """Each device's coordinates from the per-axis columns."""
    n = len(ranks)
    if not len(axes):
        return [()] * n
    if n and ranks.min() == ranks.max() == len(axes):
        grid = np.stack([_indices(axis, n, f"coordinates[{j}]", 1 << 31, -(1 << 31)) for j, axis in enumerate(axes)])
        return list(map(tuple, grid.T.tolist()))
    grid = np.zeros((len(axes), n), dtype=np.int64)
    for j, axis in enumerate(axes):
        having = ranks > j
        grid[j, having] = _indices(axis, int(having.sum()), f"coordinates[{j}]", 1 << 31, -(1 << 31))
    rows = grid.T.tolist()
    return [tuple(row[:rank]) for row, rank in zip(rows, ranks.tolist(), strict=True)]


_EMPTY: Mapping[str, str] = types.MappingProxyType({})


def _attributes(columns: Sequence[pb.AttributeColumn], n: int, strings: list[str]) -> list[Mapping[str, str]]:
    """Each device's attributes; devices with the same attributes share one read-only mapping."""
    if not len(columns):
        return [_EMPTY] * n
    keys = [strings[c.key] for c in columns]
    if keys != sorted(set(keys)):
        raise ValueError("attribute keys are not distinct and sorted")
    values = np.stack([_indices(c.values, n, f"attribute {key!r}", len(strings) + 1)
                       for key, c in zip(keys, columns, strict=True)], axis=1)
    # Number the distinct rows of values, vectorized: key by key, combination = combination * base + value,
    # renumbered densely whenever the next step could leave int64 (there are never more than n distinct rows).
    base = len(strings) + 1
    combination = np.zeros(n, dtype=np.int64)
    bound = 1
    for column in values.T:
        if bound > (1 << 62) // base:
            combination = np.unique(combination, return_inverse=True)[1].reshape(-1)
            bound = n
        combination = combination * base + column
        bound *= base
    _, first, which = np.unique(combination, return_index=True, return_inverse=True)
    mappings = [types.MappingProxyType({key: strings[v - 1] for key, v in zip(keys, row, strict=True) if v})
                for row in values[first].tolist()]
    return [mappings[i] for i in which.reshape(-1).tolist()]


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
