"""JAX started from ifrt's topology: ifrt assigns the process ids and the device order, JAX computes on them.

    topology = ifrt.jax.initialize()                      # instead of jax.distributed.initialize(...)
    mesh = ifrt.jax.mesh(topology.mesh((2, 4), ("data", "model")))
    jax.jit(f, in_shardings=NamedSharding(mesh, P("data", "model")))

``initialize`` does, in order:

1. ``ifrt`` discovery; this process's devices are listed by the ``jax`` plugin, which never creates a JAX
   backend (``plugins.jax_plugin``: from configuration on CPU, else in a short-lived child process), or by the
   ``cuda`` plugin (``plugin="cuda"``, NVML: no child process, the faster start on NVIDIA GPUs).
2. A start-up exchange in ifrt's key-value store, under keys scoped to the topology's generation and to a
   fresh nonce of process 0: each process answers with its own nonce and the devices its JAX will have; process 0
   publishes everyone's answer. A process accepts only an answer that carries its own fresh nonce, so a job
   restarted against a durable journal never meets the previous attempt's keys.
3. A check of every process's JAX devices against the topology (same count, same platform): a mismatch is one
   ``TopologyError`` naming the process and both device lists, raised in every process before JAX starts.
4. JAX's distributed client, with the topology's process ids and count, connected to ifrt's stand-in for XLA's
   coordination service in this very process (``ifrt.jax.xla_standin``: no process runs a service of its own, and the
   stand-in's keys live under the start's prefix of step 2); then the check again on the devices JAX reports
   (``jax.devices()``). With ``coordination="jax"``: ``jax.distributed.initialize``, XLA's service in process 0, at
   a port process 0 reserved and published in step 2.

XLA's network variable (``XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES``) is one of ifrt's position sources, and XLA reads
it too: when JAX's backend is created, XLA sorts the processes by it, comparing the names as text (``rack10`` before
``rack9``), and renumbers ``jax.process_index()`` in that order, where ifrt compares names naturally (``rack9`` <
``rack10``) and may have ids from the launcher. So while JAX starts, ifrt sets the variable, in every process alike
whichever source its position came from, to the process's path in the topology written as fixed-width ranks (the
same switch, the same name; text order equal to ifrt's natural order): XLA keeps the network's grouping and order
for whatever else it does with it, and its sort leaves ifrt's ids as they are. Where the ids go against the network
(launcher ids), no names can do both: ifrt hides the variable from JAX instead, and JAX numbers processes by id.
The user's value is back in ``os.environ`` once JAX's backend exists (``network_for_xla``).

Devices are matched by (process, local order), never by JAX's numbering of device ids, which differs between
JAX versions (``process << 17 | local`` like ifrt in JAX 0.4.x, ``process << 11 | local`` on CPU in JAX 0.10).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Unpack

import numpy as np

try:
    import jax
except ImportError as e:  # the optional extra is missing
    raise ImportError(f"ifrt.jax needs jax: pip install 'ifrt-topology[jax]' ({e})") from e

from ifrt import failfast, startup
from ifrt.client import Client
from ifrt.connection import Backoff
from ifrt.errors import BackendAlreadyInitialized, InvalidArgument, TopologyError
from ifrt.hostport import join_host_port, split_host_port
from ifrt.jax.devices import check_devices, match_devices
from ifrt.jax.xla_standin import layouts
from ifrt.jax.xla_standin.server import StandInServer
from ifrt.jax.xla_standin.service import CoordinationStandIn
from ifrt.local_address import local_address_toward
from ifrt.mesh import Mesh
from ifrt.network import path_key
from ifrt.network_sources import XLA_NETWORK_NODES_ENV
from ifrt.settings import DiscoverOptions, discovery_timeout, env_plugin
from ifrt.started import Started
from ifrt.topology import Topology
from ifrt.vote import Vote
from plugins import jax_plugin

log = logging.getLogger("ifrt.jax")
RUNNING_KEY = "ifrt/jax/running"
"""Names the recoverable start (its scope) that a replacement joins, across topology generations."""
RECOVERABLE_COLLECTIVE_TIMEOUT_S = 10.0
"""How long a CPU collective waits for its peers in recoverable mode, unless told: a survivor blocked on a peer that
left the collective (gloo's ring, where only the dead process's neighbours see it die) gets its error then."""
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
Coordination = Literal["ifrt", "jax"]
"""Who serves JAX's coordination: ifrt's stand-in in every process, or ``jax.distributed``'s service in process 0."""




