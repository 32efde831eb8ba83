"""A process's registration: the validated, plain form of a RegisterRequest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

from coordinator.core.limits import DEFAULT_LIMITS, DEVICE_BYTES, FLAGS, REGISTRATION_OVERHEAD_BYTES, Limits
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import InvalidArgument
from ifrt.hostport import check_address
from ifrt.ids import MAX_LOCAL_DEVICES
from ifrt.network import MAX_LEVELS, check_path
from ifrt.records import LocalDevice

MAX_CLIENT_UID = 128
"""Longest client uid (characters): clients send a 32-character random hex string."""
MAX_COORDINATE_RANK = 8
"""Most coordinates one device may have."""


@dataclass(frozen=True)
class Registration:
    """What one process registers. ``host_address`` is the peer IP the coordinator saw the call from."""

    client_uid: str
    cluster_id: str
    num_processes: int
    process_id: int | None
    hostname: str
    host_address: str
    local_rank: int
    address: str
    devices: tuple[LocalDevice, ...]
    plugin: str = ""
    secret_hash: str = ""
    """sha256 (hex) of the process secret the client registered with: later calls for this process must carry
    the same secret. Empty when the client sent none (then its client uid alone identifies it)."""
    attempt: int | None = None
    """The job attempt the process belongs to (None: it did not say)."""
    network: tuple[str, ...] = ()
    """Where its host sits in the network, root to leaf (``ifrt.network``; empty: no position)."""
    opens_session: bool = False
    """The process opens a session once answered: until it attaches, it counts as live (``Admission``)."""
    os_pid: int = field(default=0, compare=False)
    """Its OS pid on its host, for operators (0: not said); not part of the topology."""
    request: bytes = field(default=b"", compare=False, repr=False)
    """The RegisterRequest as received (empty when built otherwise): what the journal keeps of it."""

    @property
    def stable_key(self) -> tuple[str, str, int]:
        """What assigned process ids sort on: stable across restarts, independent of arrival order."""
        return (self.hostname, self.host_address, self.local_rank)

    def describe(self) -> str:
        """``host (ip)`` or ``host (ip) local rank r``, for logs and errors."""
        where = f"{self.hostname} ({self.host_address})" if self.host_address else self.hostname
        return where if self.process_id is not None else f"{where} local rank {self.local_rank}"

    def is_retry_of(self, other: Registration) -> bool:
        """Whether this is the same request as ``other`` (the peer address may differ between retries)."""
        return replace(self, host_address=other.host_address) == other


def _text(value: str, what: str, limit: int, *, where: str = "", required: bool = False) -> str:
    """``value`` if it is an acceptable string of at most ``limit`` bytes; the message (``where`` ``what``) is
    built only on failure."""
    if required and not value:
        raise InvalidArgument(f"{where}{what} is empty: expected a non-empty string")
    # Checked by characters first: UTF-8 needs at most 4 bytes a character, so most strings are never encoded.
    if len(value) > limit // 4 and len(value.encode()) > limit:
        raise InvalidArgument(f"{where}{what} is {len(value.encode())} bytes long: expected at most {limit} "
                              f"(the coordinator's {FLAGS['string_bytes']})")
    return value


_DeviceRow = tuple[int, str, str, str, tuple[int, ...], tuple[tuple[str, str], ...]]
_known: dict[_DeviceRow, LocalDevice] = {}
"""Devices seen before, by their fields: hosts of one cluster mostly report equal devices, so each is built (and
held in memory) once. Bounded by clearing, in devices and in the bytes of their strings (a device may carry 64
attributes of a kilobyte each); a cache, not state: what it holds never changes a registration."""
_KNOWN_MOST = 1 << 16
_KNOWN_MOST_BYTES = 8 << 20
_known_bytes = 0
_known_lists: dict[tuple[_DeviceRow, ...], tuple[Limits, tuple[LocalDevice, ...]]] = {}
"""Device lists seen before, as requests list them, with the limits they were checked under and the checked, sorted
devices: the processes of a cluster mostly list equal devices, so each list is checked once. Cleared with ``_known``
(its rows count in ``_known_bytes``)."""


def _rows(request: pb.RegisterRequest) -> list[_DeviceRow]:
    """Each device's fields as plain values: the coordinator's hot path, so empty repeated fields (the common case)
    are not copied."""
    return [(d.local_id, d.platform, d.kind, d.slice_key,
             tuple(d.coordinates) if len(d.coordinates) else (),
             tuple(sorted(d.attributes.items())) if len(d.attributes) else ())
            for d in request.devices]


def _check_device(row: _DeviceRow, index: int, limits: Limits) -> None:
    """InvalidArgument naming the device if one of its fields is out of bounds; messages are built only on failure."""
    local_id, platform, kind, slice_key, coordinates, attributes = row
    where = f"device #{index} (local id {local_id}) "
    if not 0 <= local_id < MAX_LOCAL_DEVICES:
        raise InvalidArgument(f"local device id {local_id} is out of range: expected 0 <= local_id < "
                              f"{MAX_LOCAL_DEVICES} (2**17)")
    if len(attributes) > limits.attributes_per_device:
        raise InvalidArgument(f"{where}has {len(attributes)} attributes: expected at most "
                              f"{limits.attributes_per_device} (the coordinator's {FLAGS['attributes_per_device']})")
    size = limits.string_bytes
    _text(platform, "platform", size, where=where, required=True)
    _text(kind, "kind", size, where=where)
    _text(slice_key, "slice key", size, where=where)
    for key, value in attributes:
        _text(key, "attribute key", size, where=where, required=True)
        _text(value, f"attribute {key!r}", size, where=where)
    if len(coordinates) > MAX_COORDINATE_RANK:
        raise InvalidArgument(f"{where}has {len(coordinates)} coordinates: expected at most {MAX_COORDINATE_RANK}")


def _fits(row: _DeviceRow, limits: Limits) -> bool:
    """Whether a device is surely within bounds, without building any message (the test every device takes)."""
    local_id, platform, kind, slice_key, coordinates, attributes = row
    quarter = limits.string_bytes // 4  # UTF-8 needs at most 4 bytes a character
    return (0 <= local_id < MAX_LOCAL_DEVICES and bool(platform) and len(coordinates) <= MAX_COORDINATE_RANK
            and len(platform) <= quarter and len(kind) <= quarter and len(slice_key) <= quarter
            and len(attributes) <= limits.attributes_per_device
            and all(key and len(key) <= quarter and len(value) <= quarter for key, value in attributes))


def _devices(request: pb.RegisterRequest, limits: Limits) -> tuple[LocalDevice, ...]:
    """The request's devices, checked and sorted by local id; equal devices are shared between registrations."""
    if not request.devices:
        raise InvalidArgument("a registration with no devices: expected at least 1 (a process of the topology owns "
                              "devices; a process that only uses the key-value store or barriers needs no "
                              "registration of its own)")
    if len(request.devices) > limits.devices_per_process:
        raise InvalidArgument(f"{len(request.devices)} devices in one process: expected at most "
                              f"{limits.devices_per_process} (the coordinator's {FLAGS['devices_per_process']})")
    rows = _rows(request)
    seen = _known_lists.get(key := tuple(rows))
    if seen is not None and seen[0] is limits:
        return seen[1]
    for index, row in enumerate(rows):
        if not _fits(row, limits):
            _check_device(row, index, limits)
    rows.sort()
    for a, b in pairwise(rows):
        if a[0] == b[0]:
            raise InvalidArgument(f"local device id {a[0]} is listed twice: expected distinct local ids")
    if len({len(row[4]) for row in rows}) > 1:
        raise InvalidArgument(f"devices have coordinates of ranks {sorted({len(row[4]) for row in rows})}: "
                              "expected the same number of coordinates for every device of a process")
    global _known_bytes
    if len(_known) + len(_known_lists) > _KNOWN_MOST or _known_bytes > _KNOWN_MOST_BYTES:
        _known.clear()
        _known_lists.clear()
        _known_bytes = 0
    devices = []
    for row in rows:
        device = _known.get(row)
        if device is None:
            device = _known[row] = LocalDevice(*row[:5], attributes=dict(row[5]))
            _known_bytes += _row_bytes(row)
        devices.append(device)
    _known_lists[key] = (limits, checked := tuple(devices))
    _known_bytes += sum(_row_bytes(row) for row in key)
    return checked


