"""ifrt-topology: one consistent picture of a multi-host accelerator cluster, in every process.

    topology = ifrt.discover()          # IFRT_COORDINATOR=host:8476, IFRT_PROCESS_ID, IFRT_NUM_PROCESSES
    topology.devices, topology.local_devices, topology.fingerprint
"""

from __future__ import annotations

import atexit
import importlib
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ifrt import events
from ifrt.errors import (
    BarrierCancelled,
    BarrierFailed,
    BarrierTimeout,
    CertificateRejected,
    ClusterMismatch,
    CollectiveFailed,
    CoordinatorGone,
    CoordinatorUnavailable,
    DiscoveryTimeout,
    IfrtError,
    InvalidArgument,
    JobFailed,
    KeyExists,
    KeyValueTimeout,
    PeerFailed,
    PermissionDenied,
    PluginError,
    ProcessDeclaredFailed,
    ProcessIdTaken,
    StateLost,
    TopologyError,
    TransportMismatch,
    Unauthenticated,
    UnknownClient,
)
from ifrt.ids import global_device_id, split_global_id
from ifrt.records import Device, LocalDevice, Process

if TYPE_CHECKING:
    from typing import Unpack

    from ifrt.client import Client
    from ifrt.mesh import Mesh
    from ifrt.settings import DiscoverOptions
    from ifrt.topology import Topology
    from ifrt.vote import Vote

__all__ = [
    "BarrierCancelled", "BarrierFailed", "BarrierTimeout", "CertificateRejected", "Client", "ClusterMismatch",
    "CollectiveFailed", "CoordinatorGone", "CoordinatorUnavailable", "Device", "DiscoveryTimeout", "IfrtError",
    "InvalidArgument",
    "JobFailed", "KeyExists", "KeyValueTimeout", "LocalDevice", "Mesh", "PeerFailed", "PermissionDenied",
    "PluginError", "Process", "ProcessDeclaredFailed", "ProcessIdTaken", "StateLost", "Topology", "TopologyError",
    "TransportMismatch", "Unauthenticated", "UnknownClient", "Vote", "discover", "events", "global_device_id",
    "split_global_id",
]

_LAZY = {"Client": "ifrt.client", "Mesh": "ifrt.mesh", "Topology": "ifrt.topology", "Vote": "ifrt.vote"}
"""Names whose modules need grpc or numpy: imported on first use, so ``import ifrt.records`` (as plugins and the
coordinator's plain parts do) loads neither."""
_RUNTIMES = ("jax", "torch")
"""``ifrt.jax`` and ``ifrt.torch``: they import their runtime, so ``import ifrt`` does not import them."""


def __getattr__(name: str) -> Any:
    """``ifrt.Client``, ``ifrt.Mesh``, ``ifrt.Topology``, ``ifrt.Vote``: imported from their modules on first use."""
    if name in _RUNTIMES:  # submodules with an optional extra: imported only when asked for
        return importlib.import_module(f"ifrt.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ifrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


_default_client: Client | None = None
_default_lock = threading.Lock()


def discover(coordinator: str | Sequence[str] | None = None, **options: Unpack[DiscoverOptions]) -> Topology:
    """Registers this process's devices with the coordinator and returns the published topology.

    ``coordinator`` falls back to ``IFRT_COORDINATOR`` (comma-separated replicas allowed); the keyword ``options``
    (process_id, num_processes, plugin, local_device_ids, timeout, token) are ``ifrt.settings.DiscoverOptions``.
    The process keeps this client as its default one; it is closed at exit.
    """
    global _default_client
    from ifrt.client import Client

    client = Client(coordinator, **options)
    with _default_lock:
        previous, _default_client = _default_client, client
    if previous is not None:
        previous.close()
    return client.discover()


@atexit.register
def _close_default_client() -> None:
    if _default_client is not None:
        _default_client.close()
