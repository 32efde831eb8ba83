"""The coordinator's decisions (admit, reject, assign, publish) as a deterministic state machine with no I/O.

    registering ──(the N-th distinct process is admitted)──▶ published (generation 1)

``register(registration, now)`` is the event; ``Waiting`` or ``Published`` is the output. A rejected event
raises a typed ``ifrt.errors`` error and leaves the state exactly as it was. Time arrives as data (``now``),
so replaying the same events gives the same state and byte-identical topology.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.assignment import assign_process_ids
from coordinator.registration import Registration
from ifrt.errors import ClusterMismatch, InvalidArgument, ProcessIdTaken
from ifrt.ids import MAX_PROCESSES, global_device_id
from ifrt.progress import Progress
from ifrt.records import Device, Process
from ifrt.wire import TopologyContent

FIRST_GENERATION = 1


@dataclass(frozen=True)
class ClusterConfig:
    """What the operator fixed for this cluster."""

    num_processes: int
    cluster_id: str = "default"
    max_processes: int = MAX_PROCESSES
    """Exclusive bound on process ids (2**14 keeps every global id within int32)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_processes <= self.max_processes:
            raise InvalidArgument(f"num_processes {self.num_processes} is out of range: expected 1 <= num_processes "
                                  f"<= {self.max_processes}")


@dataclass(frozen=True)
class Waiting:
    """Admitted; the topology is not complete yet."""

    registered: int
    expected: int


@dataclass(frozen=True)
class Published:
    """The topology is complete; ``process_id`` is the caller's."""

    process_id: int
    topology: TopologyContent


class ClusterState:
    """All registrations of one cluster and, once complete, its published topology."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._registrations: dict[str, Registration] = {}
        self._holder: dict[object, str] = {}  # claimed process id (or stable key) -> client uid
        self._explicit: bool | None = None
        self._missing_ids: set[int] = set(range(config.num_processes))
        self._first_registration_at: float | None = None
        self._process_ids: dict[str, int] = {}
        self.topology: TopologyContent | None = None

    @property
    def registered(self) -> int:
        return len(self._registrations)

    def register(self, registration: Registration, now: float) -> Waiting | Published:
        """Admits a process (or recognizes its retry); raises without changing anything if it does not fit."""
        known = self._registrations.get(registration.client_uid)
        if known is not None:
            if not registration.is_retry_of(known):
                raise ClusterMismatch(f"client {registration.client_uid} registered again with a different request "
                                      f"(first from {known.describe()}): a retry must repeat the first registration")
            return self._answer(registration.client_uid)
        self._check_fits(registration)
        claim = self._claim(registration)
        holder = self._holder.get(claim)
        if holder is not None:
            raise self._taken(registration, self._registrations[holder])
        if self.topology is not None:
            raise ClusterMismatch(f"the cluster is complete: all {self.config.num_processes} processes registered "
                                  f"and generation {FIRST_GENERATION} is published; {registration.describe()} "
                                  "is not one of them")
        self._admit(registration, claim, now)
        return self._answer(registration.client_uid)

    def progress(self, now: float) -> Progress:
        """Who has registered and who is missing, as of ``now``."""
        missing = tuple(sorted(self._missing_ids)) if self._explicit else ()
        waited = 0.0 if self._first_registration_at is None else max(0.0, now - self._first_registration_at)
        hosts = tuple(sorted({r.describe() for r in self._registrations.values()}))
        return Progress(self.registered, self.config.num_processes, missing, hosts, waited)

    def missing_count(self) -> int:
        return self.config.num_processes - self.registered

    def missing_ids_if_few(self, limit: int = 8) -> tuple[int, ...]:
        """The missing explicit process ids when there are at most ``limit`` (cheap for logging every event)."""
        if not self._explicit or len(self._missing_ids) > limit:
            return ()
        return tuple(sorted(self._missing_ids))

    def _check_fits(self, r: Registration) -> None:
        config = self.config
        if r.cluster_id and r.cluster_id != config.cluster_id:
            raise ClusterMismatch(f"{r.describe()} asked for cluster {r.cluster_id!r}; this coordinator serves "
                                  f"cluster {config.cluster_id!r}")
        if r.num_processes and r.num_processes != config.num_processes:
            raise ClusterMismatch(f"{r.describe()} expects {r.num_processes} processes; this coordinator's cluster "
                                  f"has {config.num_processes}")
        if r.process_id is not None:
            bound = min(config.num_processes, config.max_processes)
            if not 0 <= r.process_id < bound:
                raise InvalidArgument(f"process id {r.process_id} is out of range: expected 0 <= process_id < {bound} "
                                      f"(num_processes {config.num_processes}, id limit {config.max_processes})")
        explicit = r.process_id is not None
        if self._explicit is not None and explicit != self._explicit:
            if self._explicit:
                raise ClusterMismatch(f"{r.describe()} sent no process id, but this cluster uses explicit process "
                                      "ids: give every process an id, or none")
            raise ClusterMismatch(f"{r.describe()} sent process id {r.process_id}, but this cluster assigns process "
                                  "ids: give every process an id, or none")

    @staticmethod
    def _claim(r: Registration) -> object:
        return r.process_id if r.process_id is not None else r.stable_key

    @staticmethod
    def _taken(r: Registration, holder: Registration) -> ProcessIdTaken:
        if r.process_id is not None:
            return ProcessIdTaken(f"process id {r.process_id} is already registered by {holder.describe()}; "
                                  f"{r.describe()} cannot take it: give each process its own id")
        return ProcessIdTaken(f"{r.describe()} is already registered by another process: give each process on one "
                              "host its own local rank (IFRT_LOCAL_RANK), or explicit process ids")

    def _admit(self, r: Registration, claim: object, now: float) -> None:
        self._registrations[r.client_uid] = r
        self._holder[claim] = r.client_uid
        self._explicit = r.process_id is not None
        self._missing_ids.discard(r.process_id)
        if self._first_registration_at is None:
            self._first_registration_at = now
        if self.registered == self.config.num_processes:
            self._publish()

    def _publish(self) -> None:
        self._process_ids = assign_process_ids(self._registrations.values())
        processes, devices = [], []
        for uid, r in self._registrations.items():
            pid = self._process_ids[uid]
            processes.append(Process(pid, r.hostname, r.address))
            devices.extend(Device(global_device_id(pid, d.local_id, self.config.max_processes), pid, d.local_id,
                                  d.platform, d.kind, d.slice_index, d.attributes) for d in r.devices)
        self.topology = TopologyContent(self.config.cluster_id, FIRST_GENERATION, self.config.num_processes,
                                        tuple(sorted(processes, key=lambda p: p.process_id)),
                                        tuple(sorted(devices, key=lambda d: d.id)))

    def _answer(self, client_uid: str) -> Waiting | Published:
        if self.topology is None:
            return Waiting(self.registered, self.config.num_processes)
        return Published(self._process_ids[client_uid], self.topology)
