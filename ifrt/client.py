"""``Client``: one process's link to the coordinator: discovery, the live session, barriers and key-values."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Unpack

import grpc
from google.protobuf.message import Message

from ifrt import preflight as _preflight
from ifrt import spare, variables, waiting, wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.agent_link import AgentConnection
from ifrt.client_config import DEFAULTS, ClientConfig
from ifrt.client_kv import KeyValueCalls
from ifrt.connection import Connection
from ifrt.errors import (
    DiscoveryTimeout,
    IfrtError,
    PluginError,
    from_rpc_error,
)
from ifrt.events import Event, PreemptionNotice
from ifrt.fanout import Fanout
from ifrt.hostport import join_host_port, split_host_port
from ifrt.preemption_signals import PreemptionSignals
from ifrt.progress import Progress
from ifrt.reachability import UnreachableReport
from ifrt.records import LocalDevice
from ifrt.security import new_process_secret
from ifrt.session import Session
from ifrt.settings import DISCOVERY_TIMEOUT_ENV, ProcessOptions, Settings, preflight_timeout, resolve
from ifrt.topology import Topology
from ifrt.transfer import Channels, Endpoint, local_address_toward
from ifrt.transfer_keys import PairKey, TransferKeys

log = logging.getLogger("ifrt.client")


class Client:
    """One process's link to the coordinator. ``discover()`` registers and returns the topology.

    Arguments fall back to ``IFRT_COORDINATOR``, ``IFRT_PROCESS_ID``, ``IFRT_NUM_PROCESSES``, ``IFRT_PLUGIN``,
    ``IFRT_LOCAL_RANK`` and ``IFRT_CLUSTER_ID`` (``options``: see ``ifrt.settings.ProcessOptions``). With
    ``session=True`` (the default), the process keeps a live session after discovery: events from the rest of the
    cluster, and its liveness.
    ``config`` holds the tunables (waits, retries, what is kept; see ``ifrt.client_config``).
    """

    def __init__(self, coordinator: str | Sequence[str] | None = None, *, session: bool = True,
                 transfer: bool = True, config: ClientConfig = DEFAULTS, **options: Unpack[ProcessOptions]) -> None:
        if options.get("environ") is None:  # a warm spare (`ifrt run --spare`) waits here until handed a process
            spare.await_hand_off()
        self.settings: Settings = resolve(coordinator, **options)
        variables.warn_unknown(os.environ if options.get("environ") is None else options["environ"])
        self.config = config
        self.endpoint: Endpoint | None = None
        self._want_transfer = transfer
        self.client_uid = uuid.uuid4().hex
        self.process_secret = new_process_secret()
        """Sent on every call: only this client may act for the process it registers (never logged or shown)."""
        self._connection = Connection(self.settings, self.process_secret, config)
        self._link: Connection = self._connection
        """Where every call goes: the coordinator, or this host's ``ifrt run`` agent (IFRT_AGENT_SOCKET), which
        registers the host's workers in one call, carries their sessions on one and forwards their other calls on its
        own connection."""
        if self.settings.agent_socket:
            self._link = AgentConnection(self.settings, self.process_secret, self.settings.agent_socket, config)
        self.topology: Topology | None = None
        self.topology_position = 0
        """The number of the job event that published the topology of the last Register answer (0: none yet)."""
        self.topology_run = self.topology_attempt = 0
        """The job run and attempt of the last Register answer (0: not said); the session opens for them."""
        self._want_session = session
        self._session: Session | None = None
        self._request: pb.RegisterRequest | None = None
        self._local_devices: tuple[LocalDevice, ...] = ()
        self._lock = threading.Lock()
        self._events = Fanout(config.events_kept)
        self._kv = KeyValueCalls(self.client_uid, config, self._unary, lambda: self._session,
                                 lambda: self._connection.where)
        self._preempted = threading.Event()  # a preemption notice is known (ours or another process's)
        self._sync_step: int | None = None
        self._signals: PreemptionSignals | None = None
        self._closed = False

    # Discovery.
    def discover(self) -> Topology:
        """Registers this process and waits until the coordinator publishes the complete topology.

        Raises DiscoveryTimeout (naming who is missing) after ``timeout`` seconds, and at once the typed error
        for anything retrying cannot fix (InvalidArgument, ProcessIdTaken, ClusterMismatch).
        """
        if self.topology is None:
            if self._want_transfer and self.endpoint is None:
                self.endpoint = self._bind_endpoint()
                self._events.on_event(self.endpoint.heard)  # fences replaced or failed peers' transfers
            self._request = self._build_request()
            try:
                self.topology = self._register(self._request, self.settings.timeout)
            except BaseException:  # a timeout, an error or an interrupt: a process that gives up leaves
                self._withdraw()
                raise
            if self.endpoint is not None:
                self.endpoint.expect(self.topology)  # its processes, and only they, may connect to the endpoint
            if self._want_session:
                self._session = Session(self, self._link, self._events.emit,
                                        bound_attach=self._link is self._connection)
                self._session.start()
            if self.settings.preemption_signals:
                self.report_preemption_on(self.settings.preemption_signals)
            if (seconds := preflight_timeout(self.config.preflight_timeout_s)) is not None:
                _preflight.passed(self.preflight(seconds))  # IFRT_PREFLIGHT=1: PreflightFailed names unreachable pairs
        return self.topology

    def preflight(self, timeout: float | None = None, *, attempt: str | None = None) -> _preflight.PreflightReport:
        """Probes the peers' transfer endpoints and gathers every process's results through the coordinator.

        Every process of the job must call it; each gets the same report, naming every unreachable pair by process
        id, host and address (see ``ifrt.preflight``). BarrierTimeout names a process that did not take part.
        ``attempt`` names the check's keys (default: this client's count of checks), for a job restarted against
        a journal that keeps its generation.
        """
        c = self.config
        auth_key = getattr(self.endpoint, "auth_key", None)  # set when the job runs with a cluster token
        return _preflight.run(self, self.discover(), c.preflight_timeout_s if timeout is None else timeout,
                              auth_key=auth_key, probe_timeout=c.preflight_probe_timeout_s,
                              parallel=c.preflight_parallel, attempt=attempt)

    def channels(self) -> Channels:
        """Array transfers to and from the devices of the topology, over this process's endpoint."""
        topology = self.discover()
        if self.endpoint is None:
            raise RuntimeError("this client has no transfer endpoint: it was created with transfer=False")
        return Channels(topology, self.endpoint)

    def _bind_endpoint(self) -> Endpoint:
        bind = self.settings.transfer_bind
        keys = TransferKeys(self.process_secret, self.transfer_key)  # peers' frames are bound to their own secrets
        if bind is None:
            here = local_address_toward(self.settings.coordinators)
            return Endpoint(join_host_port(here, 0), token=self.settings.token, keys=keys)
        host = split_host_port(bind)[0]
        wildcard = host in ("", "0.0.0.0", "::")
        return Endpoint(bind, advertise_host=local_address_toward(self.settings.coordinators) if wildcard else None,
                        token=self.settings.token, keys=keys)

    def transfer_key(self, peer_process_id: int, timeout: float = 30.0) -> PairKey:
        """The key this process (its current incarnation, which the key binds) proves itself with to
        ``peer_process_id``'s transfer endpoint: one ``TransferKey`` call (the endpoint's ``TransferKeys`` caches it
        per peer; see ``ifrt.transfer_keys``)."""
        answer = self._unary("TransferKey", lambda _: pb.TransferKeyRequest(
            client_uid=self.client_uid, peer_process_id=peer_process_id), time.monotonic() + timeout,
            what=f"the transfer key toward process {peer_process_id}")
        return PairKey(answer.key, answer.incarnation)

    def wait_attached(self, timeout: float) -> bool:
        """Waits until the live session is attached (events flow); returns whether it is."""
        return self._session is not None and self._session.attached.wait(timeout)

    @property
    def heartbeat_timeout_s(self) -> float | None:
        """The coordinator's ``--heartbeat-timeout`` in seconds, as the live session's first answer says it (no call
        of its own); None until the session has attached."""
        return None if self._session is None else self._session.heartbeat_timeout_s

    @property
    def process_id(self) -> int:
        if self.topology is None:
            raise RuntimeError("this client has not discovered its topology yet: call discover() first")
        return self.topology.process_id

    def register_again(self) -> Topology:
        """Re-sends this process's registration (after the coordinator lost its state); returns the topology."""
        assert self._request is not None
        return self._register(self._request, self.settings.timeout)

    def adopt(self, topology: Topology) -> bool:
        """Takes ``topology`` if it is another generation than the one held; returns whether it was."""
        with self._lock:
            if self.topology is not None and self.topology.canonical_bytes == topology.canonical_bytes:
                return False
            self.topology = topology
            if self.endpoint is not None:
                self.endpoint.expect(topology)
            return True

    @property
    def local_devices(self) -> tuple[LocalDevice, ...]:
        """This process's devices as its plugin listed them (sorted by local id), with the ``host_attributes`` that
        stay on this host (GPU UUID, PCI bus id, ...): the topology does not carry them. They match
        ``topology.local_devices`` by ``local_id``. Empty until ``discover()`` has listed them."""
        return self._local_devices

    def _build_request(self) -> pb.RegisterRequest:
        """This process's registration; PluginError naming the plugin and its error if the plugin fails.

        Only what other processes need is sent: each device's ``host_attributes`` stay in ``local_devices``."""
        from plugins import get_plugin  # loaded when a process registers, not by every import of ifrt.client

        s = self.settings
        plugin = get_plugin(s.plugin)  # PluginError naming it if it is unknown or does not load
        request = pb.RegisterRequest(cluster_id=s.cluster_id, num_processes=s.num_processes or 0,
                                     client_uid=self.client_uid, hostname=s.hostname, local_rank=s.local_rank,
                                     plugin=plugin.name, address=self.endpoint.address if self.endpoint else "")
        if s.process_id is not None:
            request.process_id = s.process_id
        if s.attempt is not None:
            request.attempt = s.attempt
        request.network.extend(s.network)
        request.opens_session = self._want_session
        request.os_pid = os.getpid()
        try:  # a plugin is third-party code: whatever it raises (or returns malformed) becomes one typed error
            plugin.configure_process(s.local_rank, s.local_world_size)
            devices = list(plugin.local_devices(s.local_device_ids))
            # the launcher's slice, else the host's NVLink partition from its node labels (where no device names one)
            launcher_slice = s.accelerator_domain if s.slice_index is None else str(s.slice_index)
            for d in devices:
                wire.add_local_device(request, d, launcher_slice)
            self._local_devices = tuple(sorted(devices, key=lambda d: d.local_id))
        except Exception as e:
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise PluginError(f"device plugin {s.plugin!r}: {why}") from e
        return request

    def _register(self, request: pb.RegisterRequest, timeout: float) -> Topology:
        c = self.config
        start = time.monotonic()
        deadline = start + timeout
        progress: Progress | None = None
        report = UnreachableReport(c)
        next_progress_line = 0.0
        bound = f"the discovery timeout ({timeout:g} s, timeout= or {DISCOVERY_TIMEOUT_ENV})"

        def wait_s(remaining: float) -> float:  # answered a little before our deadline: the last answer names who
            # is missing; the first answer soon, so that a wait is said within seconds
            longest = c.poll_s if progress is not None else min(c.poll_s, c.first_report_s)
            return min(longest, max(0.0, remaining - min(0.5, remaining / 4)))

        def attempt(remaining: float) -> pb.RegisterRequest:
            request.wait_ms = int(wait_s(remaining) * 1000)
            return request

        def give_up(last_error: IfrtError | None) -> DiscoveryTimeout:
            return self._timeout(time.monotonic() - start, progress, last_error, report.cause)

        while True:  # not wait_for_ready: a coordinator that cannot be reached is said so, with the cause, at once
            response = self._link.call("Register", attempt, deadline, report=report, give_up=give_up,
                                        timeout=lambda r: min(r, wait_s(r) + c.answer_slack_s), wait_for_ready=False,
                                        bound=bound)
            if response.topology:
                canonical = wire.decompress(response.encoding, response.topology)
                topology = Topology(canonical, response.process_id, expected_fingerprint=response.fingerprint)
                self.topology_position = response.event_position
                self.topology_run, self.topology_attempt = response.run, response.attempt
                return topology
            progress = _progress(response.progress)
            now = time.monotonic()
            if now >= next_progress_line:  # spaced: the short calls near the deadline do not each log a line
                next_progress_line = now + c.poll_s
                waiting.say(logging.WARNING if now - start >= c.warn_after_s else logging.INFO,
                            "waiting for the topology from %s, %.0f s into %s: %s", self._link.current(),
                            now - start, bound, progress.describe())

    def _withdraw(self) -> None:
        """Takes back the registration of a discover() that gave up, so a job is never completed (and published)
        with a process that has gone; one short attempt, and none if no coordinator ever answered."""
        if self._connection.ever_answered or self._link.ever_answered:
            self._leave("withdrew this process's registration from %s")

    def _leave(self, done: str | None = None) -> None:
        """One Leave call (a coordinator that is not there has nobody to tell); logs ``done`` or why it failed."""
        target = self._link.current()
        try:
            self._link.stub(target).Leave(pb.LeaveRequest(client_uid=self.client_uid),
                                          timeout=self.config.leave_timeout_s)
        except grpc.RpcError as e:
            log.info("could not tell the coordinator this process leaves: %s", from_rpc_error(e, target))
        else:
            if done is not None:
                log.info(done, target)

    def _timeout(self, waited: float, progress: Progress | None, last_error: IfrtError | None,
                 unreached: str | None = None) -> DiscoveryTimeout:
        where = self._connection.where
        if progress is None:
            cause = f"the coordinator ({where}) was not reachable"
            if unreached is not None:
                cause += f"; last error: {unreached}"
            elif last_error is not None:
                cause += f"; last error: {last_error}"
        else:
            cause = f"the cluster is incomplete: {progress.describe()} (coordinator {where})"
        return DiscoveryTimeout(f"no topology after {waited:.1f}s: {cause}", progress=progress)

    # Events.
    def watch(self, timeout: float | None = None, *, since_topology: bool = False) -> Iterator[Event]:
        """Events from now on (ProcessFailed, ProcessRestarted, ProcessLeft, TopologyChanged, CoordinatorLost, ...),
        until ``timeout`` seconds pass or the client closes. With ``since_topology``, first every job event received
        since the held topology (``events_since_topology``), none missed or repeated in between."""
        return self._events.watch(timeout, since_topology=since_topology)

    def on_event(self, callback: Callable[[Event], None], *, since_topology: bool = False) -> None:
        """Calls ``callback(event)`` for every event, from the session thread (keep it short). With
        ``since_topology``, first (in this thread) for every job event received since the held topology, in order,
        none missed or repeated in between."""
        self._events.on_event(callback, since_topology=since_topology)

    def events_since_topology(self) -> list[Event]:
        """The job events (ProcessFailed, ProcessLeft, ProcessRestarted, PreemptionNotice, and the TopologyChanged
        that began them) received since the topology this client holds, oldest first: what a start-up exchange
        that begins after discovery must not miss. The last ``config.events_kept`` at most."""
        return self._events.since_topology()

    # Coordination.
    def barrier(self, name: str, timeout: float, process_ids: Sequence[int] | None = None, *,
                supersedes: str = "") -> None:
        """Waits until every process (or those in ``process_ids``) reached barrier ``name``.

        Raises BarrierTimeout naming who did not arrive, or BarrierFailed at once when a participant failed.
        Use each name once (e.g. with a step number). ``supersedes``: the barrier of the same series (and the same
        participants) this one follows, e.g. ``"step/41"`` for ``"step/42"``; once this one completes the
        coordinator forgets it, so a per-step series stays within the coordinator's ``--max-barriers``.
        """
        deadline = time.monotonic() + timeout
        self._unary("Barrier", lambda remaining: pb.BarrierRequest(
            client_uid=self.client_uid, name=name, process_ids=process_ids or (),
            timeout_ms=max(1, int(remaining * 1000)), supersedes=supersedes), deadline,
            slack=self.config.answer_slack_s, what=f"barrier {name!r}")

    def cancel_barrier(self, name: str, timeout: float = 60.0, process_ids: Sequence[int] | None = None) -> bool:
        """Ends barrier ``name`` for every current and future waiter with BarrierCancelled. Only a participant may
        (PermissionDenied names them). Before anyone arrived, the cancel is kept and takes effect when the barrier
        starts if this process is a participant then. ``process_ids``: the participants as the barrier's callers
        name them (None: not named). Returns False when it had completed or failed already (its result stands), or
        when this process had cancelled it already."""
        response = self._unary("CancelBarrier", lambda _: pb.CancelBarrierRequest(
            client_uid=self.client_uid, name=name, process_ids=process_ids or ()), time.monotonic() + timeout,
            what=f"cancelling barrier {name!r}")
        return response.cancelled

    def live_processes(self, timeout: float) -> dict[int, int]:
        """Which processes are alive, agreed: waits until every live process called this, then returns the same
        ``{process id: incarnation}`` in each (the callers still alive). A process that dies meanwhile is left out
        within the heartbeat timeout. BarrierTimeout names a live process that did not call within ``timeout``."""
        deadline = time.monotonic() + timeout
        call_id = uuid.uuid4().hex
        response = self._unary("LiveProcesses", lambda remaining: pb.LiveProcessesRequest(
            client_uid=self.client_uid, call_id=call_id, timeout_ms=max(1, int(remaining * 1000))), deadline,
            slack=self.config.answer_slack_s, what="the agreed live processes")
        return {p.process_id: p.incarnation for p in response.processes}

    # Preemption.
    def reached_preemption_sync_point(self, step: int, timeout: float = 300.0) -> bool:
        """Call once per training step. False until a preemption notice; after one, True in every process at one
        and the same step (the first every process can still reach) and after it: checkpoint then, and exit.

        The first call after a notice reports this process's step and waits until every live process has
        reported (at most one step of the slowest); BarrierTimeout names a process that did not report."""
        if self._sync_step is not None:
            return step >= self._sync_step
        if not self._preempted.is_set():
            return False
        response = self._unary("PreemptionSync", lambda remaining: pb.PreemptionSyncRequest(
            client_uid=self.client_uid, step=step, timeout_ms=max(1, int(remaining * 1000))),
            time.monotonic() + timeout, slack=self.config.answer_slack_s,
            what=f"the preemption sync point (step {step})")
        self._sync_step = response.sync_step
        return step >= self._sync_step

    def report_preemption(self, timeout: float = 60.0) -> None:
        """Tells the coordinator this process will be preempted (what a preemption signal does): every process gets
        PreemptionNotice and reaches the sync point together."""
        self._preempted.set()
        self._unary("PreemptionNotice", lambda _: pb.PreemptionNoticeRequest(client_uid=self.client_uid),
                    time.monotonic() + timeout, what="the preemption notice")

    def report_preemption_on(self, signals: Sequence[signal.Signals]) -> None:
        """From now on each of ``signals`` reports this process's preemption instead of ending it (what
        IFRT_PREEMPTION_SIGNALS asks for), where no signals do yet; RuntimeError when not on the main thread."""
        if self._signals is None:
            self._signals = PreemptionSignals(signals, self.report_preemption,
                                              lambda: self._preempted.is_set() and self._sync_step is not None)
            self._signals.install()

    def preemption_noticed(self, process_id: int) -> None:
        """From the session: a process reported a preemption notice."""
        self._preempted.set()
        self._events.emit(PreemptionNotice(process_id))

    def _unary(self, method: str, request: Callable[[float], Message], deadline: float, slack: float = 0.0, *,
               what: str = "", give_up: Callable[[IfrtError | None], IfrtError] | None = None) -> Any:
        """Calls ``method``, retrying what retrying can fix until ``deadline`` (plus ``slack`` for the answer), and
        riding through a failover: while no replica leads, up to the failover window, also past ``deadline``
        (``what`` names what the call waited for in the error past it). Through an agent, this loop does the waiting:
        the agent forwards each attempt once."""
        return self._link.call(method, request, deadline, slack=slack, give_up=give_up, failover=True,
                               what=f"{method} ({what})" if what else method)

    # The key-value store (ifrt.client_kv says what each call does; the docstrings are its).
    def kv_set(self, key: str, value: bytes, *, allow_overwrite: bool = False, timeout: float = 60.0) -> None:
        self._kv.kv_set(key, value, allow_overwrite=allow_overwrite, timeout=timeout)

    def kv_get(self, key: str, timeout: float) -> bytes:
        return self._kv.kv_get(key, timeout)

    def kv_dir(self, prefix: str, timeout: float = 60.0) -> dict[str, bytes]:
        return self._kv.kv_dir(prefix, timeout)

    def kv_try_get(self, key: str, timeout: float = 60.0) -> bytes | None:
        return self._kv.kv_try_get(key, timeout)

    def kv_multi_get(self, keys: Sequence[str], timeout: float = 60.0) -> list[bytes | None]:
        return self._kv.kv_multi_get(keys, timeout)

    def kv_multi_set(self, items: Sequence[tuple[str, bytes]], *, allow_overwrite: bool = False,
                     timeout: float = 60.0) -> None:
        self._kv.kv_multi_set(items, allow_overwrite=allow_overwrite, timeout=timeout)

    def kv_increment(self, key: str, amount: int = 1, timeout: float = 60.0) -> int:
        return self._kv.kv_increment(key, amount, timeout)

    def kv_compare_set(self, key: str, expected: bytes, desired: bytes, timeout: float = 60.0) -> bytes | None:
        return self._kv.kv_compare_set(key, expected, desired, timeout)

    def kv_delete(self, key: str, *, prefix: bool = False, timeout: float = 60.0) -> int:
        return self._kv.kv_delete(key, prefix=prefix, timeout=timeout)

    def kv_watch(self, prefix: str, timeout: float | None = None) -> Iterator[tuple[str, bytes | None]]:
        return self._kv.kv_watch(prefix, timeout)

    def kv_follow(self, prefix: str, changed: Callable[[str, bytes | None], None]) -> threading.Event:
        return self._kv.kv_follow(prefix, changed)

    def key_changed(self, key: str, value: bytes | None) -> None:
        self._kv.key_changed(key, value)

    def current_coordinator(self) -> str:
        """The coordinator replica this client's calls go to now."""
        return self._connection.current()

    # Closing.
    def close(self) -> None:
        """Leaves the cluster gracefully (peers see ProcessLeft), ends the session and closes the connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._signals is not None:  # from now on a preemption signal does what it would without ifrt
            self._signals.close()
        if self._session is not None:
            self._session.close(self.config.session_close_timeout_s)
        if self.topology is not None:
            self._leave()
        self._events.close()
        self._kv.close()
        self._connection.close()
        if self._link is not self._connection:
            self._link.close()
        if self.endpoint is not None:
            self.endpoint.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _progress(p: pb.Progress) -> Progress:
    return Progress(p.registered, p.expected, tuple(p.missing_process_ids), tuple(p.registered_hosts), p.waited_seconds)


for _name in ("kv_set", "kv_get", "kv_dir", "kv_try_get", "kv_multi_get", "kv_multi_set", "kv_increment",
              "kv_compare_set", "kv_delete", "kv_watch", "kv_follow", "key_changed"):
    getattr(Client, _name).__doc__ = getattr(KeyValueCalls, _name).__doc__
