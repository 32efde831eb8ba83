"""``Client``: one process's link to the coordinator: discovery, the live session, barriers and key-values."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from ifrt import preflight as _preflight
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.errors import (
    CertificateRejected,
    CoordinatorUnavailable,
    DiscoveryTimeout,
    IfrtError,
    KeyValueTimeout,
    PluginError,
    TransportMismatch,
    from_rpc_error,
)
from ifrt.events import Event, PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted, TopologyChanged
from ifrt.progress import Progress
from ifrt.reachability import UnreachableReport, certificate_problem, unreached_cause
from ifrt.records import LocalDevice
from ifrt.security import new_process_secret, open_channel, transport_mismatch
from ifrt.session import Session
from ifrt.settings import Settings, resolve
from ifrt.topology import Topology
from ifrt.transfer import Channels, Endpoint, local_address_toward

log = logging.getLogger("ifrt.client")

POLL_S = 5.0
"""Longest one Register call waits on the coordinator; a progress line is logged after each."""
WARN_AFTER_S = 30.0
"""Progress lines are INFO until discover() has waited this long, then WARNING (shown without logging setup)."""
SLACK_S = 5.0
"""How much longer than the coordinator's own wait a call may take before the client gives up on it."""
LEAVE_TIMEOUT_S = 2.0
WATCH_ACK_TIMEOUT_S = 30.0
"""Longest kv_watch waits for the coordinator to say the watch is in place."""
EVENTS_KEPT = 1 << 16
"""Job events kept since the held topology (``events_since_topology``): four for each of 2**14 processes."""
_JOB_EVENTS = (ProcessFailed, ProcessLeft, ProcessRestarted, PreemptionNotice, TopologyChanged)
CHANNEL_OPTIONS = (
    # Reconnect to a coordinator that is not up yet within ~100 ms of it starting (gRPC's default: ~1 s, growing);
    # gRPC adds up to 20% jitter to the cap.
    ("grpc.initial_reconnect_backoff_ms", 10),
    ("grpc.max_reconnect_backoff_ms", 80),
    # Give up a connection attempt after 2 s (gRPC's default: 20 s), so a replica whose host vanished (its SYNs
    # unanswered) does not hold a process back from the replica that took over.
    ("grpc.min_reconnect_backoff_ms", 2000),
    # Notice a coordinator that vanished without closing the connection (host down, partition, stopped): ping after
    # 5 s without hearing from it (its own pings, every half heartbeat timeout, count) and give up 10 s later,
    # so a coordinator busy with a registration storm is not mistaken for a dead one. ping_timeout_ms is what
    # gRPC's core waits for the ack; keepalive_timeout_ms alone leaves that at 60 s.
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),
    # One connection per client, as separate processes have; topologies of large clusters exceed 4 MiB.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", wire.MAX_TOPOLOGY_BYTES),
)
_CLOSED = object()


class Backoff:
    """Pauses between retries: doubling from ``first`` to ``cap`` seconds, with jitter."""

    def __init__(self, first: float = 0.01, cap: float = 0.1) -> None:
        self.first, self.cap = first, cap
        self._failures = 0
        self._jitter = random.Random()  # its own: retries never draw from (or disturb) the program's global random

    def next(self) -> float:
        self._failures += 1
        return self._jitter.uniform(0.5, 1.0) * min(self.cap, self.first * 2 ** min(self._failures, 16))

    def reset(self) -> None:
        self._failures = 0


