"""Device meshes over a topology: named axes, submeshes, tile assignments, argument selection.

A mesh is a numpy array of global device ids with named axes. A submesh is a view of part of its parent
(it keeps the positions it came from), so the same code serves a zero-indexed submesh (devices 0, 1 of
4) and a non-zero-indexed one (devices 2, 3 of 4).

Tile assignments come in two forms, as compilers and runtimes need them:

- normalized: positions ``0..n-1`` into a device list (what a compiler sees);
- denormalized: the real global ids (what execution uses).

    >>> ta, device_list = normalize(np.array([[131073, 131072], [1, 0]]))
    >>> ta.tolist(), device_list.tolist()
    ([[3, 2], [1, 0]], [0, 1, 131072, 131073])
    >>> denormalize(ta, device_list).tolist()
    [[131073, 131072], [1, 0]]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ifrt.network import natural_key, path_key
from ifrt.records import Device


class DeviceSet(Protocol):
    """What a mesh needs of the topology it is built over (``ifrt.Topology`` is one)."""

    @property
    def generation(self) -> int: ...

    @property
    def global_ids(self) -> np.ndarray: ...

    def device(self, global_id: int) -> Device: ...


def normalize(device_assignment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tile assignment of positions, sorted device list) for an array of distinct global ids."""
    ids = np.asarray(device_assignment, dtype=np.int64)
    device_list = np.unique(ids)
    if device_list.size != ids.size:
        values, counts = np.unique(ids, return_counts=True)
        raise ValueError(f"device assignment repeats global ids {values[counts > 1].tolist()}: expected distinct ids")
    return np.searchsorted(device_list, ids).astype(np.int64), device_list


def denormalize(tile_assignment: np.ndarray, device_list: Sequence[int] | np.ndarray) -> np.ndarray:
    """The global ids a normalized tile assignment stands for, given its device list."""
    positions = np.asarray(tile_assignment, dtype=np.int64)
    devices = np.asarray(device_list, dtype=np.int64)
    if positions.size and (positions.min() < 0 or positions.max() >= devices.size):
        raise ValueError(f"tile assignment refers to positions {positions.min()}..{positions.max()}: expected "
                         f"0..{devices.size - 1} (a device list of {devices.size})")
    if np.unique(positions).size != positions.size:
        raise ValueError("tile assignment repeats a position: expected each device once")
    return devices[positions]


def topology_order(devices: Iterable[Device], hostnames: Mapping[int, str] | None = None,
                   networks: Mapping[int, Sequence[str]] | None = None) -> list[Device]:
    """Devices ordered so one process's (then one host's, one slice's, one rack's, one block's) devices are adjacent,
    in ring order: by network path (level by level, ``ifrt.network.path_key``), slice, hostname in natural order
    (``node2`` before ``node10``), process, then ring order over coordinates and local id. Process ids only break
    ties: a launcher's explicit ids need not follow the network, the mesh still does."""
    hostnames = hostnames or {}
    networks = networks or {}
    paths = {pid: path_key(path) for pid, path in networks.items()}
    names = {pid: natural_key(name) for pid, name in hostnames.items()}

    def key(d: Device) -> tuple:
        return (paths.get(d.process_id, ()), d.slice_index, names.get(d.process_id, ()), d.process_id,
                _snake(d.coordinates), d.local_id)

    return sorted(devices, key=key)


def packed(units: Sequence[int], paths: Mapping[int, Sequence[str]], group: int) -> list[int]:
    """``units`` (processes in network order) reordered so that as many runs of ``group`` consecutive units as
    possible lie inside one rack, then one block, ...: in each domain its whole runs come first, and what is left
    over of its subdomains (the tail of each, fewer than ``group``) is gathered after them to make runs that cross
    subdomains but stay inside this domain. Where racks hold multiples of ``group`` it changes nothing."""
    if group < 2:
        return list(units)

    def pack(members: list[int], depth: int) -> tuple[list[int], list[int]]:
        children: dict[object, list[int]] = {}
        for u in members:  # members are in network order: each subdomain is one run of them
            path = paths.get(u, ())
            children.setdefault(path[depth] if len(path) > depth else None, []).append(u)
        if list(children) == [None]:  # the leaf: this rack's own units
            whole = len(members) - len(members) % group
            return members[:whole], members[whole:]
        aligned: list[int] = []
        left: list[int] = []
        for child in children.values():
            a, rest = pack(child, depth + 1)
            aligned += a
            left += rest
        whole = len(left) - len(left) % group
        return aligned + left[:whole], left[whole:]

    aligned, left = pack(list(units), 0)
    return aligned + left