def _row_bytes(row: _DeviceRow) -> int:
    """About what a cached device holds: its strings, and 256 bytes for its objects."""
    _, platform, kind, slice_key, _, attributes = row
    return 256 + len(platform) + len(kind) + len(slice_key) + sum(len(k) + len(v) + 128 for k, v in attributes)


def from_request(request: pb.RegisterRequest, host_address: str, limits: Limits = DEFAULT_LIMITS,
                 secret_hash: str = "", raw: bytes = b"", *, replayed: bool = False) -> Registration:
    """The registration a request describes (``secret_hash``: the hash of the process secret its call carried;
    ``raw``: the request's bytes as received, kept for the journal); InvalidArgument (naming the value, the limit
    and the flag that raises it) if it is malformed or over one of ``limits``. Changes no state of the coordinator
    either way; equal devices are shared through this module's bounded cache of devices seen before. A ``replayed``
    request (from the journal) was admitted once: its transfer address is taken as it is, whatever this version
    checks."""
    if not request.client_uid or len(request.client_uid) > MAX_CLIENT_UID:
        long = len(request.client_uid) > MAX_CLIENT_UID
        shown = f"of {len(request.client_uid)} characters" if long else repr(request.client_uid)
        raise InvalidArgument(f"client_uid {shown} is invalid: expected 1 to {MAX_CLIENT_UID} characters")
    if request.num_processes < 0:
        raise InvalidArgument(f"num_processes {request.num_processes} is negative: expected >= 1, or 0 to accept "
                              "the coordinator's")
    if request.HasField("process_id") and request.process_id < 0:
        raise InvalidArgument(f"process id {request.process_id} is negative: expected 0 <= process_id")
    if request.local_rank < 0:
        raise InvalidArgument(f"local rank {request.local_rank} is negative: expected >= 0")
    devices = _devices(request, limits)
    hostname = _text(request.hostname, "hostname", limits.string_bytes, required=True)
    network = _network(request.network, f"the network path of {hostname}") if request.network else ()
    return Registration(
        client_uid=request.client_uid,
        cluster_id=_text(request.cluster_id, "cluster_id", limits.string_bytes),
        num_processes=request.num_processes,
        process_id=request.process_id if request.HasField("process_id") else None,
        hostname=hostname,
        host_address=host_address,
        local_rank=request.local_rank,
        address=_endpoint(_text(request.address, "address", limits.string_bytes), replayed),
        devices=devices,
        plugin=_text(request.plugin, "plugin", limits.string_bytes),
        attempt=request.attempt if request.HasField("attempt") else None,
        network=network,
        opens_session=request.opens_session,
        os_pid=request.os_pid,
        secret_hash=secret_hash,
        request=raw,
    )


