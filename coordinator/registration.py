"""A process's registration: the validated, plain form of a RegisterRequest."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

from coordinator.limits import DEFAULT_LIMITS, FLAGS, Limits
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_LOCAL_DEVICES
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


def _device(d: pb.LocalDevice, index: int, limits: Limits) -> LocalDevice:
    """One checked device; runs for every device of every registration, so it formats messages only on failure."""
    if not 0 <= d.local_id < MAX_LOCAL_DEVICES:
        raise InvalidArgument(f"local device id {d.local_id} is out of range: expected 0 <= local_id < "
                              f"{MAX_LOCAL_DEVICES} (2**17)")
    where = f"device #{index} (local id {d.local_id}) "
    if len(d.attributes) > limits.attributes_per_device:
        raise InvalidArgument(f"{where}has {len(d.attributes)} attributes: expected at most "
                              f"{limits.attributes_per_device} (the coordinator's {FLAGS['attributes_per_device']})")
    size = limits.string_bytes
    for key, value in d.attributes.items():
        _text(key, "attribute key", size, where=where, required=True)
        _text(value, f"attribute {key!r}", size, where=where)
    if len(d.coordinates) > MAX_COORDINATE_RANK:
        raise InvalidArgument(f"{where}has {len(d.coordinates)} coordinates: expected at most {MAX_COORDINATE_RANK}")
    return LocalDevice(d.local_id, _text(d.platform, "platform", size, where=where, required=True),
                       _text(d.kind, "kind", size, where=where), _text(d.slice_key, "slice key", size, where=where),
                       tuple(d.coordinates), dict(d.attributes))


def from_request(request: pb.RegisterRequest, host_address: str, limits: Limits = DEFAULT_LIMITS,
                 secret_hash: str = "") -> Registration:
    """The registration a request describes (``secret_hash``: the hash of the process secret its call carried);
    InvalidArgument (naming the value, the limit and the flag that raises it) if it is malformed or over one of
    ``limits``. Pure: nothing is changed either way."""
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
    if len(request.devices) > limits.devices_per_process:
        raise InvalidArgument(f"{len(request.devices)} devices in one process: expected at most "
                              f"{limits.devices_per_process} (the coordinator's {FLAGS['devices_per_process']})")
    devices = tuple(sorted((_device(d, i, limits) for i, d in enumerate(request.devices)), key=lambda d: d.local_id))
    for a, b in pairwise(devices):
        if a.local_id == b.local_id:
            raise InvalidArgument(f"local device id {a.local_id} is listed twice: expected distinct local ids")
    if len({len(d.coordinates) for d in devices}) > 1:
        raise InvalidArgument(f"devices have coordinates of ranks {sorted({len(d.coordinates) for d in devices})}: "
                              "expected the same number of coordinates for every device of a process")
    return Registration(
        client_uid=request.client_uid,
        cluster_id=_text(request.cluster_id, "cluster_id", limits.string_bytes),
        num_processes=request.num_processes,
        process_id=request.process_id if request.HasField("process_id") else None,
        hostname=_text(request.hostname, "hostname", limits.string_bytes, required=True),
        host_address=host_address,
        local_rank=request.local_rank,
        address=_text(request.address, "address", limits.string_bytes),
        devices=devices,
        plugin=_text(request.plugin, "plugin", limits.string_bytes),
        attempt=request.attempt if request.HasField("attempt") else None,
        secret_hash=secret_hash,
    )