def _snake(coordinates: Sequence[int]) -> tuple[int, ...]:
    """Boustrophedon order over coordinates: consecutive devices are physical neighbours (a ring per row)."""
    if len(coordinates) < 2:
        return tuple(coordinates)
    *outer, inner = coordinates
    flip = sum(outer) % 2 == 1
    return (*outer, -inner if flip else inner)


@dataclass(frozen=True)
class VirtualDevice:
    """A whole mesh presented as one device (for runtimes that show SPMD as a single device)."""

    mesh: Mesh

    @property
    def members(self) -> tuple[Device, ...]:
        return self.mesh.device_records()

    @property
    def platform(self) -> str:
        platforms = {d.platform for d in self.members}
        return platforms.pop() if len(platforms) == 1 else "mixed"

    @property
    def kind(self) -> str:
        return f"spmd[{'x'.join(map(str, self.mesh.shape))}]"


class Mesh:
    """Global device ids in an n-d array with named axes; ``parent`` and ``positions`` are set for a submesh."""

    def __init__(self, devices: np.ndarray, axis_names: Sequence[str], topology: DeviceSet | None = None, *,
                 parent: Mesh | None = None, positions: np.ndarray | None = None) -> None:
        devices = np.asarray(devices, dtype=np.int64)
        if devices.ndim != len(axis_names):
            raise ValueError(f"mesh of shape {devices.shape} needs {devices.ndim} axis names, got {list(axis_names)}")
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"axis names {list(axis_names)} repeat: expected distinct names")
        normalize(devices)  # distinct ids
        if topology is not None:
            unknown = set(devices.flat) - set(topology.global_ids.tolist())
            if unknown:
                raise ValueError(f"global ids {sorted(unknown)[:8]} are not in topology generation "
                                 f"{topology.generation}")
        self._devices = devices
        self._devices.flags.writeable = False
        self.axis_names = tuple(axis_names)
        self.topology = topology
        self.parent = parent
        self._positions = positions

    @property
    def devices(self) -> np.ndarray:
        """The global ids, shaped like the mesh (read-only)."""
        return self._devices

    @property
    def shape(self) -> tuple[int, ...]:
        return self._devices.shape

    @property
    def size(self) -> int:
        return self._devices.size

    @property
    def ndim(self) -> int:
        return self._devices.ndim

    def device_records(self) -> tuple[Device, ...]:
        """The topology's Device records, in mesh order (flattened)."""
        if self.topology is None:
            raise ValueError("this mesh was built without a topology: it has ids but no device records")
        return tuple(self.topology.device(int(i)) for i in self._devices.flat)

    @property
    def positions(self) -> np.ndarray:
        """Where each device sits in the parent's flattened device order (0..size-1 for a root mesh)."""
        if self._positions is None:
            return np.arange(self.size, dtype=np.int64).reshape(self.shape)
        return self._positions

    # Submeshes.
    def submesh(self, offset: Sequence[int] | None = None, shape: Sequence[int] | None = None, *,
                devices: Sequence[int] | None = None) -> Mesh:
        """A view of a block (``offset``, ``shape``) or of the given global ids (1-d, in the order given)."""
        if devices is not None:
            if offset is not None or shape is not None:
                raise ValueError("pass either offset and shape, or devices")
            flat = self._devices.reshape(-1)
            where = {int(d): i for i, d in enumerate(flat)}
            missing = [int(d) for d in devices if int(d) not in where]
            if missing:
                raise ValueError(f"global ids {missing} are not in this mesh (ids {flat.tolist()[:16]}...)")
            picked = np.array([where[int(d)] for d in devices], dtype=np.int64)
            return Mesh(flat[picked], (self.axis_names[-1],), self.topology, parent=self,
                        positions=self.positions.reshape(-1)[picked])
        if offset is None or shape is None:
            raise ValueError("a block submesh needs both offset and shape")
        if len(offset) != self._devices.ndim or len(shape) != self._devices.ndim:
            raise ValueError(f"offset {list(offset)} and shape {list(shape)} need {self._devices.ndim} entries")
        for axis, (o, n, full) in enumerate(zip(offset, shape, self.shape, strict=True)):
            if o < 0 or n < 1 or o + n > full:
                raise ValueError(f"axis {self.axis_names[axis]!r}: offset {o} + size {n} does not fit in {full}")
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        return Mesh(self._devices[index], self.axis_names, self.topology, parent=self,
                    positions=self.positions[index])

    # Tile assignments.
    def device_assignment(self) -> np.ndarray:
        """The denormalized tile assignment: the real global ids (what execution uses)."""
        return self._devices

    def device_list(self) -> np.ndarray:
        """The sorted global ids that ``tile_assignment`` positions refer to."""
        return normalize(self._devices)[1]

    def tile_assignment(self) -> np.ndarray:
        """The normalized tile assignment: positions 0..size-1 into ``device_list()`` (what a compiler sees)."""
        return normalize(self._devices)[0]

    # Arguments.
    def select_arguments(self, handles: Sequence[Any]) -> list[Any]:
        """From per-device buffers laid out over the root mesh's devices (None where missing), the ones this
        mesh's devices need, in this mesh's order."""
        root = self
        while root.parent is not None:
            root = root.parent
        if len(handles) != root.size:
            raise ValueError(f"{len(handles)} handles for a mesh of {root.size} devices: expected one per device "
                             "(None where a device has no buffer)")
        selected = []
        # positions are relative to the root mesh: a submesh of a submesh composes them
        for position, device in zip(self.positions.reshape(-1), self._devices.reshape(-1), strict=True):
            handle = handles[int(position)]
            if handle is None:
                raise ValueError(f"no buffer for global device {int(device)} (position {int(position)} of the "
                                 f"parent mesh), which this {'sub' if self.parent else ''}mesh needs")
            selected.append(handle)
        return selected

    @property
    def virtual_device(self) -> VirtualDevice:
        """This mesh as one SPMD device, its members reachable from it."""
        return VirtualDevice(self)

    def describe(self) -> str:
        """Which level of the network each axis's rings stay within or cross, one line an axis, in words a person
        can act on (see ``describe_axes``)."""
        return "\n".join(describe_axes(self))

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        return f"Mesh({axes}{', submesh' if self.parent else ''})"


