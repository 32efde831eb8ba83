"""A decided replacement's devices: the process that takes over a replaced id (``ifrt run --recover replace``, a
warm spare or a cold start) must bring the devices of the process it replaces, or the survivors' groups would re-form
over another machine than the one they were built for. A plain restart with other devices is not checked here: it
publishes a new generation (``ifrt.events.TopologyChanged``)."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core.limits import shown
from coordinator.core.registration import Registration
from ifrt.errors import ClusterMismatch
from ifrt.records import LocalDevice

DEVICES_SHOWN = 8
"""Device kinds a message names before it says how many more there are."""


def device_shape(devices: Sequence[LocalDevice]) -> tuple[tuple[str, str], ...]:
    """What a replacement must match: each device's platform and kind, by local id (so the count too)."""
    return tuple((d.platform, d.kind) for d in sorted(devices, key=lambda d: d.local_id))


def describe_devices(devices: Sequence[LocalDevice]) -> str:
    """``2 devices: 2 x 'cpu'/'cpu'`` (platform/kind; runs of equal devices counted, at most ``DEVICES_SHOWN`` runs
    named)."""
    runs: list[list] = []
    for platform, kind in device_shape(devices):
        if runs and runs[-1][0] == (platform, kind):
            runs[-1][1] += 1
        else:
            runs.append([(platform, kind), 1])
    named = ", ".join(f"{n} x {shown(p, 32)}/{shown(k, 32)}" for (p, k), n in runs[:DEVICES_SHOWN])
    more = f", {len(runs) - DEVICES_SHOWN} more" if len(runs) > DEVICES_SHOWN else ""
    return f"{len(devices)} device{'s' if len(devices) != 1 else ''}: {named or 'none'}{more}"


def check_devices(newcomer: Registration, replaced: Registration, process_id: int) -> None:
    """ClusterMismatch, naming both device lists, unless ``newcomer`` brings the devices of ``replaced`` (count,
    platform and kind, by local id)."""
    if device_shape(newcomer.devices) == device_shape(replaced.devices):
        return
    raise ClusterMismatch(f"the replacement of process {process_id} from {newcomer.describe()} has other devices than "
                          f"the process it replaces: {describe_devices(newcomer.devices)}, expected "
                          f"{describe_devices(replaced.devices)} (the devices of process {process_id} from "
                          f"{replaced.describe()}): a replacement, a warm spare's too, must run where its devices "
                          "are the same (count, platform, kind)")
