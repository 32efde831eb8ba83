"""A process's registration: the validated, plain form of a RegisterRequest."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_LOCAL_DEVICES
from ifrt.records import LocalDevice

MAX_STRING = 1024
"""Longest hostname, address, platform, kind, attribute key or value accepted (bytes of UTF-8 text)."""
MAX_ATTRIBUTES = 64
"""Most attributes one device may carry."""
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


def _text(value: str, what: str, *, where: str = "", required: bool = False) -> str:
    """``value`` if it is an acceptable string; the message (``where`` ``what``) is built only on failure."""
    if required and not value:
        raise InvalidArgument(f"{where}{what} is empty: expected a non-empty string")
    # Checked by characters first: UTF-8 needs at most 4 bytes a character, so most strings are never encoded.
    if len(value) > MAX_STRING // 4 and len(value.encode()) > MAX_STRING:
        raise InvalidArgument(f"{where}{what} is {len(value.encode())} bytes long: expected at most {MAX_STRING}")
    return value


def _device(d: pb.LocalDevice, index: int) -> LocalDevice:
    """One checked device; runs for every device of every registration, so it formats messages only on failure."""
    if not 0 <= d.local_id < MAX_LOCAL_DEVICES:
        raise InvalidArgument(f"local device id {d.local_id} is out of range: expected 0 <= local_id < "
                              f"{MAX_LOCAL_DEVICES} (2**17)")
    where = f"device #{index} (local id {d.local_id}) "
    if len(d.attributes) > MAX_ATTRIBUTES:
        raise InvalidArgument(f"{where}has {len(d.attributes)} attributes: expected at most {MAX_ATTRIBUTES}")
    for key, value in d.attributes.items():
        _text(key, "attribute key", where=where, required=True)
        _text(value, f"attribute {key!r}", where=where)
    if len(d.coordinates) > MAX_COORDINATE_RANK:
        raise InvalidArgument(f"{where}has {len(d.coordinates)} coordinates: expected at most {MAX_COORDINATE_RANK}")
    return LocalDevice(d.local_id, _text(d.platform, "platform", where=where, required=True),
                       _text(d.kind, "kind", where=where), _text(d.slice_key, "slice key", where=where),
                       tuple(d.coordinates), dict(d.attributes))


def from_request(request: pb.RegisterRequest, host_address: str) -> Registration:
    """The registration a request describes; InvalidArgument (naming value and limit) if it is malformed."""
    if not request.client_uid or len(request.client_uid) > 128:
        raise InvalidArgument(f"client_uid {request.client_uid!r} is invalid: expected 1 to 128 characters")
    if request.num_processes < 0:
        raise InvalidArgument(f"num_processes {request.num_processes} is negative: expected >= 1, or 0 to accept "
                              "the coordinator's")
    if request.HasField("process_id") and request.process_id < 0:
        raise InvalidArgument(f"process id {request.process_id} is negative: expected 0 <= process_id")
    if request.local_rank < 0:
        raise InvalidArgument(f"local rank {request.local_rank} is negative: expected >= 0")
    if len(request.devices) > MAX_LOCAL_DEVICES:
        raise InvalidArgument(f"{len(request.devices)} devices in one process: expected at most {MAX_LOCAL_DEVICES}")
    devices = tuple(sorted((_device(d, i) for i, d in enumerate(request.devices)), key=lambda d: d.local_id))
    for a, b in pairwise(devices):
        if a.local_id == b.local_id:
            raise InvalidArgument(f"local device id {a.local_id} is listed twice: expected distinct local ids")
    if len({len(d.coordinates) for d in devices}) > 1:
        raise InvalidArgument(f"devices have coordinates of ranks {sorted({len(d.coordinates) for d in devices})}: "
                              "expected the same number of coordinates for every device of a process")
    return Registration(
        client_uid=request.client_uid,
        cluster_id=_text(request.cluster_id, "cluster_id"),
        num_processes=request.num_processes,
        process_id=request.process_id if request.HasField("process_id") else None,
        hostname=_text(request.hostname, "hostname", required=True),
        host_address=host_address,
        local_rank=request.local_rank,
        address=_text(request.address, "address"),
        devices=devices,
        plugin=_text(request.plugin, "plugin"),
    )
