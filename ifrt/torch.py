"""PyTorch started from ifrt's topology: ifrt assigns the ranks and the device order, torch.distributed computes.

    topology = ifrt.torch.init_process_group()     # instead of MASTER_ADDR, RANK, WORLD_SIZE or torchrun's rendezvous
    mesh = ifrt.torch.device_mesh(topology.mesh((2, 2), ("dp", "tp")))

``init_process_group`` does, in order:

1. ``ifrt`` discovery (the same arguments as ``ifrt.discover``).
2. A start-up exchange in ifrt's key-value store, under keys scoped to the topology's generation and to a fresh
   nonce of process 0: process 0 publishes its nonce, each process answers with its own, and process 0 confirms
   everyone's answer. A process accepts only a confirmation that carries its own fresh nonce, so a job restarted
   against a durable journal never reads the previous attempt's c10d keys (which are the same on every start).
3. ``torch.distributed.init_process_group`` with ``rank = process_id``, ``world_size = num_processes`` (until a
   shrink: see below) and a ``Store`` on ifrt's key-value store under that start's prefix; gloo on CPU, nccl on
   CUDA devices (each process on its first GPU, given as ``device_id`` so NCCL's communicator is made at once).

The device plugin defaults to ``cuda`` where this torch is built for CUDA and NVML sees a GPU, else ``cpu``.

Every wait names who is missing, and a process that fails during the start ends it in every process, naming it.

In-place recovery (under ``ifrt run --recover replace``, see docs/failures.md): with ``on_failure="recover"`` a peer
that fails does not end this process. A collective inside ``recoverable()`` that the failure broke raises
``ifrt.CollectiveFailed``; ``recover()`` then waits until every process is live again (the failed one replaced, with
its id), aborts the old group and starts a new one with the same ranks on fresh keys (a new start-up exchange: a
nonce of its own, the old group's keys deleted), and returns the topology. The replacement itself just calls
``init_process_group`` and joins that new group.

A job that shrank to its survivors (the coordinator's ``--min-processes``; docs/failures.md, "Shrink") publishes a
generation without the failed processes: ``recover()`` then re-forms the group over the survivors alone. Ranks are
the processes' places in the topology, by process id (``rank``), and the world size its process count: equal to the
process ids until a shrink, fewer and renumbered after one (process ids do not change).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, Unpack

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # the optional extra is missing
    raise ImportError(f"ifrt.torch needs torch: pip install 'ifrt-topology[torch]' ({e})") from e

from ifrt import failfast, recovery, spare, startup
from ifrt.client import Client
from ifrt.errors import BackendAlreadyInitialized, BarrierFailed, CollectiveFailed, InvalidArgument
from ifrt.hostport import split_host_port
from ifrt.ids import LOCAL_ID_BITS
from ifrt.interfaces import interface_of
from ifrt.mesh import Mesh
from ifrt.settings import DISCOVER_TIMEOUT_S, DiscoverOptions, discovery_timeout, env_plugin
from ifrt.topology import Topology
from ifrt.torch_store import DEFAULT_TIMEOUT, Store
from ifrt.transfer import local_address_toward

log = logging.getLogger("ifrt.torch")

SOCKET_IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
CUDA_PLATFORMS = frozenset({"cuda", "gpu"})
PEER_FAILURE_NEWS_S = 1.0
"""How long a broken start waits for the coordinator's news of the peer failure that broke it (recovery)."""


# Start-up.
class _Started:
    """The process group this process runs now: its client, topology and store (kept referenced), how it was
    started (for a recovery's next group), and under ``on_failure="recover"`` the job's down processes."""

    def __init__(self, client: Client, topology: Topology, store: Store, backend: str,
                 timeout: timedelta | None, peers: recovery.Peers | None, watchdog: failfast.Watchdog) -> None:
        self.client, self.topology, self.store = client, topology, store
        self.backend, self.timeout, self.peers, self.watchdog = backend, timeout, peers, watchdog
        self.mark = peers.mark() if peers is not None else 0


_started: _Started | None = None
_lock = threading.Lock()


