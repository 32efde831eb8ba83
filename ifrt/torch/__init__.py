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
``init_process_group`` and joins that new group. ``Healing`` does all of it for a training loop: it re-forms the
group, heals the replacement from a live peer (``ifrt.torch.heal``), rebuilds its DDP modules and keeps a step only
where every process applied it (``ifrt.vote``).

A job that shrank to its survivors (the coordinator's ``--min-processes``; docs/failures.md, "Shrink") publishes a
generation without the failed processes: ``recover()`` then re-forms the group over the survivors alone. Under the
coordinator's ``--on-failure elastic`` that generation comes at once, and a process that takes a dropped id again
(replaced, its agent back, a spare host) makes a later one with it: ``Healing`` takes it in at a vote and heals it
(docs/failures.md, "Go on first, grow after"). Ranks are
the processes' places in the topology, by process id (``rank``), and the world size its process count: equal to the
process ids until a shrink, fewer and renumbered after one (process ids do not change).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Unpack

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # the optional extra is missing
    raise ImportError(f"ifrt.torch needs torch: pip install 'ifrt-topology[torch]' ({e})") from e

from ifrt import failfast, recovery, spare
from ifrt.client import Client
from ifrt.errors import (
    BackendAlreadyInitialized,
    BarrierFailed,
    CollectiveFailed,
    DiscoveryTimeout,
    InvalidArgument,
    StateLost,
)
from ifrt.hostport import split_host_port
from ifrt.ids import LOCAL_ID_BITS
from ifrt.mesh import Mesh
from ifrt.settings import DISCOVER_TIMEOUT_S, DiscoverOptions, discovery_timeout, env_plugin
from ifrt.started import Started
from ifrt.topology import Topology
from ifrt.torch import groups, heal
from ifrt.torch.ddp import DataParallel
from ifrt.torch.heal import Stateful
from ifrt.torch.start import (
    StartupExchange,
    advertised_ip,
    default_backend,
    default_plugin,
    nccl_device,
    set_socket_interfaces,
)
from ifrt.torch.store import DEFAULT_TIMEOUT, Store
from ifrt.vote import DEFAULT_VOTE_TIMEOUT_S, Vote

log = logging.getLogger("ifrt.torch")

PEER_FAILURE_NEWS_S = 1.0
"""How long a broken start waits for the coordinator's news of the peer failure that broke it (recovery)."""


# Start-up.
class _Started:
    """The process group this process runs now: its client, topology and store (kept referenced), how it was
    started (for a recovery's next group), and under ``on_failure="recover"`` the job's down processes."""

    def __init__(self, client: Client, topology: Topology, store: Store, scope: str, backend: str,
                 timeout: timedelta | None, peers: recovery.Peers | None, watchdog: failfast.Watchdog) -> None:
        self.client, self.topology, self.store, self.scope = client, topology, store, scope
        self.backend, self.timeout, self.peers, self.watchdog = backend, timeout, peers, watchdog
        self.mark = peers.mark() if peers is not None else 0


_runtime: Started[_Started] = Started("ifrt.torch", "ifrt.torch.init_process_group")
is_initialized = _runtime.is_initialized
client = _runtime.client
topology = _runtime.topology


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
    ``recover``). ``collective_timeout`` (seconds or a timedelta; None: torch's default, 30 minutes): how long a
    collective waits for its peers; with gloo it is what returns a collective blocked on a peer that is gone without
    closing its sockets, so keep it short under recovery.
    """
    with _runtime.lock:
        if _runtime.state is not None:
            return _runtime.state.topology
        failfast.check(on_failure)
        if spare.is_spare():
            _warm_up()
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
            set_socket_interfaces(advertised_ip(client, topology))
            peers = recovery.Peers(client) if on_failure == "recover" else None
            topology, store, scope = _start_mending(client, peers, topology, deadline, chosen, timeout)
        except BaseException:
            client.close()
            raise
        watchdog = failfast.arm(client, topology, on_failure, "torch.distributed", abort=groups.abort_all)
        _runtime.state = _Started(client, topology, store, scope, chosen, timeout, peers, watchdog)
        return topology


def _warm_up() -> None:
    """A warm spare imports, before its hand-off, what torch imports on a program's first optimizer (its compiler's
    front end: 0.8 s here), so a replacement's first steps do not wait for it."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # only an optimization: the program imports it itself
        log.debug("a warm spare could not import torch._dynamo ahead: %s", e)