# Where a mesh's axes sit in the network.
LEAF_NAME = "leaf switch"
"""What the leaf level of a network path (the switch the host hangs off) is called in messages; the levels above
are ``tier-N switch``, N counted from the leaf (tier 0) as topograph numbers ``fabric.topograph.run/tier-N``. The
names are neutral: the topology does not say which source (topograph, AWS, GCE, OCI, Slurm) gave a path."""


@dataclass(frozen=True)
class Domains:
    """The domains each device of a mesh belongs to, from the smallest (the host) to the largest (the whole job):
    ``keys[level][i]`` names the domain of level ``names[level]`` that flat device ``i`` is in."""

    names: tuple[str, ...]
    keys: tuple[tuple[str, ...], ...]


def level_name(from_leaf: int) -> str:
    """The name of a level of a network path, counted from the leaf: ``leaf switch``, then ``tier-1 switch``,
    ``tier-2 switch``, ..."""
    return LEAF_NAME if from_leaf == 0 else f"tier-{from_leaf} switch"


def domains(mesh: Mesh) -> Domains:
    """The host, NVLink domain (a slice over several hosts), and network domains of every device of ``mesh``."""
    topology = mesh.topology
    if topology is None or not hasattr(topology, "process"):
        raise ValueError("this mesh was built without a topology: it cannot say where its devices sit")
    records = mesh.device_records()
    processes = {pid: topology.process(pid) for pid in {d.process_id for d in records}}
    paths = [tuple(processes[d.process_id].network) for d in records]
    # a host is named inside its leaf: nested domains, even where processes of one machine claim different leaves
    hosts = tuple("/".join((*path, processes[d.process_id].hostname or f"process {d.process_id}"))
                  for path, d in zip(paths, records, strict=True))
    names, keys = ["host"], [hosts]
    slices = tuple("/".join((*p, f"slice {d.slice_index}")) for p, d in zip(paths, records, strict=True))
    leaves = len({tuple(p) for p in paths})
    if leaves < len(set(slices)) < len(set(hosts)):  # slices span hosts (NVLink domains), several to a leaf
        names.append("NVLink domain")
        keys.append(slices)
    depth = max(map(len, paths), default=0)
    for up in range(depth):
        names.append(level_name(up))
        keys.append(tuple("/".join(p[:max(len(p) - up, 0)]) for p in paths))
    return Domains(tuple(names), tuple(keys))