def init_process_group(
    backend: str | None = None,
    coordinator: str | Sequence[str] | None = None,
    *,
    on_failure: failfast.OnFailure = "exit",
    collective_timeout: timedelta | float | None = None,
    **options: Unpack[DiscoverOptions],
) -> Topology:
    """Discovers the topology with ifrt, then starts ``torch.distributed`` with ``rank = process_id`` and
    ``world_size = num_processes`` on a Store scoped to this start; returns the topology.

    The other arguments are ``ifrt.discover``'s (``ifrt.settings.DiscoverOptions``). ``backend``: gloo on CPU,
    nccl where the process's devices are CUDA GPUs. Calling it again returns the same topology;
    BackendAlreadyInitialized if another default process group exists. DiscoveryTimeout names who is missing;
    BarrierFailed, in every process, names a process that failed during the start. Afterwards a failed peer or a
    lost coordinator ends this process as ``on_failure`` says (``ifrt.failfast``), aborting the process groups
    first unless it exits at once (NCCL's abort unblocks a collective waiting on a hung peer; torch 2.13's gloo
    abort does not).

    ``on_failure="recover"``: a failed peer is replaced and the group re-formed in place (``recoverable``,
    ``recover``). ``collective_timeout`` (seconds or a timedelta; default torch's): how long a collective waits for
    its peers; with gloo it is what returns a collective blocked on a peer that is gone without closing its
    sockets, so keep it short under recovery.
    """
    global _started
    with _lock:
        if _started is not None:
            return _started.topology
        failfast.check(on_failure, recover=True)
        spare.await_hand_off()  # a warm spare waits here, before its deadline starts, until it is handed a process
        if dist.is_initialized():
            raise BackendAlreadyInitialized(
                "a default torch.distributed process group already exists in this process: "
                "ifrt.torch.init_process_group() starts it itself with the topology's ranks; remove the other "
                "torch.distributed.init_process_group() call (or destroy that group first)")
        deadline = time.monotonic() + (options["timeout"] if options.get("timeout") is not None
                                        else discovery_timeout(options.get("environ")))
        timeout = timedelta(seconds=collective_timeout) if isinstance(collective_timeout, int | float) \
            else collective_timeout
        client = Client(coordinator, **{**options, "plugin": options.get("plugin") or env_plugin() or default_plugin()})
        try:
            topology = client.discover()
            chosen = backend or default_backend(topology)
            _set_socket_interfaces(_advertised_ip(client, topology))
            peers = recovery.Peers(client) if on_failure == "recover" else None
            topology, store = _start_mending(client, peers, topology, deadline, chosen, timeout)
        except BaseException:
            client.close()
            raise
        watchdog = failfast.arm(client, topology, on_failure, "torch.distributed", abort=_abort_process_groups)
        _started = _Started(client, topology, store, chosen, timeout, peers, watchdog)
        return topology


def _start_mending(client: Client, peers: recovery.Peers | None, topology: Topology, deadline: float, backend: str,
                   timeout: timedelta | None, mark: int = 0) -> tuple[Topology, Store]:
    """Starts the default process group; under recovery (``peers``), a start that a process's failure since the mark
    ``mark`` broke (a newcomer's start, or a recovery's) waits for that process's replacement and starts again, until
    ``deadline``."""
    while True:
        try:
            return topology, _start_group(client, topology, deadline, backend, timeout)
        except (BarrierFailed, RuntimeError):
            # the failure may reach the start's check before it reaches the events: give it a moment
            if peers is None or not peers.wait_failed(mark, PEER_FAILURE_NEWS_S):
                raise  # no process failed: not for a recovery to mend
        _leave_group()
        mark = peers.wait_whole(mark, deadline, f"process {topology.process_id}")
        topology = client.topology or topology


def _start_group(client: Client, topology: Topology, deadline: float, backend: str,
                 timeout: timedelta | None) -> Store:
    """Starts the default process group on a start-up exchange of its own (fresh keys); returns its store."""
    exchange = StartupExchange(client, topology, deadline)
    prefix = exchange.run()
    store = Store(client, prefix, timedelta(seconds=max(1.0, deadline - time.monotonic())))
    store.watch, store.describe_missing = exchange.check_failures, exchange.describe_keys
    # torch's own timeout for collectives; the start-up's waits are bounded by the store's and the watch
    me, world = rank(topology), len(topology.processes)
    store.follow_start(me)  # the ranks' addresses come pushed: no call per rank
    try:
        dist.init_process_group(backend, store=store, rank=me, world_size=world,
                                device_id=_nccl_device(backend, topology), **({"timeout": timeout} if timeout else {}))
    finally:
        store.end_start()
    store.set_timeout(DEFAULT_TIMEOUT)  # later groups (new_group, DeviceMesh) wait as c10d's own would
    log.info("torch.distributed started: process %d as rank %d of %d, backend %s, store prefix %s",
             topology.process_id, me, world, backend, prefix)
    return store


def ranks(topology: Topology) -> dict[int, int]:
    """Process id -> torch rank in a group over ``topology``: its place among the topology's processes by id (the
    process id itself, until a shrink drops processes)."""
    return {p.process_id: i for i, p in enumerate(topology.processes)}


