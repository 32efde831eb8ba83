"""Admission: who registered under which claim, the process ids fixed at publication, and the topology built from
them. Checks a registration against the cluster, admits it, recognizes its retry, or hands its claim over from a
dead holder (a restart). No I/O, no journal: the router (``ClusterState``) journals what this decides.

    (none) ──(admit)──▶ JOINING ──(the N-th registers: publish)──▶ ALIVE
       ▲                   │
       └───(forget)────────┘ (silent or gone before publication)

After publication, a registration for an id whose process is live (attended) is refused (ProcessIdTaken); one
for the id of a dead process takes it over (a restart), answered once no id of the generation is held by a
process known to be gone (failed or left); one for the id of a process that left, or while a process of the run
has left (the run is finishing), waits for the job's next run (``coordinator.core.runs``).
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass, replace

from coordinator.core.assignment import assign_process_ids
from coordinator.core.attempts import check_attempt
from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import Admitted, Published, Waiting
from coordinator.core.limits import exhausted
from coordinator.core.members import Member, Status, claim_of, retire
from coordinator.core.registration import Registration, registration_cost
from ifrt.errors import (
    ClusterMismatch,
    IfrtError,
    InvalidArgument,
    PermissionDenied,
    ProcessDeclaredFailed,
    ProcessIdTaken,
    UnknownClient,
)
from ifrt.ids import LOCAL_ID_BITS
from ifrt.progress import Progress
from ifrt.records import Device, Process, TopologyContent

FIRST_GENERATION = 1
MISSING_IDS_LOGGED = 8
"""Missing explicit process ids an admission names (cheap enough to log every admission)."""


@dataclass(frozen=True)
class Retry:
    """The registration repeats an admitted one: answer it again."""

    member: Member


@dataclass(frozen=True)
class Takeover:
    """The claim's holder is dead and the topology published: the newcomer takes over its process id."""

    holder: Member


@dataclass(frozen=True)
class Attaching:
    """The claim's holder was answered with the topology and its session is on its way: the newcomer waits."""

    holder: Member


@dataclass(frozen=True)
class NextRun:
    """The claim's process left on purpose, or the run is finishing: the registration waits for the next run."""

    holder: Member


@dataclass(frozen=True)
class Joined:
    """A new member was admitted; ``completed`` when it was the last one and generation 1 was built."""

    member: Member
    completed: bool