def _start_mending(client: Client, peers: recovery.Peers | None, topology: Topology, deadline: float, backend: str,
                   timeout: timedelta | None, mark: int = 0) -> tuple[Topology, Store, str]:
    """Starts the default process group; under recovery (``peers``), a start that a process's failure since the mark
    ``mark`` broke (a newcomer's start, or a recovery's) waits for that process's replacement and starts again, until
    ``deadline``."""
    while True:
        try:
            return topology, *_start_group(client, topology, deadline, backend, timeout)
        except (BarrierFailed, RuntimeError):
            # the failure may reach the start's check before it reaches the events: give it a moment
            if peers is None or not peers.wait_failed(mark, PEER_FAILURE_NEWS_S):
                raise  # no process failed: not for a recovery to mend
        groups.leave()
        mark = peers.wait_whole(mark, deadline, f"process {topology.process_id}")
        topology = client.topology or topology


def _start_group(client: Client, topology: Topology, deadline: float, backend: str,
                 timeout: timedelta | None) -> tuple[Store, str]:
    """Starts the default process group on a start-up exchange of its own (fresh keys); returns its store and the
    start's scope."""
    exchange = StartupExchange(client, topology, deadline)
    prefix = exchange.run()
    store = Store(client, prefix, timedelta(seconds=max(1.0, deadline - time.monotonic())))
    store.watch, store.describe_missing = exchange.check_failures, exchange.describe_keys
    # torch's own timeout for collectives; the start-up's waits are bounded by the store's and the watch
    me, world = rank(topology), len(topology.processes)
    store.follow_start(me)  # the ranks' addresses come pushed: no call per rank
    others = [*client.settings.coordinators, *(p.address for p in topology.processes)]  # not the group's ports
    try:
        with groups.opening(frozenset(int(port) for _, port in map(split_host_port, others) if port.isdigit())):
            dist.init_process_group(backend, store=store, rank=me, world_size=world,
                                    device_id=nccl_device(backend, topology),
                                    **({"timeout": timeout} if timeout else {}))
    finally:
        store.end_start()
    store.set_timeout(DEFAULT_TIMEOUT)  # later groups (new_group, DeviceMesh) wait as c10d's own would
    log.info("torch.distributed started: process %d as rank %d of %d, backend %s, store prefix %s",
             topology.process_id, me, world, backend, prefix)
    return store, exchange.scope


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
        state = _runtime.get()
        if state.peers is None:
            raise
        down = state.peers.wait_failed(state.mark, state.watchdog.heartbeat_timeout + 1.0)
        if not down:
            raise
        names = ", ".join(f"{p} ({why})" for p, why in sorted(down.items()))
        raise CollectiveFailed(f"a collective of process {state.topology.process_id} failed because processes "
                               f"failed: {names}; call ifrt.torch.recover() to re-form the group once they are "
                               f"replaced ({type(e).__name__}: {str(e)[:200]})", tuple(sorted(down))) from e


def _broken(e: CollectiveFailed) -> str:
    """What a Healing says of a collective a peer's failure broke (it re-forms the group itself: nothing to call)."""
    cause = e.__cause__
    return (f"a collective failed because process{'es' if len(e.process_ids) > 1 else ''} "
            f"{', '.join(map(str, e.process_ids))} failed"
            + (f" ({type(cause).__name__}: {str(cause)[:200]})" if cause is not None else ""))


def recover(timeout: float = DISCOVER_TIMEOUT_S) -> Topology:
    """Re-forms the default process group in place after ``CollectiveFailed``: aborts the old group, waits until
    every process is live again (each failed one replaced, or dropped by a shrink), starts a new group on fresh keys
    (the same ranks; after a shrink, the survivors' ranks renumbered by process id and a smaller world), and
    returns the topology (after a shrink, the new generation). DiscoveryTimeout after ``timeout`` seconds names the
    processes not replaced; InvalidArgument without ``init_process_group(on_failure="recover")``."""
    return _re_form(timeout)


def _re_form(timeout: float, *, joining_at: int = 0) -> Topology:
    """``recover``; with ``joining_at``, for processes that joined in that generation (none failed): the new group
    is formed over it or a later one."""
    with _runtime.lock:
        state = _runtime.get()
        if state.peers is None:
            raise InvalidArgument("ifrt.torch.recover() re-forms a group started with "
                                  "ifrt.torch.init_process_group(on_failure='recover'); this one was started with "
                                  f"on_failure={state.watchdog.on_failure!r}")
        deadline = time.monotonic() + timeout
        groups.leave()
        if joining_at and not state.peers.wait_generation(joining_at, deadline):
            raise DiscoveryTimeout(f"process {state.topology.process_id} was told of topology generation "
                                   f"{joining_at} (processes joining) and did not receive it within {timeout:.0f}s")
        whole = state.peers.wait_whole(state.mark, deadline, f"process {state.topology.process_id}",
                                       failed_first=not joining_at)
        topology, store, scope = _start_mending(state.client, state.peers, state.client.topology or state.topology,
                                                deadline, state.backend, state.timeout, whole)
        _runtime.state = _Started(state.client, topology, store, scope, state.backend, state.timeout, state.peers,
                            state.watchdog)
        groups.release_retired()
        return topology