@dataclass(frozen=True)
class _Started:
    client: Client
    topology: Topology
    jax_devices: Mapping[int, Any]  # global id -> jax.Device
    standin: StandInServer | None  # JAX's coordination service, where ifrt serves it
    vote: Vote  # should_commit's rounds, under this start's scope


_runtime: Started[_Started] = Started("ifrt.jax", "ifrt.jax.initialize")
is_initialized = _runtime.is_initialized
client = _runtime.client
topology = _runtime.topology


# Start-up.
def initialize(
    coordinator: str | Sequence[str] | None = None,
    *,
    on_failure: failfast.OnFailure | None = None,
    coordination: Coordination = "ifrt",
    collective_timeout: float | None = None,
    **options: Unpack[DiscoverOptions],
) -> Topology:
    """Discovers the topology with ifrt, then starts JAX's distributed runtime with its process ids; returns it.

    Same arguments as ``ifrt.discover`` (``ifrt.settings.DiscoverOptions``; the plugin defaults to ``jax``;
    ``token`` is the cluster's token, else IFRT_TOKEN_FILE or IFRT_TOKEN). Calling it again returns the same
    topology. BackendAlreadyInitialized if JAX's backend exists already; TopologyError, raised in every
    process, if some process's JAX devices differ from what it registered; DiscoveryTimeout after ``timeout``.
    Afterwards a failed peer or a lost coordinator ends this process as ``on_failure`` says (``ifrt.failfast``).

    ``on_failure="recover"`` (the default where ``jax_enable_recoverability`` is set; it sets it): JAX's recoverable
    mode, with no process special. A failed peer, process 0 included, ends no other process; ``live_devices`` answers
    the coordinator's agreement on who is alive; a replacement (``ifrt run --recover replace``) joins the running
    start and is in the next live set with a new incarnation (docs/jax.md, "Fault tolerance").

    ``collective_timeout`` (seconds; None: ``RECOVERABLE_COLLECTIVE_TIMEOUT_S`` in recoverable mode, else XLA's own,
    30 minutes): how long a CPU collective waits for its peers (XLA's ``--xla_cpu_collective_timeout_seconds``, unless
    ``XLA_FLAGS`` sets it). A survivor whose collective waits on a peer that left it, not on the dead process itself
    (a ring of 4 or more), gets its error only then.

    ``coordination="ifrt"`` (the default, on the jaxlib versions ``ifrt.jax.xla_standin`` serves): JAX's coordination
    service is ifrt's stand-in in this very process, so no process is special and a coordinator failover is invisible
    to JAX; ``"jax"``: ``jax.distributed``'s own service in process 0, as before.
    """
    with _runtime.lock:
        if _runtime.state is not None:
            return _runtime.state.topology
        on_failure = _on_failure(on_failure)
        coordination = _coordination(coordination)
        recoverable = on_failure == "recover"
        _set_collective_timeout(collective_timeout if collective_timeout is not None or not recoverable
                                else RECOVERABLE_COLLECTIVE_TIMEOUT_S)
        _refuse_if_started()
        deadline = time.monotonic() + (options["timeout"] if options.get("timeout") is not None
                                        else discovery_timeout(options.get("environ")))
        plugin = options.get("plugin") or env_plugin() or "jax"
        local_device_ids = options.get("local_device_ids")
        jax_view = None if plugin == "cuda" else _jax_view(local_device_ids)
        client = Client(coordinator, **{**options, "plugin": plugin})
        exchange = server = None
        try:
            topology = client.discover()
            exchange = StartupExchange(client, topology, deadline, reserve=coordination == "jax",
                                       recoverable=recoverable)
            record = exchange.run(jax_view if jax_view is not None else gpu_view(topology))
            check_devices(topology, exchange.views, what="will have")
            if coordination == "ifrt":
                agent_socket = client.settings.agent_socket
                server = StandInServer(CoordinationStandIn(client, topology, exchange.scope, recoverable=recoverable),
                                       within=os.path.dirname(agent_socket) if agent_socket else None)
                address = server.address
                try:
                    by_id = _start_jax(topology, lambda ids: connect_client(address, client, deadline), exchange,
                                       local_device_ids)
                except Exception as e:
                    if server.standin.refusal is None:
                        raise
                    raise TopologyError(server.standin.refusal) from e  # JAX's words wrap ifrt's: ifrt's alone
            else:
                by_id = _start_jax(topology, lambda ids: _start_distributed(record["address"], topology, exchange,
                                                                            ids, deadline),
                                   exchange, local_device_ids)
        except BaseException:
            if server is not None:
                _disconnect_client()
                server.close()
            client.close()
            raise
        finally:
            if exchange is not None:
                exchange.release_port()
        _runtime.state = _Started(client, topology, by_id, server, Vote(client, exchange.scope))
        failfast.arm(client, topology, on_failure, "JAX", shutdown=jax.distributed.shutdown,
                     cleanup=None if server is None else server.remove_socket)
        return topology


