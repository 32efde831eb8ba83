"""The ``sim`` plugin: synthetic accelerators from a spec, for tests, demos and benchmarks.

    IFRT_SIM_SPEC="kind=tpu-v5e,devices=8,slices=2,coords=2x4"

Keys (all optional): ``kind`` (default ``sim``), ``platform`` (default ``sim``), ``devices`` (default 1),
``slices`` (split the local devices into this many equal slices, in order; slice keys ``0``, ``1``, ...),
or ``slice`` (put every local device in this slice key), ``coords`` (a grid such as ``2x4`` whose size is
``devices``; device i gets the i-th grid point in row-major order), ``memory`` (bytes per device, with an
optional K, M, G or T suffix).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence

from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_LOCAL_DEVICES
from ifrt.records import LocalDevice
from plugins.base import DevicePlugin, select

SPEC_ENV = "IFRT_SIM_SPEC"
KEYS = ("kind", "platform", "devices", "slices", "slice", "coords", "memory")
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_spec(spec: str) -> dict[str, str]:
    """``"kind=tpu-v5e,devices=8"`` -> ``{"kind": "tpu-v5e", "devices": "8"}``; InvalidArgument names a bad item."""
    fields: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not value.strip():
            raise InvalidArgument(f"{SPEC_ENV}: {item!r} is not key=value")
        if key not in KEYS:
            raise InvalidArgument(f"{SPEC_ENV}: unknown key {key!r}: expected one of {', '.join(KEYS)}")
        if key in fields:
            raise InvalidArgument(f"{SPEC_ENV}: {key!r} is given twice")
        fields[key] = value.strip()
    return fields


def _count(fields: Mapping[str, str], key: str, default: int, maximum: int) -> int:
    raw = fields.get(key, str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= maximum:
        raise InvalidArgument(f"{SPEC_ENV}: {key}={raw} is not a whole number from 1 to {maximum}")
    return int(raw)


def devices_from_spec(spec: str) -> list[LocalDevice]:
    """The devices a spec describes; InvalidArgument saying which key is wrong and what it expects."""
    fields = parse_spec(spec)
    count = _count(fields, "devices", 1, MAX_LOCAL_DEVICES)
    if "slices" in fields and "slice" in fields:
        raise InvalidArgument(f"{SPEC_ENV}: give slices (split local devices) or slice (one slice for all), not both")
    slices = _count(fields, "slices", 1, count)
    if count % slices:
        raise InvalidArgument(f"{SPEC_ENV}: devices={count} do not split into slices={slices} equal slices")
    per_slice = count // slices
    grid: tuple[int, ...] = ()
    if "coords" in fields:
        if not re.fullmatch(r"\d+(x\d+)*", fields["coords"]):
            raise InvalidArgument(f"{SPEC_ENV}: coords={fields['coords']} is not a grid such as 2x4")
        grid = tuple(int(n) for n in fields["coords"].split("x"))
        if math.prod(grid) != count:
            raise InvalidArgument(f"{SPEC_ENV}: coords={fields['coords']} has {math.prod(grid)} points for "
                                  f"devices={count}: expected as many points as devices")
    attributes = {}
    if "memory" in fields:
        match = re.fullmatch(r"(\d+)([KMGT]?)", fields["memory"].upper())
        if not match:
            raise InvalidArgument(f"{SPEC_ENV}: memory={fields['memory']} is not a byte count such as 16G")
        attributes["memory_bytes"] = str(int(match[1]) * _SUFFIX[match[2]])
    kind, platform = fields.get("kind", "sim"), fields.get("platform", "sim")
    return [
        LocalDevice(i, platform, kind, slice_key=fields.get("slice", str(i // per_slice)),
                    coordinates=_unravel(i, grid), attributes=attributes)
        for i in range(count)
    ]


def _unravel(index: int, grid: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(grid):
        index, c = divmod(index, size)
        coords.append(c)
    return tuple(reversed(coords))


class SimPlugin(DevicePlugin):
    """Synthetic accelerators described by ``IFRT_SIM_SPEC``."""

    name = "sim"

    def local_devices(self, local_device_ids: Sequence[int] | None = None) -> list[LocalDevice]:
        return select(devices_from_spec(os.environ.get(SPEC_ENV, "")), local_device_ids)