def _network(levels: Sequence[str], where: str) -> tuple[str, ...]:
    """The network path a process registers (``ifrt.network.check_path``); too many levels are refused before
    their names are shown, which could be any size."""
    if len(levels) > MAX_LEVELS:
        raise InvalidArgument(f"{where} has {len(levels)} levels: expected at most {MAX_LEVELS}, from the root "
                              "(spine) to the rack")
    return check_path(levels, where)


def _endpoint(address: str, replayed: bool) -> str:
    """The transfer endpoint a process registers: empty (none), or HOST:PORT; InvalidArgument naming it if not."""
    return check_address(address, "the transfer endpoint address") if address and not replayed else address


def registration_cost(r: Registration) -> int:
    """What admitting ``r`` counts against ``--max-registration-bytes``: its request, as the journal keeps it, and
    its devices' objects."""
    return len(to_request(r)) + REGISTRATION_OVERHEAD_BYTES + DEVICE_BYTES * len(r.devices)


def to_request(r: Registration) -> bytes:
    """A serialized RegisterRequest that ``from_request`` turns back into ``r`` (with the same peer and secret)."""
    if r.request:
        return r.request
    request = pb.RegisterRequest(client_uid=r.client_uid, cluster_id=r.cluster_id, num_processes=r.num_processes,
                                 hostname=r.hostname, local_rank=r.local_rank, address=r.address, plugin=r.plugin)
    if r.process_id is not None:
        request.process_id = r.process_id
    if r.attempt is not None:
        request.attempt = r.attempt
    request.network.extend(r.network)
    request.opens_session = r.opens_session
    request.os_pid = r.os_pid
    for d in r.devices:
        wire.add_local_device(request, d)
    return request.SerializeToString()