def should_commit(ok: bool = True) -> bool:
    """This process's vote on the current step (``ok=False``: keep it nowhere): True in every process only if every
    process voted yes and none failed or left before every vote was in (``ifrt.Vote``); apply the step, or save a
    checkpoint, only then. BarrierTimeout names the processes that did not vote within 10 minutes."""
    return _runtime.get().vote(ok)





def live_order(devices: Sequence[Any]) -> list[Any]:
    """``devices`` (as ``live_devices`` yields them) in an order that is the same in every process and new whenever a
    process of the live set was replaced: the permutation numbered by the sum of the incarnations in the live set
    last agreed (``live_devices``' own). jaxlib's CPU backend keeps a collective's gloo context per ordered device
    list for the life of the process, so a survivor would take a replacement into a context whose peer is gone; a new
    order is a new context. A set of n devices has n! orders (docs/jax.md, "Fault tolerance"). As given where ifrt
    does not serve JAX's coordination."""
    started = _runtime.get()
    ordered = sorted(devices, key=lambda d: d.id)
    if started.standin is None:
        return ordered
    index = sum(incarnation for _, incarnation in started.standin.standin.agreed) % math.factorial(len(ordered))
    chosen = []
    for place in range(len(ordered), 0, -1):  # the index as a factorial number: one digit per place
        digit, index = divmod(index, math.factorial(place - 1))
        chosen.append(ordered.pop(digit))
    return chosen


def _set_collective_timeout(seconds: float | None) -> None:
    """XLA's CPU collective timeout for the backend about to start, where ``XLA_FLAGS`` does not set it already."""
    if seconds is not None and seconds <= 0:
        raise InvalidArgument(f"collective_timeout={seconds!r}: expected a positive number of seconds")
    flags = os.environ.get(jax_plugin.XLA_FLAGS_ENV, "")
    if seconds is None or COLLECTIVE_TIMEOUT_FLAG in flags:
        return
    os.environ[jax_plugin.XLA_FLAGS_ENV] = f"{flags} {COLLECTIVE_TIMEOUT_FLAG}={max(1, round(seconds))}".strip()


def _on_failure(on_failure: failfast.OnFailure | None) -> failfast.OnFailure:
    """What a failure does to this process: as asked, else "recover" where JAX's recoverable mode is set, else
    "exit". "recover" sets JAX's recoverable mode (its own code reads it); InvalidArgument for what is not accepted."""
    recoverable = bool(jax_plugin.jax_config("jax_enable_recoverability", False))
    if on_failure is None:
        on_failure = "recover" if recoverable else "exit"
    failfast.check(on_failure)
    if on_failure == "recover" and not recoverable:
        jax.config.update("jax_enable_recoverability", True)
    return on_failure