# Healing.
class Healing:
    """This process's part of a job that heals itself (``init_process_group(on_failure="recover")`` under ``ifrt run
    --recover replace``): the state it keeps, sent by a live peer to a replacement before its first step; the step
    count; and a vote that keeps a step only where every process applied it.

        healing = ifrt.torch.Healing({"model": net, "optimizer": optimizer})
        model = healing.data_parallel(net)
        while healing.step < steps:
            with healing.try_step():             # a failed peer: replaced, the group re-formed, the newcomer healed
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                if healing.should_commit():     # the same answer in every process
                    optimizer.step()

    ``state``: name -> anything with ``state_dict``/``load_state_dict`` (modules, optimizers, schedulers, or an
    object of the program's own), the same names in every process. ``replica_sets``: the processes holding the
    same state, as disjoint sets of process ids (default: all of them, data parallelism); a replacement receives its
    state from a survivor of its set, and StateLost says when its set has none. Making one is a collective: every
    process makes its Healing, and its ``data_parallel`` modules, in the same order."""

    def __init__(self, state: Mapping[str, Stateful], *, replica_sets: Sequence[Sequence[int]] | None = None,
                 vote_timeout: float = DEFAULT_VOTE_TIMEOUT_S, timeout: float = DISCOVER_TIMEOUT_S) -> None:
        started = _runtime.get()
        if started.peers is None:
            raise InvalidArgument("ifrt.torch.Healing heals a group started with "
                                  "ifrt.torch.init_process_group(on_failure='recover'); this one was started with "
                                  f"on_failure={started.watchdog.on_failure!r}")
        self.state, self.step, self.holds = dict(state), 0, False
        self.sets = heal.replica_sets(replica_sets) if replica_sets is not None else None
        self._set_list = tuple(tuple(members) for members in replica_sets) if replica_sets is not None else ()
        self.vote_timeout, self.timeout = vote_timeout, timeout
        self.healed: heal.Healed | None = None
        """How this process was healed (who sent its state, at which step, how many bytes in how long), if it was."""
        self.recoveries = 0
        """How many times this process re-formed the group (``recover``) since it made this Healing."""
        self._modules: list[DataParallel] = []
        self._due = False
        self._joining_at = 0  # the generation processes join in, once a vote agreed on it: the group re-forms
        self._mend(recover_first=False)

    @property
    def topology(self) -> Topology:
        """The topology of the group this process steps in now (a new generation after a shrink or a join)."""
        return _runtime.get().topology

    @property
    def rank(self) -> int:
        """This process's torch rank in the group it steps in now."""
        return rank(self.topology)

    @property
    def world_size(self) -> int:
        """How many processes the group it steps in now holds: fewer after the job went on without some (the
        coordinator's ``--on-failure elastic``), more again once they joined."""
        return len(self.topology.processes)

    def data_parallel(self, module: torch.nn.Module, **options: Any) -> torch.nn.Module:
        """``module`` trained data-parallel (``DistributedDataParallel(module, **options)``), built anew on each
        group a recovery forms."""
        wrapped = DataParallel(module, **options)
        self._modules.append(wrapped)
        try:
            with recoverable():
                groups.retire(wrapped.rebuild())
        except CollectiveFailed as e:
            log.warning("%s; re-forming the group", _broken(e))
            self._mend(recover_first=True)
        return wrapped

    @contextlib.contextmanager
    def try_step(self) -> Iterator[None]:
        """One try at a step: a collective that a peer's failure broke, or a vote that one failed, ends it and
        re-forms the group (the failed process replaced and healed); the program then runs the step again."""
        try:
            with recoverable():
                yield
        except CollectiveFailed as e:
            log.warning("step %d: %s; re-forming the group", self.step, _broken(e))
            self._mend(recover_first=True)
            return
        if self._due:
            log.warning("step %d was kept nowhere: a process failed before every vote was in; re-forming the group",
                        self.step)
            self._mend(recover_first=True)
        elif self._joining_at:
            log.warning("step %d was kept nowhere: processes join in topology generation %d; re-forming the group "
                        "with them", self.step, self._joining_at)
            self._mend(recover_first=True)

    def should_commit(self, ok: bool = True) -> bool:
        """This process's vote on the current step (``ok=False``: keep it nowhere); True, in every process, only
        if every process voted yes and none failed: apply the step then (the step count goes on). BarrierTimeout
        names the processes that did not vote within ``vote_timeout``.

        A process that joined the job since the group formed (a replacement, a returning host, a spare host's) is
        taken in at a vote: the first process to see it votes no, having said why under the round's key, and every
        process reads that key after a no, so all of them re-form the group at the same step (kept nowhere, run
        again with the newcomer healed)."""
        started = _runtime.get()
        said = f"{started.scope}/join/{self._vote.round}"
        joining = self._joining(started)
        if ok and joining:
            started.client.kv_set(said, str(joining).encode(), allow_overwrite=True, timeout=self.vote_timeout)
            ok = False
        committed = self._vote(ok)
        self.step += committed
        self._due = self._vote.failed
        if not committed and not self._due:
            found = started.client.kv_try_get(said, timeout=self.vote_timeout)
            # a generation number as a survivor wrote it; anything else (a process of the job writing there) is none
            self._joining_at = int(found) if found is not None and found.isdigit() and len(found) <= 20 else 0
        return committed

    def _joining(self, started: _Started) -> int:
        """The generation of the latest topology when it holds processes this group does not (0: none)."""
        latest = started.client.topology
        if latest is None or latest.generation <= started.topology.generation:
            return 0
        group = {p.process_id for p in started.topology.processes}
        return latest.generation if any(p.process_id not in group for p in latest.processes) else 0

    def _mend(self, *, recover_first: bool) -> None:
        """Heals the processes that need it on the current group (re-formed first if ``recover_first``) and builds
        the data-parallel modules on it; again on a new group if a process fails meanwhile."""
        while True:
            if recover_first:
                _re_form(self.timeout, joining_at=self._joining_at)
                self._joining_at = 0
                self.recoveries += 1
            recover_first = True
            started = _runtime.get()
            try:
                with recoverable():
                    self._heal(started)
                    for module in self._modules:
                        groups.retire(module.rebuild())
            except CollectiveFailed as e:
                log.warning("%s; re-forming the group", _broken(e))
                continue
            except BarrierFailed:  # the exchange before the transfer: a process failed or left meanwhile
                if not started.peers.wait_failed(started.mark, started.watchdog.heartbeat_timeout + 1.0):
                    raise
                continue
            group = [p.process_id for p in started.topology.processes]
            self._vote = Vote(started.client, started.scope, group, timeout=self.vote_timeout)
            self._due = False
            return

    def _heal(self, started: _Started) -> None:
        me = started.topology.process_id
        began = time.monotonic()
        group = [p.process_id for p in started.topology.processes]
        lost = [list(members) for members in self._set_list if not set(members) & set(group)]
        if lost:
            raise StateLost(f"replica set {lost[0]} has no live process: the job went on without "
                            f"{'it' if len(lost[0]) == 1 else 'all of them'} (topology generation "
                            f"{started.topology.generation} holds processes {group}), so no copy of its state is "
                            "left; restart the job from a checkpoint, or keep more than one replica of every shard")
        standings = heal.exchange(started.client, started.scope, me, heal.Standing(self.holds, self.step),
                                  self.timeout, group)
        plan = heal.plan(standings, self.sets or heal.data_parallel(sorted(standings)))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in started.backend else torch.device("cpu")
        received = heal.run(plan, me, ranks(started.topology), self.state, device)
        if not self.holds and plan.sends:
            self.step = plan.step
            source = next(source for source, fresh in plan.sends if fresh == me)
            self.healed = heal.Healed(source, plan.step, received, time.monotonic() - began)
            log.info("process %d healed: %s", me, self.healed)
        self.holds = True





class Replica(Healing):
    """The name ``Healing`` had in earlier releases (and ``attempt()``, now ``try_step()``), kept working a while: a
    DeprecationWarning, then ``Healing`` itself."""

    def __init__(self, state: Mapping[str, Stateful], **options: Any) -> None:
        warnings.warn("ifrt.torch.Replica is now ifrt.torch.Healing (and Replica.attempt() Healing.try_step()); the "
                      "old names will go", DeprecationWarning, stacklevel=2)
        super().__init__(state, **options)

    attempt = Healing.try_step


def store() -> Store:
    """The Store the default process group runs on."""
    return _runtime.get().store


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
    group = _runtime.state.topology if _runtime.state is not None else ifrt_mesh.topology
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


@atexit.register
def _close() -> None:
    if _runtime.state is not None:
        _runtime.state.client.close()