class Admission:
    """Every registration of one cluster (failed and replaced incarnations too), and the current topology."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.topology: TopologyContent | None = None
        self.members: dict[str, Member] = {}  # by client uid, including failed and replaced incarnations
        self.holder: dict[object, str] = {}  # claim (process id or stable key) -> uid of its current incarnation
        self.process_ids: dict[object, int] = {}  # claim -> process id, fixed at publication
        self.claims: dict[int, object] = {}  # process id -> claim
        self.in_topology: set[int] = set()  # process ids in the current generation
        self._explicit: bool | None = None
        self._first_registration_at: float | None = None
        self._missing_ids: set[int] = set(range(config.num_processes))  # explicit ids not held yet
        self._replaced: dict[object, str] = {}  # claim -> uid of the one replaced incarnation kept (see retire)
        self.held = 0
        """Bytes of registrations admitted in this job attempt (each journaled for good), as
        ``--max-registration-bytes`` counts them."""
        self.held_since: dict[object, float] = {}  # claim -> when its current incarnation registered
        self.pending: set[str] = set()  # restarted processes not answered yet: an id of the run is held by a gone one
        self.left: set[int] = set()  # process ids whose process left on purpose: they do not come back into this run
        self.granted: dict[int, tuple[str, str]] = {}  # process id -> the (hostname, address) that alone may take it

    @property
    def registered(self) -> int:
        return len(self.holder)

    def admit(self, r: Registration, now: float, attempt: int, *,
              restoring: bool = False) -> Retry | Takeover | NextRun | Attaching | Joined:
        """Decides what a registration is (``attempt``: the job's current one); a new member is admitted here, a
        takeover is left to ``take_over``. ``restoring``: replayed from the journal, where it was admitted under
        the limits of its time (none is checked again)."""
        known = self.members.get(r.client_uid)
        if known is not None:
            self.check_owner(known, r.secret_hash)
            if known.replaced:  # its request is no longer kept to compare: it ended either way
                check_usable(known)
            if not r.is_retry_of(known.registration):
                raise ClusterMismatch(f"client {r.client_uid} registered again with a different request (first from "
                                      f"{known.registration.describe()}): a retry must repeat the first registration")
            check_usable(known)
            known.last_seen = now
            return Retry(known)
        self._check_fits(r, attempt)
        if not restoring:
            self._check_room(r)
        claim = claim_of(r)
        holder_uid = self.holder.get(claim)
        if holder_uid is not None:
            holder = self.members[holder_uid]
            if holder.live and not restoring and self._answering(holder, now):  # a replay was admitted then
                if holder.attaching and not holder.calls and not holder.sessions:
                    return Attaching(holder)
                raise _taken(r, holder, now - self.held_since.get(claim, now), now)
            if self.topology is not None:
                if holder.status is Status.LEFT or self.finishing():
                    return NextRun(holder)
                return Takeover(holder)
            del self.members[holder_uid]  # a dead registration before publication: the newcomer replaces it
        elif self.topology is not None:
            raise ClusterMismatch(f"the cluster is complete: all {self.config.num_processes} processes registered "
                                  f"and generation {self.topology.generation} is published; {r.describe()} is not "
                                  f"one of them: is another job using this coordinator? {ANOTHER_JOB}")
        member = self.members[r.client_uid] = Member(r, Status.JOINING, now)
        self.held += registration_cost(r)
        self.holder[claim] = r.client_uid
        self.held_since[claim] = now
        self._missing_ids.discard(r.process_id)  # type: ignore[arg-type]
        self._explicit = r.process_id is not None
        if self._first_registration_at is None:
            self._first_registration_at = now
        completed = len(self.holder) == self.config.num_processes
        if completed:
            self._publish_first()
        return Joined(member, completed)

    def take_over(self, r: Registration, holder: Member, now: float) -> tuple[int, Member]:
        """The restarted process ``r`` replaces ``holder`` under its process id; returns the id and the new member."""
        claim = claim_of(r)
        if holder.live:
            holder.status, holder.reason = Status.FAILED, f"replaced by a restarted process from {r.describe()}"
        retire(holder)
        if (older := self._replaced.get(claim)) is not None:
            del self.members[older]  # its client is told it is unknown, and to register again
        self._replaced[claim] = holder.uid
        member = self.members[r.client_uid] = Member(r, Status.ALIVE, now, incarnation=holder.incarnation + 1)
        self.held += registration_cost(r)
        self.holder[claim] = r.client_uid
        self.held_since[claim] = now
        pid = self.process_ids[claim]
        self.in_topology.add(pid)
        return pid, member

    def grant(self, process_ids: tuple[int, ...], where: tuple[str, str]) -> None:
        """From now on only processes registered from ``where`` (hostname, address: a spare host's workers, see
        coordinator.core.takeover) may take these ids, naming them explicitly: with assigned ids, each id's claim
        becomes the id itself (its past incarnations keep their old claim, which still names the id)."""
        for pid in process_ids:
            self.granted[pid] = where
            old = self.claims[pid]
            if old == pid:
                continue
            self.claims[pid] = self.process_ids[pid] = pid
            for held in (self.holder, self.held_since, self._replaced):
                if old in held:
                    held[pid] = held.pop(old)  # type: ignore[index]

    @property
    def names_ids(self) -> bool:
        """Whether the job's processes name their ids (explicit), rather than having them assigned."""
        return bool(self._explicit)

    def ids_from(self, where: tuple[str, str], *, dropped: bool = False) -> tuple[int, ...]:
        """The process ids of the current generation whose process registered from ``where`` (hostname, address);
        with ``dropped``, also those a generation dropped (the elastic policy takes them back when they return)."""
        ids = (pid for pid in self.claims if pid not in self.left) if dropped else self.in_topology
        return tuple(pid for pid in sorted(ids) if (m := self.member_of(pid)) is not None
                     and (m.registration.hostname, m.registration.host_address) == where)

    def forget(self, member: Member) -> None:
        """Drops a registration made before publication."""
        r = member.registration
        claim = claim_of(r)
        if self.holder.get(claim) == r.client_uid:
            del self.holder[claim]
            self.held_since.pop(claim, None)
            if r.process_id is not None:
                self._missing_ids.add(r.process_id)
        del self.members[r.client_uid]

    def admitted(self, r: Registration) -> Admitted:
        """The log's view of an admission: how many are in, and who is missing when few are."""
        missing = () if not self._explicit or len(self._missing_ids) > MISSING_IDS_LOGGED else tuple(
            sorted(self._missing_ids))
        return Admitted(r, len(self.holder), self.config.num_processes, missing)

    def answer(self, r: Registration, admitted: Admitted | None = None) -> Waiting | Published:
        """What a registration is answered now: progress, or its process id in the published topology."""
        if self.topology is None:
            return Waiting(len(self.holder), self.config.num_processes, admitted)
        if r.client_uid in self.pending:  # a restart waiting for the gone processes of the run to come back
            return Waiting(len(self.in_topology - self.gone()), self.config.num_processes, admitted)
        return Published(self.process_ids[claim_of(r)], self.topology, admitted)

    def waited_s(self, now: float) -> float:
        """How long since the first registration (0 before any)."""
        return 0.0 if self._first_registration_at is None else max(0.0, now - self._first_registration_at)

    def missing_ids(self) -> tuple[int, ...]:
        """The explicit process ids nobody holds yet (empty when ids are assigned)."""
        return tuple(sorted(self._missing_ids)) if self._explicit else ()

    def progress(self, now: float) -> Progress:
        """Who has registered and who is missing, as of ``now``."""
        joined = [self.members[uid].registration for uid in self.holder.values()]
        hosts = tuple(sorted({r.describe() for r in joined}))
        return Progress(len(joined), self.config.num_processes, self.missing_ids(), hosts, self.waited_s(now))

    def member_of(self, process_id: int) -> Member | None:
        """The current incarnation of ``process_id`` (None if no process holds it)."""
        claim = self.claims.get(process_id)
        return None if claim is None else self.members[self.holder[claim]]

    def process_id(self, member: Member) -> int:
        return self.process_ids[claim_of(member.registration)]

    def describe_process(self, process_id: int) -> str:
        """``2 (host-c (10.0.0.3))``, for messages."""
        member = self.member_of(process_id)
        return str(process_id) if member is None else f"{process_id} ({member.registration.describe()})"

    def check_owner(self, member: Member, proof: str) -> None:
        """PermissionDenied unless ``proof`` matches the secret the process registered with (if it gave one)."""
        expected = member.registration.secret_hash
        if expected and not hmac.compare_digest(expected, proof):
            pid = self.process_ids.get(claim_of(member.registration))
            who = f"process {pid}" if pid is not None else member.registration.describe()
            raise PermissionDenied(f"this call acts for {who} but does not carry its process secret "
                                   f"({'none was sent' if not proof else 'another was sent'}): only the process "
                                   "that registered may act for it")

    def _answering(self, member: Member, now: float) -> bool:
        """Whether ``member`` is known to live now: a call in flight, a session that is not overdue (its heartbeats,
        where its client sends them, not missed), or answered with the topology and not attached yet (its session
        is on its way: a second launch of the job must not take its id in that moment). A process whose session
        ended, or that the coordinator declared failed, may be restarted; so may one a replica that took over only
        replayed (it vouches for no session it did not see)."""
        if member.calls:
            return True
        if not member.sessions:
            return member.attaching and member.status is Status.ALIVE
        return member.heard_at is None or now - member.heard_at <= self.config.unanswered_after_s

    def gone(self) -> set[int]:
        """The process ids of the current generation held by a process that failed or left."""
        return {pid for pid in self.in_topology if (m := self.member_of(pid)) is None or not m.live}

    def finishing(self) -> bool:
        """Whether a process of the current generation left on purpose: the run publishes no generation any more
        (its registrations wait for the next run)."""
        return any(pid in self.in_topology for pid in self.left)

    def check_fits(self, r: Registration, attempt: int) -> None:
        """The checks of ``admit`` that depend on the configuration, the members and the registration budget
        (ClusterMismatch, InvalidArgument or ResourceExhausted), changing nothing."""
        self._check_fits(r, attempt)
        self._check_room(r)

    def why_left_out(self, client_uid: str) -> IfrtError:
        """The answer of a caller left out of the agreement: it failed, left or was replaced while it waited."""
        member = self.members.get(client_uid)
        if member is None:
            return UnknownClient(f"client {client_uid} is not a registered process of the published topology")
        try:
            check_usable(member)
        except IfrtError as e:
            return e
        return ProcessDeclaredFailed(f"this process ({member.registration.describe()}) no longer holds its id")

    def survivors_suffice(self, process_id: int) -> bool:
        """Whether dropping ``process_id`` from the topology leaves at least ``min_processes`` in it."""
        return process_id in self.in_topology and len(self.in_topology) - 1 >= self.config.min_processes

    def drop(self, *process_ids: int) -> TopologyContent | None:
        """Drops ``process_ids`` from the topology (the elastic policy, a shrink); returns the next generation if it
        changed."""
        self.in_topology.difference_update(process_ids)
        return self.republish_if_changed()

    def republish_if_changed(self) -> TopologyContent | None:
        """The next generation when the current members make another topology than the published one."""
        assert self.topology is not None
        same_generation = self._build(self.topology.generation)
        if same_generation == self.topology:
            return None
        self.topology = replace(same_generation, generation=self.topology.generation + 1)
        return self.topology

    def _publish_first(self) -> None:
        holders = {uid: claim for claim, uid in self.holder.items()}
        ids = assign_process_ids(self.members[uid].registration for uid in holders)
        self.process_ids = {holders[uid]: pid for uid, pid in ids.items()}
        self.claims = {pid: claim for claim, pid in self.process_ids.items()}
        for uid in holders:
            self.members[uid].status = Status.ALIVE
        self.in_topology = set(ids.values())
        self.topology = self._build(FIRST_GENERATION)

    def _build(self, generation: int) -> TopologyContent:
        """The topology of the current members (ids and fields were checked at registration)."""
        members = {self.process_ids[claim]: self.members[uid].registration for claim, uid in self.holder.items()}
        members = {pid: r for pid, r in members.items() if pid in self.in_topology}
        slice_keys = sorted({d.slice_key for r in members.values() for d in r.devices}, key=_natural)
        slice_index = {key: i for i, key in enumerate(slice_keys)}
        processes, devices = [], []
        trusted = Device.trusted
        for pid in sorted(members):  # by process id, and each registration's devices by local id: sorted by id
            r = members[pid]
            processes.append(Process(pid, r.hostname, r.address, r.network))
            first = pid << LOCAL_ID_BITS
            devices.extend(trusted(first | d.local_id, pid, d.local_id, d.platform, d.kind,
                                   slice_index[d.slice_key], d.attributes, r.plugin, d.coordinates)
                           for d in r.devices)
        return TopologyContent(self.config.cluster_id, generation, len(processes), tuple(processes), tuple(devices))

    def _check_room(self, r: Registration) -> None:
        """ResourceExhausted unless one more registration fits within ``--max-registration-bytes``."""
        limits = self.config.limits
        if self.held + registration_cost(r) > limits.registration_bytes:
            raise exhausted(f"the registration of {r.describe()} ({registration_cost(r)} bytes)",
                            limits.registration_bytes, "registration_bytes",
                            "every registration of this job attempt is kept (a restarted process's too): restart "
                            "the job as a new attempt, or raise the flag", self.held)

    def _check_fits(self, r: Registration, attempt: int) -> None:
        config = self.config
        if r.cluster_id and r.cluster_id != config.cluster_id:
            raise ClusterMismatch(f"{r.describe()} asked for cluster {r.cluster_id!r}; this coordinator serves "
                                  f"cluster {config.cluster_id!r}")
        check_attempt(r, attempt, config.cluster_id)
        if r.num_processes and r.num_processes != config.num_processes:
            raise ClusterMismatch(f"{r.describe()} expects {r.num_processes} processes; this coordinator's cluster "
                                  f"has {config.num_processes}")
        if r.process_id is not None:
            bound = min(config.num_processes, config.max_processes)
            if not 0 <= r.process_id < bound:
                raise InvalidArgument(f"process id {r.process_id} is out of range: expected 0 <= process_id < {bound} "
                                      f"(num_processes {config.num_processes}, id limit {config.max_processes})")
        if not config.allow_mixed_platforms and self.holder:
            first = self.members[next(iter(self.holder.values()))].registration
            same = first.devices is r.devices and first.plugin == r.plugin  # equal device lists are shared
            if not same and _platform(first) != _platform(r):
                raise ClusterMismatch(f"{r.describe()} uses plugin {r.plugin!r} with platforms "
                                      f"{sorted(_platform(r)[1])}, but {first.describe()} uses plugin "
                                      f"{first.plugin!r} with platforms {sorted(_platform(first)[1])}: start the "
                                      "coordinator with --allow-mixed-platforms to allow mixed clusters")
        explicit = r.process_id is not None
        if (where := self.granted.get(r.process_id)) is not None and (r.hostname, r.host_address) != where:  # type: ignore[arg-type]
            raise PermissionDenied(f"process id {r.process_id} was handed to the spare host {where[0]} ({where[1]}) "
                                   f"when its host was lost: {r.describe()} may not take it (only that host's "
                                   "workers may)")
        if self._explicit is not None and explicit != self._explicit and not (explicit and where is not None):
            if self._explicit:
                raise ClusterMismatch(f"{r.describe()} sent no process id, but this cluster uses explicit process "
                                      "ids: give every process an id, or none")
            raise ClusterMismatch(f"{r.describe()} sent process id {r.process_id}, but this cluster assigns process "
                                  "ids: give every process an id, or none")


def check_usable(member: Member) -> None:
    """ProcessDeclaredFailed unless the process is joining or alive."""
    if not member.live:
        raise ProcessDeclaredFailed(f"this process ({member.registration.describe()}) was declared "
                                    f"{member.status.value}: {member.reason}; restart it to rejoin")


def _platform(r: Registration) -> tuple[str, frozenset[str]]:
    return r.plugin, frozenset(d.platform for d in r.devices)


def _natural(key: str) -> tuple:
    """Sort key that puts "slice-2" before "slice-10"; total: keys equal as numbers ("slice-1", "slice-01") fall
    back to the text itself, so no order is left to set iteration (which changes with the hash seed)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)), key


ANOTHER_JOB = "give it its own --cluster-id or coordinator"
"""The advice for a registration that another job's live processes stand in the way of."""


def _taken(r: Registration, member: Member, held_s: float, now: float) -> ProcessIdTaken:
    holder = member.registration
    attaching = "" if not member.attaching or member.calls else (
        f"; it was answered {max(0.0, now - member.last_seen):.2f}s ago and has not attached its session yet (a "
        "restart of it is admitted once its session ended or the coordinator declared it failed)")
    held = (f"held by a live process on {holder.hostname} ({holder.host_address or 'no address'}) since "
            f"{max(0.0, held_s):.1f}s ago{attaching}: is another job using this coordinator? {ANOTHER_JOB}")
    if r.process_id is not None:
        return ProcessIdTaken(f"process id {r.process_id} is already registered by {holder.describe()}, which is "
                              f"alive ({held}); {r.describe()} cannot take it. Within one job, give each process "
                              "its own id")
    return ProcessIdTaken(f"{r.describe()} is already registered by another live process ({held}). Within one job, "
                          "give each process on one host its own local rank (IFRT_LOCAL_RANK), or explicit process ids "
                          "(two `ifrt run` agents on one machine: --host-rank R --num-hosts H each)")