def _refuse_if_started() -> None:
    if jax_plugin.backend_exists():
        raise BackendAlreadyInitialized(
            "JAX's backend already exists in this process, so jax.distributed can no longer start: call "
            "ifrt.jax.initialize() before any JAX computation or device query (jax.devices(), jax.device_put, "
            "jax.numpy arrays), e.g. first thing in main()")
    from jax._src import distributed

    if getattr(distributed.global_state, "client", None) is not None:
        raise BackendAlreadyInitialized(
            "jax.distributed is already initialized in this process: ifrt.jax.initialize() starts it itself "
            "with the topology's process ids; remove the other jax.distributed.initialize() call")


def gpu_view(topology: Topology) -> list[dict[str, Any]]:
    """The devices JAX will have where the ``cuda`` plugin listed this process's GPUs: those GPUs, as JAX names
    them. CUDA numbers the same visible GPUs, so no child process has to start JAX's backend to list them (1.5 s on
    an H200); JAX's devices are checked against the topology once it has started."""
    return [{"platform": "gpu", "kind": d.kind} for d in topology.local_devices]


def _jax_view(local_device_ids: Sequence[int] | None) -> list[dict[str, Any]]:
    """The devices this process's JAX will have, listed without creating a backend."""
    devices = jax_plugin.visible_devices()
    if local_device_ids is not None and any(d.platform != "cpu" for d in devices):
        # jax.distributed makes only these devices visible (GPU); on CPU it ignores local_device_ids
        wanted = set(local_device_ids)
        devices = [d for d in devices if d.local_id in wanted]
    return [{"platform": d.platform, "kind": d.kind} for d in devices]


def _start_jax(topology: Topology, start: Callable[[list[int]], None], exchange: StartupExchange,
               local_device_ids: Sequence[int] | None) -> dict[int, Any]:
    platform = topology.local_devices[0].platform if topology.local_devices else "cpu"
    if platform == "cpu":
        _use_gloo()
    if local_device_ids is None:  # explicit ids keep JAX from guessing them from a launcher's environment
        local_device_ids = range(len(exchange.views[topology.process_id]))
    _show_only(local_device_ids)
    with network_for_xla(topology):  # XLA reads it when JAX's backend is created, here in jax.devices()
        start(list(local_device_ids))
        devices = jax.devices()
    if jax.process_index() != topology.process_id or jax.process_count() != topology.num_processes:
        raise TopologyError(f"JAX started as process {jax.process_index()} of {jax.process_count()}, the topology "
                            f"says process {topology.process_id} of {topology.num_processes}")
    views: dict[int, list[dict[str, Any]]] = {p.process_id: [] for p in topology.processes}
    for d in devices:
        views.setdefault(d.process_index, []).append({"platform": d.platform, "kind": d.device_kind})
    check_devices(topology, views, what="has")
    return match_devices(topology, devices)


def _start_distributed(address: str, topology: Topology, exchange: StartupExchange, local_device_ids: list[int],
                       deadline: float) -> None:
    """``jax.distributed.initialize``: XLA's service in process 0, at the address process 0 reserved."""
    exchange.release_port()  # JAX's service binds it next
    if topology.process_id != 0:
        exchange.wait_listening(address)
    jax.distributed.initialize(address, num_processes=topology.num_processes, process_id=topology.process_id,
                               local_device_ids=local_device_ids,
                               initialization_timeout=max(1, int(deadline - time.monotonic())))


def connect_client(address: str, client: Client, deadline: float) -> None:
    """Starts JAX's distributed client only, connected to the coordination service at ``address`` (ifrt's stand-in),
    as process ``client.topology.process_id``: what ``jax.distributed.initialize`` does in a process other than 0,
    less the address guessing (private JAX names, listed in docs/jax.md). ``deadline`` (``time.monotonic()``) bounds
    the registration. JAX's preemption sync point is ifrt's (``PreemptionSyncPoint``)."""
    from jax._src import distributed

    runtime = getattr(distributed, "_jax", None) or distributed.xla_extension  # jaxlib 0.10 / 0.4
    topology = client.topology
    state = distributed.global_state
    state.coordinator_address = address
    state.process_id, state.num_processes = topology.process_id, topology.num_processes
    state.client = runtime.get_distributed_runtime_client(address, topology.process_id,
                                                          init_timeout=max(1, int(deadline - time.monotonic())))
    state.client.connect()
    if jax_plugin.jax_config("jax_enable_preemption_service", True):
        state.preemption_sync_manager = PreemptionSyncPoint(client)