def rank(topology: Topology, process_id: int | None = None) -> int:
    """The torch rank of ``process_id`` (default: this process) in a group over ``topology``."""
    return ranks(topology)[topology.process_id if process_id is None else process_id]


# In-place recovery.
@contextlib.contextmanager
def recoverable() -> Iterator[None]:
    """Code whose collectives a failed peer may break (``on_failure="recover"``): their error becomes one
    ``ifrt.CollectiveFailed`` naming the failed processes, once the coordinator has declared one (waiting up to its
    heartbeat timeout + 1 s); an error that no peer's failure explains passes unchanged."""
    try:
        yield
    except RuntimeError as e:  # c10d's DistBackendError and gloo's errors are RuntimeErrors
        state = _state()
        if state.peers is None:
            raise
        down = state.peers.wait_failed(state.mark, state.watchdog.heartbeat_timeout + 1.0)
        if not down:
            raise
        names = ", ".join(f"{p} ({why})" for p, why in sorted(down.items()))
        raise CollectiveFailed(f"a collective of process {state.topology.process_id} failed because processes "
                               f"failed: {names}; call ifrt.torch.recover() to re-form the group once they are "
                               f"replaced ({type(e).__name__}: {str(e)[:200]})", tuple(sorted(down))) from e


def recover(timeout: float = DISCOVER_TIMEOUT_S) -> Topology:
    """Re-forms the default process group in place after ``CollectiveFailed``: aborts the old group, waits until
    every process is live again (each failed one replaced, or dropped by a shrink), starts a new group on fresh keys
    (the same ranks; after a shrink, the survivors' ranks renumbered by process id and a smaller world), and
    returns the topology (after a shrink, the new generation). DiscoveryTimeout after ``timeout`` seconds names the
    processes not replaced; InvalidArgument without ``init_process_group(on_failure="recover")``."""
    global _started
    with _lock:
        state = _state()
        if state.peers is None:
            raise InvalidArgument("ifrt.torch.recover() re-forms a group started with "
                                  "ifrt.torch.init_process_group(on_failure='recover'); this one was started with "
                                  f"on_failure={state.watchdog.on_failure!r}")
        deadline = time.monotonic() + timeout
        _leave_group()
        whole = state.peers.wait_whole(state.mark, deadline, f"process {state.topology.process_id}")
        topology, store = _start_mending(state.client, state.peers, state.client.topology or state.topology, deadline,
                                         state.backend, state.timeout, whole)
        _started = _Started(state.client, topology, store, state.backend, state.timeout, state.peers,
                            state.watchdog)
        return topology


def is_initialized() -> bool:
    """Whether ``init_process_group`` completed in this process."""
    return _started is not None


def client() -> Client:
    """The ifrt client ``init_process_group`` started (key-values, barriers, events, ``channels()``)."""
    return _state().client


def topology() -> Topology:
    """The topology ``init_process_group`` returned."""
    return _state().topology


def store() -> Store:
    """The Store the default process group runs on."""
    return _state().store


def default_plugin() -> str:
    """``cuda`` where this torch is built for CUDA and NVML sees a GPU, else ``cpu``. Asked of NVML, not of CUDA,
    whose runtime must not start before the plugin has given each local rank its GPUs (CUDA_VISIBLE_DEVICES)."""
    if torch.version.cuda is None:
        return "cpu"  # without importing the cuda plugin
    from plugins.cuda import CudaPlugin

    return "cuda" if CudaPlugin().gpu_count() > 0 else "cpu"


def _nccl_device(backend: str, topology: Topology) -> Any:
    """The CUDA device NCCL runs this process's rank on: its first GPU (local ids are CUDA's numbering of the
    visible GPUs); None for other backends."""
    if "nccl" not in backend or not topology.local_devices:
        return None
    device = torch.device("cuda", topology.local_devices[0].local_id)
    torch.cuda.set_device(device)
    return device


def default_backend(topology: Topology) -> str:
    """nccl where this process's devices are CUDA GPUs, else gloo."""
    if topology.local_devices and all(d.platform in CUDA_PLATFORMS for d in topology.local_devices):
        return "nccl"
    return "gloo"


class StartupExchange(startup.StartupExchange):
    """torch.distributed's start-up exchange (``ifrt.startup``): its nonce scopes c10d's keys to this start
    (``ifrt/torch/gG/N0/c10d/...``)."""

    runtime, what = "torch", "torch.distributed start-up"

    def run(self) -> str:
        """The c10d key prefix of this start, once every process has answered it."""
        self.exchange({})
        return f"{self.prefix}/{self.leader_nonce}/c10d/"

    def describe_keys(self, keys: Sequence[str]) -> str:
        """Who should set c10d's ``keys``: those ending in a rank (``.../<rank>``) name that rank's process."""
        by_rank = [p.process_id for p in self.topology.processes]
        named = sorted({by_rank[int(m.group(1))] for k in keys if (m := re.search(r"(?:/|_)(\d+)$", k))
                        and int(m.group(1)) < len(by_rank)})
        if not named:
            return ""
        return "expected from " + ", ".join(f"process {p} ({self.host(p)})" for p in named)