def ring_links(mesh: Mesh, axis: int, level_keys: Sequence[str]) -> tuple[int, int]:
    """(links of ``axis``'s rings that join two domains of one level, rings with at least one such link): a ring
    of n devices has n links (one for n = 2)."""
    positions = np.arange(mesh.size).reshape(mesh.shape)
    rings = np.moveaxis(positions, axis, -1).reshape(-1, mesh.shape[axis])
    keys = np.asarray(level_keys, dtype=object)[rings]
    n = mesh.shape[axis]
    if n < 2:
        return 0, 0
    crossing = keys[:, 1:] != keys[:, :-1]
    if n > 2:
        crossing = np.concatenate([crossing, (keys[:, :1] != keys[:, -1:])], axis=1)
    per_ring = crossing.sum(axis=1)
    return int(per_ring.sum()), int((per_ring > 0).sum())


def describe_axes(mesh: Mesh) -> list[str]:
    """One line per axis: the smallest domain (host, NVLink domain, leaf switch, tier-1 switch, ...) each of its
    rings stays within, or which level it crosses, in how many of its rings, which domains hold how many of one
    such ring's devices, and what size would keep it inside."""
    found = domains(mesh)
    lines = []
    for axis, (name, n) in enumerate(zip(mesh.axis_names, mesh.shape, strict=True)):
        counts = [ring_links(mesh, axis, keys) for keys in found.keys]
        inside = next((level for level, (links, _) in enumerate(counts) if links == 0), None)
        head = f"axis {name!r} ({n})"
        if inside == 0:
            lines.append(f"{head} stays within each host")
            continue
        crossed = (len(counts) if inside is None else inside) - 1  # the largest level some ring crosses
        links, rings = counts[crossed]
        total = mesh.size // n
        level = found.names[crossed]
        whole = inside is None or len(set(found.keys[inside])) == 1
        where = "spans the whole job" if whole else f"stays within each {found.names[inside]}"
        if rings == total:
            lines.append(f"{head} crosses {_plural(level)} in every ring ({links} links), {where}")
            continue
        parts = [f"{_plural(found.names[lv])} in {counts[lv][1]}" for lv in range(1, crossed + 1) if counts[lv][1]]
        parts[0] += f" of its {total} rings"
        lines.append(f"{head} crosses {' and '.join(parts)} ({links} links across {_plural(level)}), {where}: "
                     f"{_example(mesh, axis, found.keys[crossed], level)}; {_advice(mesh, axis, found, crossed)}")
    return lines


def _plural(level: str) -> str:
    return level + ("es" if level.endswith("h") else "s")


def _example(mesh: Mesh, axis: int, keys: Sequence[str], level: str) -> str:
    """Which domains hold how many devices of the first ring that crosses ``level``."""
    positions = np.moveaxis(np.arange(mesh.size).reshape(mesh.shape), axis, -1).reshape(-1, mesh.shape[axis])
    for ring in positions:
        held: dict[str, int] = {}
        for p in ring:
            held[keys[int(p)]] = held.get(keys[int(p)], 0) + 1
        if len(held) > 1:
            parts = [f"{level} {k!r} holds {c}" for k, c in held.items()]
            return f"{parts[0]} of its devices, " + ", ".join(parts[1:])
    return ""