class PreemptionSyncPoint:
    """JAX's preemption sync manager (``multihost_utils.reached_preemption_sync_point``) answered by ifrt's own sync
    point, with SIGTERM a preemption notice as in JAX: JAX's C++ manager holds this interpreter's lock while it waits
    for the coordination service, which the stand-in answers from this interpreter."""

    def __init__(self, client: Client) -> None:
        self.client = client
        try:
            client.report_preemption_on((signal.SIGTERM,))
        except RuntimeError as e:  # not the main thread: SIGTERM keeps its meaning
            log.warning("SIGTERM is no preemption notice in this process: %s", e)

    def reached_sync_point(self, step: int) -> bool:
        """False until some process was told of its preemption; then True in every process from one and the same
        step on (``Client.reached_preemption_sync_point``)."""
        return self.client.reached_preemption_sync_point(step)

    def shutdown(self) -> None:
        """Nothing to stop: the ifrt client closes with the process."""


def _disconnect_client() -> None:
    """Undoes ``connect_client`` where it began (a start that failed): JAX's client must go before the stand-in."""
    from jax._src import distributed

    with contextlib.suppress(Exception):
        distributed.global_state.shutdown()


def _show_only(local_device_ids: Sequence[int]) -> None:
    """The GPUs JAX may use, as ``jax.distributed.initialize`` sets them (JAX ignores it on CPU)."""
    visible = ",".join(str(i) for i in local_device_ids)
    for option in ("jax_cuda_visible_devices", "jax_rocm_visible_devices"):
        if jax_plugin.jax_config(option, None) is not None:
            jax.config.update(option, visible)


def _coordination(coordination: str) -> Coordination:
    """"ifrt" or "jax", as ``initialize`` is to start JAX: "ifrt" on a jaxlib outside the layouts the stand-in
    serves falls back to "jax", saying so; InvalidArgument for anything else."""
    if coordination not in ("ifrt", "jax"):
        raise InvalidArgument(f"coordination={coordination!r}: expected 'ifrt' (ifrt's stand-in serves JAX's "
                              "coordination in every process) or 'jax' (jax.distributed's service in process 0)")
    version = jaxlib_version()
    if coordination == "ifrt" and not layouts.supports(version):
        log.warning("jaxlib %s is outside the versions ifrt's coordination stand-in serves (%s): starting "
                    "jax.distributed's own service in process 0 instead", version, layouts.SUPPORTED)
        return "jax"
    return coordination  # type: ignore[return-value]


def jaxlib_version() -> str:
    """The installed jaxlib's version."""
    from jaxlib import version

    return version.__version__


def _use_gloo() -> None:
    """CPU collectives across processes: gloo (JAX 0.10's default; 0.4.x defaults to none)."""
    missing = object()
    chosen = jax_plugin.jax_config("jax_cpu_collectives_implementation", missing)
    if chosen is missing:  # only the older boolean option exists
        if jax_plugin.jax_config("jax_cpu_enable_gloo_collectives") is False:
            jax.config.update("jax_cpu_enable_gloo_collectives", True)
    elif chosen in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def xla_network_nodes(topology: Topology) -> dict[int, tuple[str, ...]] | None:
    """Process id -> the network nodes to give XLA: each level of its path named by the rank of that switch (the
    path up to it) in ifrt's natural order, zero-padded to one width, so that XLA's text order is ifrt's order and
    processes under one switch share its name. None where no process has a position, or where XLA's stable sort
    by these names would not keep the processes in id order (ids that go against the network)."""
    paths = {p.process_id: tuple(p.network) for p in topology.processes}
    if not any(paths.values()):
        return None
    switches = {path[:level + 1] for path in paths.values() for level in range(len(path))}
    ranks: dict[tuple[str, ...], int] = {}
    per_level = [0] * (max(map(len, switches)) + 1)
    for switch in sorted(switches, key=path_key):
        ranks[switch] = per_level[len(switch)]
        per_level[len(switch)] += 1
    width = len(str(max(ranks.values())))
    nodes = {p: tuple(f"{ranks[path[:level + 1]]:0{width}d}" for level in range(len(path)))
             for p, path in paths.items()}
    xla_order = sorted(nodes, key=lambda p: (nodes[p], p))  # XLA: level by level as text, a prefix first; stable
    return nodes if xla_order == sorted(nodes) else None