# The network interface gloo and NCCL use.
def _advertised_ip(client: Client, topology: Topology) -> str:
    """The IP this process is reached at: its transfer endpoint's host, else its address toward the coordinator."""
    address = topology.process(topology.process_id).address
    host = split_host_port(address)[0]
    return host or local_address_toward(client.settings.coordinators)


def _set_socket_interfaces(ip: str) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME name the interface of ``ip``, unless the user set them (gloo would
    otherwise pick the interface of the hostname, which across hosts is often not the one ifrt advertises)."""
    name = interface_of(ip)
    if name is None:
        log.warning("no network interface has address %s: gloo and NCCL choose their own", ip)
        return
    for env in SOCKET_IFNAME_ENVS:
        os.environ.setdefault(env, name)


# Device meshes.
def device_mesh(ifrt_mesh: Mesh, device_type: str | None = None) -> Any:
    """The ``torch.distributed.device_mesh.DeviceMesh`` with the ifrt mesh's shape, axis names and order: each
    device becomes the rank of its process. ValueError if the mesh does not hold exactly one device per process, or
    holds a process the running group does not (a mesh of the generation before a shrink)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = mesh_ranks(ifrt_mesh)
    if device_type is None:
        device_type = "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=ifrt_mesh.axis_names)


def mesh_ranks(ifrt_mesh: Mesh) -> Any:
    """The torch ranks of an ifrt mesh's devices' processes, in its shape (``ranks``: over the running group's
    topology, else the mesh's own; the process ids until a shrink); ValueError saying why if a process holds more
    than one of its devices (a DeviceMesh has one entry per rank), or is not in the running group."""
    import numpy as np

    process_ids = np.asarray(ifrt_mesh.devices) >> LOCAL_ID_BITS
    held: dict[int, list[int]] = {}
    for global_id, pid in zip(ifrt_mesh.devices.flat, process_ids.flat, strict=True):
        held.setdefault(int(pid), []).append(int(global_id))
    shared = {rank: ids for rank, ids in held.items() if len(ids) > 1}
    if shared:
        rank, ids = min(shared.items())
        raise ValueError(
            f"the mesh of shape {ifrt_mesh.shape} holds {len(ids)} devices of process {rank} (global ids "
            f"{ids[:8]}) and {len(shared) - 1} more processes hold several: a torch DeviceMesh has one entry per "
            "rank, and ranks are processes; build the mesh from one device per process (e.g. each process's "
            "first device) or run one process per device")
    group = _started.topology if _started is not None else ifrt_mesh.topology
    if not isinstance(group, Topology):
        return process_ids.tolist()  # over device ids alone: ranks are process ids
    by_id = ranks(group)
    outside = sorted(held.keys() - by_id.keys())
    if outside:
        raise ValueError(
            f"the mesh holds processes {outside[:8]}, which the process group (topology generation "
            f"{group.generation}, {len(by_id)} processes) does not: the job shrank to its survivors; build the mesh "
            "from the topology ifrt.torch.recover() returned")
    return np.array([by_id[int(p)] for p in process_ids.flat]).reshape(process_ids.shape).tolist()


def _leave_group() -> None:
    """Aborts the default process group (if any) and lets it go: nothing of it is used again, its connections nor
    its keys."""
    if dist.is_initialized():
        _retire(dist.distributed_c10d._get_default_group())
    _abort_process_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


_retired: list[Any] = []
"""The process groups that recoveries replaced: kept, never destroyed (see ``_retire``)."""


def _retire(group: Any) -> None:
    """Keeps an aborted group from ever being destroyed: gloo's destructor waits, holding the GIL, for work still
    queued on a peer that is gone, while that work's completion needs the GIL (a deadlock seen here when the old
    DDP's group was collected). One reference more than the program will ever drop (a group's sockets and threads,
    per recovery, bounded by the job's restart budget)."""
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    _retired.append(group)


def _abort_process_groups() -> None:
    """Aborts every process group, so that a collective blocked on a hung peer returns."""
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


@atexit.register
def _close() -> None:
    if _started is not None:
        _started.client.close()


def _state() -> _Started:
    if _started is None:
        raise RuntimeError("ifrt.torch is not initialized in this process: call ifrt.torch.init_process_group() "
                           "first")
    return _started