def _advice(mesh: Mesh, axis: int, found: Domains, level: int) -> str:
    """What would keep the axis inside ``level``: the devices each domain of it holds, and the span that divides
    them all."""
    sizes: dict[str, int] = {}
    for k in found.keys[level]:
        sizes[k] = sizes.get(k, 0) + 1
    low, high = min(sizes.values()), max(sizes.values())
    common = int(np.gcd.reduce(list(sizes.values())))
    span = int(np.prod(mesh.shape[axis:]))
    name = found.names[level]
    held = f"{_plural(name)} hold {low} to {high} devices" if low != high else f"each {name} holds {low} devices"
    inner = " and the axes inside it" if axis < mesh.ndim - 1 else ""
    return (f"{held}: the axis{inner} span {span} devices; a span that divides {common} keeps every ring within "
            f"its {name} (or give the {_plural(name)} equal numbers of hosts)")


def network_lines(topology: Any, shape: Sequence[int] | None = None,
                  axis_names: Sequence[str] | None = None) -> list[str]:
    """What ``ifrt discover`` prints about the network (``topology`` is an ``ifrt.Topology``): the hosts without a
    position and paths of mixed depth where there are any, how many domains of each level there are and how many
    devices they hold, the largest axis that stays within each, and, given a mesh shape, ``describe_axes`` of
    ``topology.mesh(shape, axis_names)``. Empty where no process has a position."""
    processes = topology.processes
    if not any(p.network for p in processes):
        return [] if shape is None else describe_axes(topology.mesh(shape, _axis_names(shape, axis_names)))
    devices: dict[int, int] = {}
    for d in topology.devices:
        devices[d.process_id] = devices.get(d.process_id, 0) + 1
    depth = max(len(p.network) for p in processes)
    lines = _unplaced(processes)
    for up in range(depth):
        held: dict[tuple[str, ...], int] = {}
        for p in processes:
            key = tuple(p.network[:max(len(p.network) - up, 0)])
            held[key] = held.get(key, 0) + devices.get(p.process_id, 0)
        name, low, high = level_name(up), min(held.values()), max(held.values())
        sizes = f"{low} devices each" if low == high else f"{low} to {high} devices"
        lines.append(f"{len(held)} {_plural(name) if len(held) != 1 else name} of {sizes}: a mesh's inner axes "
                     f"stay within each {name} where together they span a divisor of "
                     f"{int(np.gcd.reduce(list(held.values())))} devices")
    if shape is not None:
        lines += describe_axes(topology.mesh(shape, _axis_names(shape, axis_names)))
    return lines


def _unplaced(processes: Sequence[Any], listed: int = 8) -> list[str]:
    """A line naming the hosts without a network position where others have one (they sort first, taking the lowest
    ids), and one where paths have different depths (compared root first, level by level)."""
    lines = []
    without = list(dict.fromkeys(p.hostname or f"process {p.process_id}" for p in processes if not p.network))
    if without:
        names = ", ".join(without[:listed]) + (f" and {len(without) - listed} more" if len(without) > listed else "")
        lines.append(f"{len(without)} {'host has' if len(without) == 1 else 'hosts have'} no network position "
                     f"({names}): they sort before every placed host and take the lowest ids; give them "
                     "IFRT_NETWORK_NODES or IFRT_NODE_LABELS_FILE as the others have (docs/discovery.md)")
    depths = sorted({len(p.network) for p in processes if p.network})
    if len(depths) > 1:
        lines.append(f"network paths of mixed depth ({depths[0]} to {depths[-1]} levels): they are compared root "
                     "first, level by level, so their order is only as good as their names are comparable; give "
                     "every host the same source")
    return lines


def _axis_names(shape: Sequence[int], axis_names: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(axis_names) if axis_names is not None else tuple(f"axis{i}" for i in range(len(shape)))