@contextlib.contextmanager
def network_for_xla(topology: Topology) -> Iterator[None]:
    """Within: XLA's network variable set to this process's ``xla_network_nodes`` (or removed where there are none),
    so that JAX numbers the processes as ifrt does; afterwards the user's value (or none) again. Logs once at INFO
    what it did, where the user had set the variable or ifrt sets it."""
    user = os.environ.get(XLA_NETWORK_NODES_ENV)
    nodes = xla_network_nodes(topology)
    value = ",".join(nodes[topology.process_id]) if nodes is not None else ""
    if value:
        os.environ[XLA_NETWORK_NODES_ENV] = value
        log.info("%s=%s while JAX starts (the user's value: %r): this process's network path %s, each switch named by "
                 "its rank in ifrt's natural order, so that XLA, which compares the names as text, keeps JAX's "
                 "process index at ifrt's id %d", XLA_NETWORK_NODES_ENV, value, user,
                 list(topology.process(topology.process_id).network), topology.process_id)
    elif user is not None:
        os.environ.pop(XLA_NETWORK_NODES_ENV)
        if nodes is not None:
            why = "this process has no network position in the topology (XLA sorts the empty path first, as ifrt does)"
        elif any(p.network for p in topology.processes):
            why = "the process ids (given by the launcher) do not follow the network, and XLA would renumber them"
        else:
            why = "no process has a network position in the topology"
        log.info("%s=%r hidden from JAX while it starts: %s; JAX's process index is ifrt's id %d",
                 XLA_NETWORK_NODES_ENV, user, why, topology.process_id)
    try:
        yield
    finally:
        if user is None:
            os.environ.pop(XLA_NETWORK_NODES_ENV, None)
        else:
            os.environ[XLA_NETWORK_NODES_ENV] = user


class StartupExchange(startup.StartupExchange):
    """JAX's start-up exchange (``ifrt.startup``): process 0's record carries JAX's coordinator address (a port it
    reserved on its advertised host), each answer the devices its JAX will have."""

    runtime, what = "jax", "JAX start-up"

    def __init__(self, client: Client, topology: Topology, deadline: float, *, reserve: bool,
                 recoverable: bool = False) -> None:
        super().__init__(client, topology, deadline)
        self.views: dict[int, list[dict[str, Any]]] = {}
        self.recoverable = recoverable
        self._reserve_port = reserve
        self._port: socket.socket | None = None

    def run(self, jax_view: list[dict[str, Any]]) -> dict[str, Any]:
        """Process 0's record (with ``reserve``: JAX's coordinator address), once every process has answered this
        start, or at once where this process replaces one of a recoverable start that runs; fills ``views``."""
        record = self.running() if self.recoverable else None
        if record is None:
            record = self.exchange({"devices": jax_view}, self._record)
        else:
            log.info("JAX start-up: process %d joins the running start %s as a replacement (recoverable mode)",
                     self.topology.process_id, self.scope)
        self.views = {p: answer["devices"] for p, answer in self.answers.items()}
        self.views[self.topology.process_id] = jax_view
        return record

    def running(self) -> dict[str, Any] | None:
        """Process 0's record of the recoverable start this job runs on, where that start completed in this job
        attempt and run: this process is a replacement (its previous incarnation answered that start; the topology's
        generation may be newer, its address having changed), and JAX's other processes run on its keys. None where
        there is none (a new start)."""
        found = self.client.kv_try_get(RUNNING_KEY, timeout=max(1.0, self._remaining()))
        scope = _field(found, "scope")
        if not isinstance(scope, str) or not scope.startswith(f"ifrt/{self.runtime}/g"):
            return None  # none, or not a start's scope: a new start
        record = _field(self.client.kv_try_get(f"{scope}/ready", timeout=max(1.0, self._remaining())))
        if not isinstance(record, dict) or not record.get("recoverable") or (
                record.get("attempt"), record.get("run")) != (self.client.topology_attempt, self.client.topology_run):
            return None
        self.answers = {int(p): a for p, a in record.pop("answers").items()}
        self.prefix, self.leader_nonce = scope.rsplit("/", 1)
        record.pop("nonces")
        return record

    def _record(self) -> dict[str, Any]:
        """Process 0's record of a start: the job attempt and run it belongs to, whether it is recoverable, and JAX's
        coordinator address where one was reserved. A recoverable start is named first as the one a replacement
        joins (``running``), which it does once the start completed."""
        if self.recoverable:
            self.client.kv_set(RUNNING_KEY, startup.dump({"scope": f"{self.prefix}/{self.nonce}"}),
                               allow_overwrite=True, timeout=max(1.0, self._remaining()))
        return {"attempt": self.client.topology_attempt, "run": self.client.topology_run,
                "recoverable": self.recoverable, **(self._reserve() if self._reserve_port else {})}

    def wait_listening(self, address: str) -> None:
        """Waits until JAX's service in process 0 accepts connections: a JAX client that dials too early retries
        only after about a second."""
        host, port = split_host_port(address)
        pause = Backoff(0.002, 0.05)
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=max(0.1, self._remaining())):
                    return
            except OSError:
                self._check_deadline(lambda: f"JAX's coordination service at {address} (process 0) is not listening")
                time.sleep(min(pause.next(), max(0.0, self._remaining())))

    def release_port(self) -> None:
        if self._port is not None:
            self._port.close()
            self._port = None

    def _reserve(self) -> dict[str, Any]:
        self._port = _reserve_port()
        return {"address": join_host_port(self._advertised_host(), self._port.getsockname()[1])}

    def _advertised_host(self) -> str:
        address = self.topology.process(0).address
        if address:
            return split_host_port(address)[0]
        return local_address_toward(self.client.settings.coordinators)