class Client:
    """One process's link to the coordinator. ``discover()`` registers and returns the topology.

    Arguments fall back to ``IFRT_COORDINATOR``, ``IFRT_PROCESS_ID``, ``IFRT_NUM_PROCESSES``, ``IFRT_PLUGIN``,
    ``IFRT_LOCAL_RANK`` and ``IFRT_CLUSTER_ID`` (see ``ifrt.settings``). With ``session=True`` (the default),
    the process keeps a live session after discovery: heartbeats, and events from the rest of the cluster.
    """

    def __init__(self, coordinator: str | Sequence[str] | None = None, *, session: bool = True,
                 transfer: bool = True, **kwargs: Any) -> None:
        self.settings: Settings = resolve(coordinator, **kwargs)
        self.endpoint: Endpoint | None = None
        self._want_transfer = transfer
        self.client_uid = uuid.uuid4().hex
        self.process_secret = new_process_secret()
        """Sent on every call: only this client may act for the process it registers (never logged or shown)."""
        self._answered: set[str] = set()  # coordinators that answered: their transport is known to match
        self.topology: Topology | None = None
        self.topology_position = 0
        """The number of the job event that published the topology of the last Register answer (0: none yet)."""
        self.backoff = Backoff()
        self._want_session = session
        self._session: Session | None = None
        self._request: pb.RegisterRequest | None = None
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, CoordinatorStub] = {}
        self._current = 0
        self._watchers: set[queue.Queue] = set()
        self._callbacks: list[Callable[[Event], None]] = []
        self._since_topology: deque[Event] = deque(maxlen=EVENTS_KEPT)  # job events since the held topology
        self._dispatch = threading.RLock()  # one event at a time reaches the callbacks, in order
        self._key_watchers: list[tuple[str, queue.Queue]] = []
        self._preempted = threading.Event()  # a preemption notice is known (ours or another process's)
        self._sync_step: int | None = None
        self._signalled: queue.SimpleQueue | None = None  # preemption signals, from the handler to the reporter
        self._previous_handlers: dict[signal.Signals, Any] = {}
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
            self._request = self._build_request()
            try:
                self.topology = self._register(self._request, self.settings.timeout)
            except BaseException:  # a timeout, an error or an interrupt: a process that gives up leaves
                self._withdraw()
                raise
            if self.endpoint is not None:
                self.endpoint.expect(self.topology)  # its processes, and only they, may connect to the endpoint
            if self._want_session:
                self._session = Session(self, self._emit)
                self._session.start()
            if self.settings.preemption_signals:
                self._handle_preemption_signals()
            _preflight.run_if_requested(self)  # IFRT_PREFLIGHT=1: PreflightFailed names the unreachable pairs
        return self.topology

    def preflight(self, timeout: float = _preflight.DEFAULT_TIMEOUT_S) -> _preflight.PreflightReport:
        """Probes the peers' transfer endpoints and gathers every process's results through the coordinator.

        Every process of the job must call it; each gets the same report, naming every unreachable pair by process
        id, host and address (see ``ifrt.preflight``). BarrierTimeout names a process that did not take part.
        """
        return _preflight.run(self, timeout)

    def channels(self) -> Channels:
        """Array transfers to and from the devices of the topology, over this process's endpoint."""
        topology = self.discover()
        if self.endpoint is None:
            raise RuntimeError("this client has no transfer endpoint: it was created with transfer=False")
        return Channels(topology, self.endpoint)

    def _bind_endpoint(self) -> Endpoint:
        bind = self.settings.transfer_bind
        if bind is None:
            return Endpoint(f"{local_address_toward(self.settings.coordinators)}:0", token=self.settings.token)
        host = bind.rpartition(":")[0].strip("[]")
        wildcard = host in ("", "0.0.0.0", "::")
        return Endpoint(bind, advertise_host=local_address_toward(self.settings.coordinators) if wildcard else None,
                        token=self.settings.token)

    def wait_attached(self, timeout: float) -> bool:
        """Waits until the live session is attached (events flow); returns whether it is."""
        return self._session is not None and self._session.attached.wait(timeout)

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

    _local_devices: tuple[LocalDevice, ...] = ()

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
        try:  # a plugin is third-party code: whatever it raises (or returns malformed) becomes one typed error
            plugin.configure_process(s.local_rank, s.local_world_size)
            devices = list(plugin.local_devices(s.local_device_ids))
            launcher_slice = "" if s.slice_index is None else str(s.slice_index)
            for d in devices:
                request.devices.add(local_id=d.local_id, platform=d.platform, kind=d.kind,
                                    slice_key=d.slice_key or launcher_slice,
                                    coordinates=d.coordinates, attributes=d.attributes)
            self._local_devices = tuple(sorted(devices, key=lambda d: d.local_id))
        except Exception as e:
            why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise PluginError(f"device plugin {s.plugin!r}: {why}") from e
        return request

    def _register(self, request: pb.RegisterRequest, timeout: float) -> Topology:
        start = time.monotonic()
        deadline = start + timeout
        progress: Progress | None = None
        last_error: IfrtError | None = None
        unreachable = UnreachableReport()
        next_progress_line = 0.0
        while (remaining := deadline - time.monotonic()) > 0:
            # Ask the coordinator to answer a little before our deadline, so the last answer names who is missing.
            wait_s = min(POLL_S, max(0.0, remaining - min(0.5, remaining / 4)))
            request.wait_ms = int(wait_s * 1000)
            target = self.current_coordinator()
            try:  # not wait_for_ready: a coordinator that cannot be reached is said so, with the cause, at once
                response = self.stub(target).Register(request, timeout=min(remaining, wait_s + SLACK_S))
            except grpc.RpcError as e:
                if (cause := unreached_cause(e)) is not None:
                    self._refuse_certificate(cause, target)
                    unreachable.failed(target, cause, deadline)
                last_error = self._retryable(e, target)
                continue
            self._answered.add(target)
            self.backoff.reset()
            unreachable.reached()
            if response.topology:
                canonical = wire.decompress(response.encoding, response.topology)
                topology = Topology(canonical, response.process_id, expected_fingerprint=response.fingerprint)
                self.topology_position = response.event_position
                return topology
            progress = _progress(response.progress)
            now = time.monotonic()
            if now >= next_progress_line:  # spaced: the short calls near the deadline do not each log a line
                next_progress_line = now + POLL_S
                log.log(logging.WARNING if now - start >= WARN_AFTER_S else logging.INFO,
                        "waiting for the topology from %s (%.0fs so far): %s", target, now - start, progress.describe())
        raise self._timeout(time.monotonic() - start, progress, last_error, unreachable.cause)

    def _refuse_certificate(self, cause: str, target: str) -> None:
        """CertificateRejected at once when this process's TLS refused the coordinator's certificate: no retry fixes
        that, and waiting out the timeout would make a configuration mistake look like an outage."""
        problem = certificate_problem(cause, target, self.settings.tls_ca)
        if problem is not None:
            raise CertificateRejected(problem)

    def _withdraw(self) -> None:
        """Takes back the registration of a discover() that gave up, so a job is never completed (and published)
        with a process that has gone; one short attempt, and none if no coordinator ever answered."""
        if not self._answered:
            return
        target = self.current_coordinator()
        with contextlib.suppress(grpc.RpcError, IfrtError):
            self.stub(target).Leave(pb.LeaveRequest(client_uid=self.client_uid), timeout=LEAVE_TIMEOUT_S)
            log.info("withdrew this process's registration from %s", target)

    def _timeout(self, waited: float, progress: Progress | None, last_error: IfrtError | None,
                 unreached: str | None = None) -> DiscoveryTimeout:
        where = ", ".join(self.settings.coordinators)
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
        events: queue.Queue = queue.Queue()
        with self._lock:
            for event in self._since_topology if since_topology else ():
                events.put(event)
            self._watchers.add(events)
        return self._drain(events, None if timeout is None else time.monotonic() + timeout)

    def _drain(self, events: queue.Queue, deadline: float | None) -> Iterator[Event]:
        try:
            yield from _until(events, deadline)
        finally:
            with self._lock:
                self._watchers.discard(events)

    def on_event(self, callback: Callable[[Event], None], *, since_topology: bool = False) -> None:
        """Calls ``callback(event)`` for every event, from the session thread (keep it short). With
        ``since_topology``, first (in this thread) for every job event received since the held topology, in order,
        none missed or repeated in between."""
        with self._dispatch:
            with self._lock:
                earlier = list(self._since_topology) if since_topology else []
                self._callbacks.append(callback)
            for event in earlier:
                self._call(callback, event)

    def events_since_topology(self) -> list[Event]:
        """The job events (ProcessFailed, ProcessLeft, ProcessRestarted, PreemptionNotice, and the TopologyChanged
        that began them) received since the topology this client holds, oldest first: what a start-up exchange
        that begins after discovery must not miss. The last ``EVENTS_KEPT`` at most."""
        with self._lock:
            return list(self._since_topology)

    def _emit(self, event: Event) -> None:
        with self._dispatch:
            with self._lock:
                if isinstance(event, TopologyChanged):
                    self._since_topology.clear()
                if isinstance(event, _JOB_EVENTS):
                    self._since_topology.append(event)
                watchers, callbacks = list(self._watchers), list(self._callbacks)
            for events in watchers:
                events.put(event)
            for callback in callbacks:
                self._call(callback, event)

    @staticmethod
    def _call(callback: Callable[[Event], None], event: Event) -> None:
        try:
            callback(event)
        except Exception:
            log.exception("on_event callback %r failed on %r", callback, event)

    # Coordination.
    def barrier(self, name: str, timeout: float, process_ids: Sequence[int] | None = None) -> None:
        """Waits until every process (or those in ``process_ids``) reached barrier ``name``.

        Raises BarrierTimeout naming who did not arrive, or BarrierFailed at once when a participant failed.
        Use each name once (e.g. with a step number).
        """
        deadline = time.monotonic() + timeout
        self._unary("Barrier", lambda remaining: pb.BarrierRequest(
            client_uid=self.client_uid, name=name, process_ids=process_ids or (),
            timeout_ms=max(1, int(remaining * 1000))), deadline, slack=SLACK_S)

    def kv_set(self, key: str, value: bytes, *, allow_overwrite: bool = False, timeout: float = 60.0) -> None:
        """Stores ``value`` under ``key``. KeyExists if it holds another value (unless ``allow_overwrite``)."""
        request = pb.KeyValueSetRequest(client_uid=self.client_uid, key=key, value=bytes(value),
                                        allow_overwrite=allow_overwrite)
        self._unary("KeyValueSet", lambda _: request, time.monotonic() + timeout)

    def kv_get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for some process to set it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                response = self._unary("KeyValueGet", lambda remaining: pb.KeyValueGetRequest(
                    client_uid=self.client_uid, key=key, wait_ms=max(0, int(remaining * 1000))), deadline,
                    slack=SLACK_S)
                return response.value
            except KeyValueTimeout:
                if time.monotonic() >= deadline:  # the coordinator caps one wait; ours may be longer
                    raise KeyValueTimeout(f"key {key!r} was not set within {timeout:.1f}s") from None

    def kv_dir(self, prefix: str, timeout: float = 60.0) -> dict[str, bytes]:
        """Every key starting with ``prefix`` and its value, sorted by key."""
        response = self._unary("KeyValueDir", lambda _: pb.KeyValueDirRequest(
            client_uid=self.client_uid, prefix=prefix), time.monotonic() + timeout)
        return {e.key: e.value for e in response.entries}

    def kv_try_get(self, key: str, timeout: float = 60.0) -> bytes | None:
        """The value of ``key``, or None if it is unset now (no waiting)."""
        response = self._unary("KeyValueTryGet", lambda _: pb.KeyValueTryGetRequest(
            client_uid=self.client_uid, key=key), time.monotonic() + timeout)
        return response.value if response.found else None

    def kv_increment(self, key: str, amount: int = 1, timeout: float = 60.0) -> int:
        """Adds ``amount`` to the integer ``key`` holds (an unset key holds 0), atomically; returns the sum.

        Exactly once, also when the call is retried on another coordinator replica. InvalidArgument if the key
        holds something that is not a decimal integer."""
        request = pb.KeyValueIncrementRequest(client_uid=self.client_uid, key=key, amount=amount,
                                              request_id=uuid.uuid4().hex)
        return self._unary("KeyValueIncrement", lambda _: request, time.monotonic() + timeout).value

    def kv_compare_set(self, key: str, expected: bytes, desired: bytes, timeout: float = 60.0) -> bytes | None:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (empty ``expected``: if it is unset), atomically, as
        torch's TCPStore does; returns what the key holds afterwards (None: it is unset).

        Exactly once, also when the call is retried on another coordinator replica."""
        request = pb.KeyValueCompareSetRequest(client_uid=self.client_uid, key=key, expected=bytes(expected),
                                               desired=bytes(desired), request_id=uuid.uuid4().hex)
        response = self._unary("KeyValueCompareSet", lambda _: request, time.monotonic() + timeout)
        return response.value if response.found else None

    def kv_delete(self, key: str, *, prefix: bool = False, timeout: float = 60.0) -> int:
        """Deletes ``key`` (with ``prefix=True``, every key starting with it); returns how many keys were deleted.
        Deleting a key that is not there is no error."""
        response = self._unary("KeyValueDelete", lambda _: pb.KeyValueDeleteRequest(
            client_uid=self.client_uid, key=key, prefix=prefix), time.monotonic() + timeout)
        return response.deleted

    def kv_watch(self, prefix: str, timeout: float | None = None) -> Iterator[tuple[str, bytes | None]]:
        """Every change of a key under ``prefix`` from now on, as ``(key, value)`` (``None``: deleted), until
        ``timeout`` seconds pass or the client closes. Returns once the coordinator watches (carried on the live
        session; changes made while the session reconnects are not replayed: re-read with ``kv_dir`` on
        ``CoordinatorRestored``)."""
        if self._session is None:
            raise RuntimeError("kv_watch needs the live session: call discover() first, with session=True")
        changes: queue.Queue = queue.Queue()
        with self._lock:
            self._key_watchers.append((prefix, changes))
        if not self._session.watch(prefix).wait(WATCH_ACK_TIMEOUT_S):
            with self._lock:
                self._key_watchers.remove((prefix, changes))
            raise CoordinatorUnavailable(f"the coordinator ({', '.join(self.settings.coordinators)}) did not start "
                                         f"watching {prefix!r} within {WATCH_ACK_TIMEOUT_S:.0f}s")
        return self._changes(prefix, changes, None if timeout is None else time.monotonic() + timeout)

    def _changes(self, prefix: str, changes: queue.Queue, deadline: float | None) -> Iterator[tuple[str, bytes | None]]:
        try:
            yield from _until(changes, deadline)
        finally:
            with self._lock:
                if (prefix, changes) in self._key_watchers:
                    self._key_watchers.remove((prefix, changes))

    def key_changed(self, key: str, value: bytes | None) -> None:
        """From the session: ``key`` changed; hands it to every kv_watch of a prefix of it."""
        with self._lock:
            watchers = [changes for prefix, changes in self._key_watchers if key.startswith(prefix)]
        for changes in watchers:
            changes.put((key, value))

    def cancel_barrier(self, name: str, timeout: float = 60.0) -> bool:
        """Ends barrier ``name`` for every current and future waiter with BarrierCancelled (also before anyone
        arrived). Returns False when it had completed or failed already (its result stands)."""
        response = self._unary("CancelBarrier", lambda _: pb.CancelBarrierRequest(
            client_uid=self.client_uid, name=name), time.monotonic() + timeout)
        return response.cancelled

    def live_processes(self, timeout: float) -> dict[int, int]:
        """Which processes are alive, agreed: waits until every live process called this, then returns the same
        ``{process id: incarnation}`` in each (the callers still alive). A process that dies meanwhile is left out
        within the heartbeat timeout. BarrierTimeout names a live process that did not call within ``timeout``."""
        deadline = time.monotonic() + timeout
        call_id = uuid.uuid4().hex
        response = self._unary("LiveProcesses", lambda remaining: pb.LiveProcessesRequest(
            client_uid=self.client_uid, call_id=call_id, timeout_ms=max(1, int(remaining * 1000))), deadline,
            slack=SLACK_S)
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
            time.monotonic() + timeout, slack=SLACK_S)
        self._sync_step = response.sync_step
        return step >= self._sync_step

    def report_preemption(self, timeout: float = 60.0) -> None:
        """Tells the coordinator this process will be preempted (what a preemption signal does): every process gets
        PreemptionNotice and reaches the sync point together."""
        self._preempted.set()
        self._unary("PreemptionNotice", lambda _: pb.PreemptionNoticeRequest(client_uid=self.client_uid),
                    time.monotonic() + timeout)

    def preemption_noticed(self, process_id: int) -> None:
        """From the session: a process reported a preemption notice."""
        self._preempted.set()
        self._emit(PreemptionNotice(process_id))

    def _handle_preemption_signals(self) -> None:
        """Installs handlers that turn the configured signals into a preemption notice instead of an exit."""
        self._signalled = queue.SimpleQueue()
        threading.Thread(target=self._report_signals, args=(self._signalled,), name="ifrt-preemption",
                         daemon=True).start()
        for sig in self.settings.preemption_signals:
            try:
                self._previous_handlers[sig] = signal.signal(sig, self._on_preemption_signal)
            except ValueError as e:  # not the main thread
                raise RuntimeError(f"cannot handle {sig.name} for preemption notices: {e}; call discover() from the "
                                   "main thread, or leave IFRT_PREEMPTION_SIGNALS unset") from None

    def _on_preemption_signal(self, signum: int, frame: object) -> None:
        if self._closed:  # nobody reports any more: the signal does what it would have done without ifrt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif self._signalled is not None:
            self._signalled.put(signum)  # SimpleQueue.put is safe in a signal handler; the thread does the rest

    def _report_signals(self, signalled: queue.SimpleQueue) -> None:
        while (signum := signalled.get()) is not None:
            if self._preempted.is_set() and self._sync_step is not None:
                continue
            log.warning("received %s: reporting a preemption notice; this process runs on until the preemption "
                        "sync point", signal.Signals(signum).name)
            try:
                self.report_preemption()
            except IfrtError as e:
                log.error("could not report the preemption notice: %s", e)

    def _unary(self, method: str, request: Callable[[float], Message], deadline: float, slack: float = 0.0) -> Any:
        """Calls ``method``, retrying what retrying can fix until ``deadline`` (plus ``slack`` for the answer)."""
        last_error: IfrtError | None = None
        wait_for_ready = len(self.settings.coordinators) == 1
        while (remaining := deadline - time.monotonic()) > 0:
            target = self.current_coordinator()
            try:
                answer = getattr(self.stub(target), method)(request(remaining), timeout=remaining + slack,
                                                            wait_for_ready=wait_for_ready)
            except grpc.RpcError as e:
                last_error = self._retryable(e, target)
                continue
            self._answered.add(target)
            return answer
        raise CoordinatorUnavailable(f"{method} did not reach the coordinator ({', '.join(self.settings.coordinators)})"
                                     f" in time; last error: {last_error}")

    # Connections.
    def current_coordinator(self) -> str:
        return self.settings.coordinators[self._current % len(self.settings.coordinators)]

    def rotate(self, failed: str) -> None:
        """Moves on to the next coordinator replica, if ``failed`` is still the current one."""
        with self._lock:
            if self.current_coordinator() == failed:
                self._current += 1

    def stub(self, target: str) -> CoordinatorStub:
        """The stub for ``target``; TransportMismatch at once when it speaks TLS and this process plaintext, or the
        reverse (instead of retrying until the timeout)."""
        with self._lock:
            stub = self._stubs.get(target)
        if stub is not None:
            return stub
        self._check_transport(target)
        with self._lock:
            stub = self._stubs.get(target)
            if stub is None:
                self._channels[target] = open_channel(target, self.settings, self.process_secret, CHANNEL_OPTIONS)
                stub = self._stubs[target] = CoordinatorStub(self._channels[target])
            return stub

    def _check_transport(self, target: str) -> None:
        if target in self._answered:
            return
        mismatch = transport_mismatch(target, self.settings.tls, client_cert=self.settings.tls_cert is not None)
        if mismatch is not None:
            raise TransportMismatch(mismatch)

    def _retryable(self, error: grpc.RpcError, target: str) -> IfrtError:
        """The typed error, raised if retrying cannot fix it; else returned after a backoff pause."""
        typed = from_rpc_error(error, target)
        if not typed.retryable:
            raise typed from None
        self._check_transport(target)
        self.rotate(target)
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            time.sleep(self.backoff.next())
        return typed

    # Closing.
    def close(self) -> None:
        """Leaves the cluster gracefully (peers see ProcessLeft), ends the session and closes the connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._session is not None:
            self._session.close()
        if self.topology is not None:
            target = self.current_coordinator()
            try:  # one attempt: a coordinator that is not there has nobody to tell
                self.stub(target).Leave(pb.LeaveRequest(client_uid=self.client_uid), timeout=LEAVE_TIMEOUT_S)
            except grpc.RpcError as e:
                log.info("could not tell the coordinator this process leaves: %s", from_rpc_error(e, target))
        with self._lock:
            watchers = list(self._watchers)
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        for events in watchers:
            events.put(_CLOSED)
        with self._lock:
            key_watchers, self._key_watchers = self._key_watchers, []
        for _, changes in key_watchers:
            changes.put(_CLOSED)
        if self._signalled is not None:
            self._signalled.put(None)
            for sig, handler in self._previous_handlers.items():
                with contextlib.suppress(ValueError, TypeError):  # not the main thread: the handler stays (see below)
                    signal.signal(sig, handler)
        for channel in channels:
            channel.close()
        if self.endpoint is not None:
            self.endpoint.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _until(items: queue.Queue, deadline: float | None) -> Iterator[Any]:
    """What arrives in ``items`` until ``deadline`` (None: no deadline) or until the client closes."""
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return
        try:
            item = items.get(timeout=remaining)
        except queue.Empty:
            return
        if item is _CLOSED:
            return
        yield item


def _progress(p: pb.Progress) -> Progress:
    return Progress(p.registered, p.expected, tuple(p.missing_process_ids), tuple(p.registered_hosts), p.waited_seconds)
