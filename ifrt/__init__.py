"""ifrt-topology: one consistent picture of a multi-host accelerator cluster, in every process.

    topology = ifrt.discover()          # IFRT_COORDINATOR=host:8476, IFRT_PROCESS_ID, IFRT_NUM_PROCESSES
    topology.devices, topology.local_devices, topology.fingerprint
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Sequence

from ifrt import events
from ifrt.client import Client
from ifrt.errors import (
    BarrierFailed,
    BarrierTimeout,
    ClusterMismatch,
    CoordinatorUnavailable,
    DiscoveryTimeout,
    IfrtError,
    InvalidArgument,
    KeyExists,
    KeyValueTimeout,
    ProcessDeclaredFailed,
    ProcessIdTaken,
    TopologyError,
    UnknownClient,
)
from ifrt.ids import global_device_id, split_global_id
from ifrt.mesh import Mesh
from ifrt.records import Device, LocalDevice, Process
from ifrt.topology import Topology

__all__ = [
    "BarrierFailed", "BarrierTimeout", "Client", "ClusterMismatch", "CoordinatorUnavailable", "Device",
    "DiscoveryTimeout", "IfrtError", "InvalidArgument", "KeyExists", "KeyValueTimeout", "LocalDevice", "Mesh",
    "Process", "ProcessDeclaredFailed", "ProcessIdTaken", "Topology", "TopologyError", "UnknownClient", "discover",
    "events", "global_device_id", "split_global_id",
]

_default_client: Client | None = None
_default_lock = threading.Lock()


def discover(
    coordinator: str | Sequence[str] | None = None,
    *,
    process_id: int | None = None,
    num_processes: int | None = None,
    plugin: str | None = None,
    local_device_ids: Sequence[int] | None = None,
    timeout: float = 300.0,
) -> Topology:
    """Registers this process's devices with the coordinator and returns the published topology.

    Each argument falls back to ``IFRT_COORDINATOR`` (comma-separated replicas allowed), ``IFRT_PROCESS_ID``
    (unset: the coordinator assigns ids), ``IFRT_NUM_PROCESSES`` and ``IFRT_PLUGIN`` (default ``cpu``).
    The process keeps this client as its default one; it is closed at exit.
    """
    global _default_client
    client = Client(coordinator, process_id=process_id, num_processes=num_processes, plugin=plugin,
                    local_device_ids=local_device_ids, timeout=timeout)
    with _default_lock:
        previous, _default_client = _default_client, client
    if previous is not None:
        previous.close()
    return client.discover()


@atexit.register
def _close_default_client() -> None:
    if _default_client is not None:
        _default_client.close()