def _field(found: bytes | None, name: str | None = None) -> Any:
    """A JSON record's ``name`` field (the record itself for None); None where it is missing or no such record."""
    try:
        record = json.loads(found) if found is not None else None
        return record if name is None else record[name]
    except (ValueError, KeyError, TypeError):
        return None


def _reserve_port() -> socket.socket:
    """A bound (not listening) socket on a free port of every address, held until JAX's service binds it."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((host, 0))
            return sock
        except OSError:
            sock.close()
    raise OSError("cannot bind a free TCP port for JAX's coordinator on this host")


# Devices and meshes.
def device(global_id: int) -> Any:
    """The ``jax.Device`` for an ifrt global id; KeyError naming the id if the topology has no such device."""
    try:
        return _runtime.get().jax_devices[int(global_id)]
    except KeyError:
        raise KeyError(f"no device with global id {global_id} in topology generation "
                       f"{_runtime.get().topology.generation}") from None


def devices(ids_or_mesh: Mesh | np.ndarray | Sequence[int]) -> Any:
    """The ``jax.Device`` for each global id: a numpy array of the same shape for a Mesh or an array, else a list."""
    if isinstance(ids_or_mesh, Mesh):
        ids_or_mesh = ids_or_mesh.devices
    if isinstance(ids_or_mesh, np.ndarray):
        found = np.empty(ids_or_mesh.shape, dtype=object)
        for index, global_id in np.ndenumerate(ids_or_mesh):
            found[index] = device(int(global_id))
        return found
    return [device(int(i)) for i in ids_or_mesh]


def mesh(ifrt_mesh: Mesh) -> jax.sharding.Mesh:
    """The ``jax.sharding.Mesh`` with the ifrt mesh's shape, axis names and device order (submeshes too)."""
    return jax.sharding.Mesh(devices(ifrt_mesh), ifrt_mesh.axis_names)


@atexit.register
def _close() -> None:
    """At exit: JAX's client first (its shutdown barrier, while the stand-in serves it), then ifrt's."""
    if _runtime.state is not None:
        if _runtime.state.standin is not None:
            _disconnect_client()
            _runtime.state.standin.close()
        _runtime.state.client.close()
