"""The coordinator's decisions as a deterministic state machine with no I/O.

One process's life, as the coordinator sees it:

    JOINING ──(the N-th process registers: generation 1 published)──▶ ALIVE ──(leave)──▶ LEFT
       │                                                                │
       └─(silent for the grace before publication: forgotten)           ├─(silent for the grace)──▶ FAILED
                                                                        └─(a new process takes its id)──▶ restarted

Every method is an event (time arrives as data, ``now``) and returns its effects for the shell to carry out
(notify sessions, publish a new generation, resolve barriers). A rejected event raises a typed
``ifrt.errors`` error and leaves the state exactly as it was. Every durable decision is also written to a
journal (``take_journal``), which the shell persists before acknowledging; ``replay`` of those entries
gives the same state and byte-identical topologies, on this coordinator or on the one that takes over.
"""

from __future__ import annotations

import enum
import hmac
import math
import re
from dataclasses import dataclass, replace

from coordinator import journal
from coordinator.agreement import LiveSetResolved, LiveSets, Members
from coordinator.assignment import assign_process_ids
from coordinator.barriers import BarrierResolved, Barriers
from coordinator.history import CatchUp, GenerationPublished, History, Numbered, Snapshot
from coordinator.kv import KeyValueStore
from coordinator.limits import DEFAULT_LIMITS, Limits, check_call_id
from coordinator.preemption import Preemption, PreemptionResolved
from coordinator.registration import Registration
from coordinator.status import DEGRADED, PUBLISHED, WAITING, ProcessReport, StatusReport
from ifrt import wire
from ifrt.errors import (
    ERROR_CLASSES,
    ClusterMismatch,
    IfrtError,
    InvalidArgument,
    PermissionDenied,
    ProcessDeclaredFailed,
    ProcessIdTaken,
    UnknownClient,
)
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.ids import LOCAL_ID_BITS, MAX_PROCESSES
from ifrt.progress import Progress
from ifrt.records import Device, Process
from ifrt.wire import TopologyContent

FIRST_GENERATION = 1
ANSWERS_REMEMBERED = 64
"""Increments and swaps remembered per client for its retries (a client retries only its calls in flight)."""
AGENT_KEY_PREFIX = "torchrun/"
"""Keys that callers which are no process of the topology may use too: torchrun's agents meet there before any
worker exists (``ifrt.torchrun``). The cluster token still guards them, and the store's limits bound them."""
AGENTS_REMEMBERED = 1024
"""Such callers whose increments and swaps are remembered for retries (the oldest is forgotten past this)."""


class FailurePolicy(enum.StrEnum):
    PROPAGATE = "propagate"
    """A failed process is reported to all others; the topology stays as it is."""
    ELASTIC = "elastic"
    """A failed process is dropped and a new generation over the survivors is published (down to a minimum)."""


@dataclass(frozen=True)
class ClusterConfig:
    """What the operator fixed for this cluster."""

    num_processes: int
    cluster_id: str = "default"
    max_processes: int = MAX_PROCESSES
    """Exclusive bound on process ids (2**14 keeps every global id within int32)."""
    heartbeat_timeout_s: float = 10.0
    """A process silent this long (its connection's keepalive pings unanswered, or its session ended and it did not
    attach again) is failed; before publication, its registration is forgotten."""
    on_failure: FailurePolicy = FailurePolicy.PROPAGATE
    min_processes: int = 1
    """With the elastic policy: fewest processes a new generation may have."""
    limits: Limits = DEFAULT_LIMITS
    """What callers may send: sizes and counts of requests, registrations, key-values and barrier names."""
    allow_mixed_platforms: bool = False
    """Whether processes with different device plugins or platforms may form one cluster."""
    attempt: int = 0
    """The job attempt this coordinator serves (``--attempt``); a process of another attempt is refused."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_processes <= self.max_processes:
            raise InvalidArgument(f"num_processes {self.num_processes} is out of range: expected 1 <= num_processes "
                                  f"<= {self.max_processes}")
        if not 1 <= self.min_processes <= self.num_processes:
            raise InvalidArgument(f"min_processes {self.min_processes} is out of range: expected 1 <= min_processes "
                                  f"<= num_processes ({self.num_processes})")
        if not self.heartbeat_timeout_s > 0:
            raise InvalidArgument(f"heartbeat timeout {self.heartbeat_timeout_s} is not positive: expected seconds > 0")

    # Liveness rides on each connection's HTTP/2 keepalive (coordinator/config.py). A process that goes silent is
    # noticed at most interval + keepalive timeout later (its connection is dropped and its session ends), then has
    # the reconnect grace to attach again: the three add up to the heartbeat timeout. Pings are what an idle session
    # costs, so the interval takes the largest share; a killed process's connection closes at once, so it is
    # reported after the grace alone.
    @property
    def heartbeat_interval_s(self) -> float:
        """How often the coordinator pings each connection (HTTP/2 keepalive): twice per timeout."""
        return self.heartbeat_timeout_s / 2

    @property
    def keepalive_timeout_s(self) -> float:
        """How long a ping may go unanswered before the coordinator drops the connection (ending its session): 3/8
        of the timeout, so a peer whose gRPC core is slow to answer (a host busy with a registration storm) keeps
        its session."""
        return self.heartbeat_timeout_s * 3 / 8

    @property
    def reconnect_grace_s(self) -> float:
        """How long a process whose session ended has to attach again before it is failed: what the timeout leaves
        (1/8 of it) once a dropped connection was noticed, so a silent process is failed within the timeout. A
        client re-attaches within about 0.1 s of its connection closing."""
        return self.heartbeat_timeout_s - self.heartbeat_interval_s - self.keepalive_timeout_s

    @property
    def catching_up_s(self) -> float:
        """How recently a Register call or a session must have arrived for the coordinator to count itself as still
        working through a burst of them (see ClusterState.tick)."""
        return min(1.0, self.heartbeat_timeout_s / 10)

    @property
    def catching_up_limit_s(self) -> float:
        """The longest a silent process is spared while the coordinator catches up: three timeouts."""
        return 3 * self.heartbeat_timeout_s


class Status(enum.Enum):
    JOINING = "joining"
    ALIVE = "alive"
    FAILED = "failed"
    LEFT = "left"


@dataclass
class Member:
    """One process incarnation: its registration and its liveness."""

    registration: Registration
    status: Status
    last_seen: float
    incarnation: int = 0
    calls: int = 0  # Register calls in flight: the process is waiting on us, so it is alive
    sessions: int = 0  # open session streams (two overlap briefly when a client reconnects); keepalive vouches for each
    reason: str = ""
    grace_s: float | None = None  # how long it may stay silent without a call or session; None: the heartbeat timeout


# Outputs, besides the answers returned to the caller.
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


@dataclass(frozen=True)
class Notify:
    """Effect: tell every live session about ``event``, job event number ``number``."""

    event: ProcessFailed | ProcessRestarted | ProcessLeft | PreemptionNotice
    number: int = 0


@dataclass(frozen=True)
class Republish:
    """Effect: a new generation; send it to every live session."""

    topology: TopologyContent
    number: int = 0
    """The job event number of its publication."""


@dataclass(frozen=True)
class Evict:
    """Effect: close this client's session, telling it why."""

    client_uid: str
    reason: str


@dataclass(frozen=True)
class Forgotten:
    """Effect (for the log): a registration dropped before publication."""

    who: str
    reason: str


@dataclass(frozen=True)
class KeyChanged:
    """Effect: ``key`` now holds ``value`` (None: deleted); tell the sessions that watch a prefix of it."""

    key: str
    value: bytes | None


Effect = Notify | Republish | Evict | Forgotten | BarrierResolved | KeyChanged | LiveSetResolved | PreemptionResolved


class ClusterState:
    """All processes of one cluster, their liveness, the published generation, barriers and key-values."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._barriers = Barriers(config.limits)
        self._kv = KeyValueStore(config.limits)
        self.topology: TopologyContent | None = None
        self._members: dict[str, Member] = {}  # by client uid, including failed and replaced incarnations
        self._holder: dict[object, str] = {}  # claim (process id or stable key) -> uid of its current incarnation
        self._explicit: bool | None = None
        self._first_registration_at: float | None = None
        self._missing_ids: set[int] = set(range(config.num_processes))  # explicit ids not held yet
        self._process_ids: dict[object, int] = {}  # claim -> process id, fixed at publication
        self._claims: dict[int, object] = {}  # process id -> claim
        self._in_topology: set[int] = set()  # process ids in the current generation
        self._down: dict[int, str] = {}  # process id -> why it is unavailable (failed or left)
        self._live_sets = LiveSets()
        self._answers: dict[str, dict[str, int | bytes]] = {}  # client uid -> request id -> its answer (sum, value)
        self._agents: dict[str, None] = {}  # callers that are no process, least recently answered first
        self._preemption: Preemption | None = None
        self._journal: list[journal.Entry] = []
        self._history = History(config.limits.event_history)
        self.published_at = 0
        """The job event number that published the current generation."""
        self._incarnated_at: dict[int, int] = {}  # process id -> event number of its latest restart
        # Joining or alive processes that neither hold a session nor wait in a call, oldest first: the only ones
        # the tick looks at (keepalive vouches for the others), so an idle cluster's tick costs nothing per process.
        self._unattended: dict[str, None] = {}
        self._last_arrival = -math.inf  # when the latest Register call or session arrived

    # Journal.
    def take_journal(self) -> list[journal.Entry]:
        """The durable decisions made since the last call, in order, for the shell to persist."""
        entries, self._journal = self._journal, []
        return entries

    def replay(self, entry: journal.Entry) -> None:
        """Applies one journaled decision again (on restart or takeover); nothing is journaled anew."""
        match entry:
            case journal.Registered(registration=r, now=now):
                self.register(r, now)
            case journal.Failed(client_uid=uid, why=why):
                self._fail(self._members[uid], why)
            case journal.Left(client_uid=uid):
                self._leave(self._members[uid])
            case journal.Forgot(client_uid=uid, why=why):
                self._forget(self._members[uid], why)
            case journal.KeySet(key=key, value=value):
                self._kv.restore(key, value)
            case journal.BarrierFinished(name=name, participants=participants, error_type=kind, error=message):
                error = ERROR_CLASSES[kind](message) if kind else None
                self._barriers.restore(name, frozenset(participants), error)
            case journal.KeyIncremented(key=key, value=value, client_uid=uid, request_id=request_id):
                self._kv.restore(key, str(value).encode())
                self._remember(uid, request_id, value)
            case journal.KeySwapped(key=key, value=value, client_uid=uid, request_id=request_id):
                self._kv.restore(key, value)
                self._remember(uid, request_id, value)
            case journal.KeysDeleted(key=key, prefix=prefix):
                self._kv.delete(key, prefix)
            case journal.LiveSetDecided(callers=callers, members=members, error_type=kind, error=message):
                self._live_sets.restore(callers, members, ERROR_CLASSES[kind](message) if kind else None)
            case journal.PreemptionNoticed(process_id=pid):
                self._preemption = Preemption(pid)
                self._history.add(PreemptionNotice(pid))
            case journal.PreemptionSyncDecided(step=step):
                assert self._preemption is not None
                self._preemption.sync_step = step
        self._journal.clear()

    def reset_liveness(self, now: float) -> None:
        """After a replay: nobody is attached yet, and every live process has the grace period from ``now``."""
        for member in self._members.values():
            member.calls = member.sessions = 0
            member.last_seen, member.grace_s = now, None
        self._unattended = dict.fromkeys(uid for uid, m in self._members.items()
                                         if m.status in (Status.JOINING, Status.ALIVE))

    # Registration.
    @property
    def registered(self) -> int:
        return len(self._holder)

    def register(self, r: Registration, now: float) -> tuple[Waiting | Published, list[Effect]]:
        """Admits a process, recognizes its retry, or takes over the id of a dead one (a restart)."""
        known = self._members.get(r.client_uid)
        if known is not None:
            self._check_owner(known, r.secret_hash)
            if not r.is_retry_of(known.registration):
                raise ClusterMismatch(f"client {r.client_uid} registered again with a different request (first from "
                                      f"{known.registration.describe()}): a retry must repeat the first registration")
            self._check_usable(known)
            known.last_seen = now
            return self._answer(r), []
        self._check_fits(r)
        claim = _claim(r)
        holder_uid = self._holder.get(claim)
        if holder_uid is not None:
            holder = self._members[holder_uid]
            if holder.status in (Status.JOINING, Status.ALIVE) and (holder.calls or holder.sessions):
                raise _taken(r, holder.registration)
            if self.topology is not None:
                self._journal.append(journal.Registered(r, now))
                return self._restart(r, holder, now)
            del self._members[holder_uid]  # a dead registration before publication: the newcomer replaces it
        elif self.topology is not None:
            raise ClusterMismatch(f"the cluster is complete: all {self.config.num_processes} processes registered "
                                  f"and generation {self.topology.generation} is published; {r.describe()} is not "
                                  "one of them")
        self._journal.append(journal.Registered(r, now))
        self._add_member(Member(r, Status.JOINING, now))
        self._holder[claim] = r.client_uid
        self._missing_ids.discard(r.process_id)  # type: ignore[arg-type]
        self._explicit = r.process_id is not None
        if self._first_registration_at is None:
            self._first_registration_at = now
        if len(self._holder) == self.config.num_processes:
            self._publish_first()
        return self._answer(r), []

    def answer(self, client_uid: str, now: float) -> Waiting | Published:
        """What a registered process's waiting call answers now; UnknownClient if it was forgotten meanwhile,
        ProcessDeclaredFailed if it failed or was replaced while it waited."""
        member = self._members.get(client_uid)
        if member is None:
            raise UnknownClient(f"client {client_uid} is not registered (its registration was forgotten): register "
                                "again")
        self._check_usable(member)
        member.last_seen = now
        return self._answer(member.registration)

    def progress(self, now: float) -> Progress:
        """Who has registered and who is missing, as of ``now``."""
        joined = [self._members[uid].registration for uid in self._holder.values()]
        missing = tuple(sorted(self._missing_ids)) if self._explicit else ()
        waited = 0.0 if self._first_registration_at is None else max(0.0, now - self._first_registration_at)
        hosts = tuple(sorted({r.describe() for r in joined}))
        return Progress(len(joined), self.config.num_processes, missing, hosts, waited)

    def missing_ids_if_few(self, limit: int = 8) -> tuple[int, ...]:
        """The missing explicit process ids when there are at most ``limit`` (cheap enough to log every event)."""
        if not self._explicit or len(self._missing_ids) > limit:
            return ()
        return tuple(sorted(self._missing_ids))

    # Liveness. A process is alive while it holds a session (the connection's keepalive vouches for it: a silent
    # peer's connection is dropped, which ends the session) or waits in a Register call; otherwise it is on the
    # clock, and failed (forgotten, before publication) once silent beyond its grace.
    def call_started(self, client_uid: str, now: float) -> None:
        """A Register call of this client is in flight (it is alive while it waits on us)."""
        self._last_arrival = now
        member = self._members.get(client_uid)
        if member is not None:
            member.calls += 1
            member.last_seen = now
            self._unattended.pop(client_uid, None)

    def call_ended(self, client_uid: str, now: float) -> None:
        """The call answered: without a session, the process has the heartbeat timeout to call or attach again."""
        member = self._members.get(client_uid)
        if member is not None:
            member.calls = max(0, member.calls - 1)
            member.last_seen = now
            if not member.calls and not member.sessions:
                self._start_clock(member, None)

    def attach(self, client_uid: str, now: float, *, proof: str = "") -> int:
        """A session opened; returns the process id. UnknownClient, PermissionDenied or ProcessDeclaredFailed if it
        may not."""
        member = self._members.get(client_uid)
        if member is None or self.topology is None or member.status is Status.JOINING:
            raise UnknownClient(f"client {client_uid} is not a registered process of the published topology "
                                "(the coordinator may have restarted): register again")
        self._check_owner(member, proof)
        self._check_usable(member)
        self._last_arrival = now
        member.sessions += 1
        member.last_seen = now
        self._unattended.pop(client_uid, None)
        return self._process_ids[_claim(member.registration)]

    def heartbeat(self, client_uid: str, now: float) -> None:
        """A Heartbeat message (clients send them as rarely as ``attached`` asks): a sign of life, nothing more."""
        member = self._members.get(client_uid)
        if member is not None:
            member.last_seen = now

    def detach(self, client_uid: str, now: float) -> None:
        """A session ended (closed, or its connection dropped): unless another is open, the process has the
        reconnect grace to attach again."""
        member = self._members.get(client_uid)
        if member is not None:
            member.sessions = max(0, member.sessions - 1)
            member.last_seen = now
            if not member.sessions and not member.calls:
                self._start_clock(member, self.config.reconnect_grace_s)

    def _add_member(self, member: Member) -> None:
        """A new registration or incarnation: on the clock until a call or a session vouches for it."""
        self._members[member.registration.client_uid] = member
        self._start_clock(member, None)

    def _start_clock(self, member: Member, grace_s: float | None) -> None:
        member.grace_s = grace_s
        uid = member.registration.client_uid
        self._unattended.pop(uid, None)  # re-added last: the dict stays ordered by when each went silent
        self._unattended[uid] = None

    def leave(self, client_uid: str, now: float, *, proof: str = "") -> list[Effect]:
        """A graceful exit: the process is reported as left (and dropped, with the elastic policy). Leaving again
        is a no-op; UnknownClient for a client that never registered, PermissionDenied for a caller that does
        not own the process."""
        member = self._members.get(client_uid)
        if member is None:
            raise UnknownClient(f"client {client_uid} is not a registered process: nothing to leave")
        self._check_owner(member, proof)
        return self._leave(member) + self._settle(now)

    def _leave(self, member: Member) -> list[Effect]:
        client_uid = member.registration.client_uid
        if member.status in (Status.FAILED, Status.LEFT):
            return []
        if member.status is Status.JOINING:
            return self._forget(member, "left before the topology was published")
        self._journal.append(journal.Left(client_uid))
        pid = self._process_ids[_claim(member.registration)]
        member.status, member.reason = Status.LEFT, "left"
        self._down[pid] = "left"
        return [self._notify(ProcessLeft(pid)), *self._finished(self._barriers.fail_including(pid, "left")),
                *self._drop_if_elastic(pid, "left")]

    def tick(self, now: float) -> list[Effect]:
        """Fails processes silent beyond their grace and barriers past their deadline. Looks only at processes on
        the clock (no session, no call), in the order they went silent, so the outcome does not depend on hashing.

        While Register calls and sessions keep arriving (a burst: thousands attaching after publication or a
        restart), a late one may be waiting in the coordinator's own queue, so nobody is failed until the burst
        is over or they have been silent for ``catching_up_limit_s``."""
        effects: list[Effect] = []
        catching_up = now - self._last_arrival < self.config.catching_up_s
        for uid in list(self._unattended):
            member = self._members.get(uid)
            if member is None or member.calls or member.sessions or member.status not in (Status.JOINING,
                                                                                            Status.ALIVE):
                del self._unattended[uid]  # forgotten, failed, left or replaced meanwhile
                continue
            silent = now - member.last_seen
            grace = self.config.heartbeat_timeout_s if member.grace_s is None else member.grace_s
            if silent <= grace or (catching_up and silent <= self.config.catching_up_limit_s):
                continue
            del self._unattended[uid]
            if member.status is Status.JOINING:
                effects += self._forget(member, f"went silent for {silent:.1f}s before the topology was published")
            else:
                effects += self._fail(member, f"lost its connection and did not come back within {grace:g}s")
        effects += self._finished(self._barriers.expire(now, self.describe_process))
        return effects + self._settle(now)

    # Barriers and key-values.
    def arrive(self, client_uid: str, name: str, process_ids: frozenset[int], timeout_s: float,
               now: float, *, proof: str = "") -> tuple[BarrierResolved | None, list[Effect]]:
        """This process arrived at barrier ``name`` (all processes of the topology when ``process_ids`` is empty).
        Returns the barrier's result once it is resolved (None while others are awaited) and the effects."""
        pid = self.process_id_of(client_uid, proof=proof)
        participants = process_ids or frozenset(self._in_topology)
        unknown = participants - self._claims.keys()
        if unknown:
            raise InvalidArgument(f"barrier {name!r} names process ids {sorted(unknown)} that are not in the "
                                  f"topology (process ids 0..{self.config.num_processes - 1})")
        down = {p: self._down[p] for p in participants & self._down.keys()}
        _, effects = self._barriers.arrive(name, pid, participants, timeout_s, now, down)
        return self._barriers.outcome(name), self._finished(effects)

    def barrier_outcome(self, name: str) -> BarrierResolved | None:
        """How barrier ``name`` ended, or None while it is pending (or unknown)."""
        return self._barriers.outcome(name)

    def cancel_barrier(self, client_uid: str, name: str, now: float, *, proof: str = "") -> tuple[bool, list[Effect]]:
        """Fails barrier ``name`` with BarrierCancelled for every current and future waiter (also before anyone
        arrived); returns False, changing nothing, when it had completed or failed already."""
        pid = self.process_id_of(client_uid, proof=proof)
        cancelled, effects = self._barriers.cancel(name, f"process {self.describe_process(pid)}", now)
        return cancelled, self._finished(effects)

    # Agreement on who is alive.
    def live_processes(self, client_uid: str, call_id: str, timeout_s: float, now: float, *,
                       proof: str = "") -> tuple[Members | IfrtError | None, list[Effect]]:
        """This live process asks who is alive: joins the pending agreement. Returns its answer once decided (the
        same for every caller: {process id: incarnation} as sorted pairs, or the error) and the effects."""
        pid = self.process_id_of(client_uid, proof=proof)
        check_call_id("call_id", call_id, self.config.limits)
        answer = self._live_sets.answer(client_uid, call_id)
        if answer is not None:  # a retry of a decided call
            return answer, []
        self._live_sets.call(pid, client_uid, call_id, self._members[client_uid].incarnation, timeout_s, now)
        effects = self._settle(now)
        return self._live_sets.answer(client_uid, call_id), effects

    def live_answer(self, client_uid: str, call_id: str) -> Members | IfrtError | None:
        """The decided answer to this call, None while it is pending."""
        return self._live_sets.answer(client_uid, call_id)

    # Preemption.
    def preemption_notice(self, client_uid: str, now: float, *, proof: str = "") -> list[Effect]:
        """This process will be preempted: every process is told, once (a second notice changes nothing)."""
        pid = self.process_id_of(client_uid, proof=proof)
        if self._preemption is not None:
            return []
        self._journal.append(journal.PreemptionNoticed(pid))
        self._preemption = Preemption(pid)
        return [self._notify(PreemptionNotice(pid))]

    def preemption_sync(self, client_uid: str, step: int, timeout_s: float, now: float, *,
                        proof: str = "") -> tuple[int | IfrtError | None, list[Effect]]:
        """This process is at ``step`` after a notice (without one, this is its notice): returns the sync step once
        every live process reported (None while waiting) and the effects."""
        pid = self.process_id_of(client_uid, proof=proof)
        effects = self.preemption_notice(client_uid, now, proof=proof)
        preemption = self._preemption
        assert preemption is not None
        if preemption.sync_step is None:
            preemption.report(pid, step, timeout_s, now)
            effects += self._settle(now)
        return self.preemption_outcome(), effects

    def preemption_outcome(self) -> int | IfrtError | None:
        """The decided sync step, the error of the waits that timed out last, or None."""
        preemption = self._preemption
        if preemption is None:
            return None
        return preemption.sync_step if preemption.sync_step is not None else preemption.expired

    def notices(self) -> list[PreemptionNotice]:
        """What a session that attaches now must hear besides the topology: a preemption notice, if one was given."""
        return [] if self._preemption is None else [PreemptionNotice(self._preemption.noticed_by)]

    # Event history.
    @property
    def event_position(self) -> int:
        """The number of the latest job event (0: none yet)."""
        return self._history.head

    def catch_up(self, process_id: int, since: int, generation: int) -> CatchUp:
        """What the session of ``process_id``, holding ``generation`` and opening from job event ``since``, is sent
        before newer events: every event after ``since`` but its own from before its current incarnation, with the
        current topology in place of the generations among them (first, when it holds another and none is among
        them); a snapshot where the history no longer reaches back. InvalidArgument past the latest event."""
        head = self._history.head
        if since > head:
            raise InvalidArgument(f"the session opened from job event {since}, but the latest event of this cluster "
                                  f"is {head}: expected the event_position of a Register answer or the number of an "
                                  "event received")
        assert self.topology is not None  # a session attaches only once a generation is published
        current = self.topology.generation
        topology = Numbered(self.published_at, GenerationPublished(current))
        events = self._history.since(since)
        if events is None:
            return CatchUp(head, (topology,) if generation != current else (), self._snapshot(process_id))
        own_since = self._incarnated_at.get(process_id, 0)
        kept = [n for n in events if not isinstance(n.event, GenerationPublished)
                and not (n.number <= own_since and isinstance(n.event, ProcessFailed | ProcessLeft | ProcessRestarted)
                         and n.event.process_id == process_id)]
        if generation != current:
            kept.append(topology)
            kept.sort(key=lambda n: n.number)  # numbers are unique: a total order
        return CatchUp(head, tuple(kept))

    def _snapshot(self, process_id: int) -> Snapshot:
        """Each other process's state that differs from the topology, and the preemption notice, as of now."""
        failed, left, restarted = [], [], []
        for pid in sorted(self._claims):
            if pid == process_id:
                continue
            member = self._members[self._holder[self._claims[pid]]]
            if member.status is Status.FAILED:
                failed.append(ProcessFailed(pid, member.reason))
            elif member.status is Status.LEFT:
                left.append(ProcessLeft(pid))
            elif member.incarnation:
                restarted.append(ProcessRestarted(pid, member.incarnation))
        notice = self.notices()
        return Snapshot(self._history.head, tuple(failed), tuple(left), tuple(restarted), notice[0] if notice else None)

    def _notify(self, event: ProcessFailed | ProcessRestarted | ProcessLeft | PreemptionNotice) -> Notify:
        """Numbers ``event`` in the job's history; returns the effect that tells the sessions."""
        return Notify(event, self._history.add(event))

    def _alive(self) -> dict[int, tuple[str, int]]:
        """Process id -> (client uid, incarnation) of every process of the topology that is not failed or left."""
        alive = {}
        for pid in sorted(self._in_topology - self._down.keys()):
            uid = self._holder[self._claims[pid]]
            alive[pid] = (uid, self._members[uid].incarnation)
        return alive

    def _settle(self, now: float) -> list[Effect]:
        """Decides the pending live-set agreement and preemption sync point when they can be (journaled)."""
        effects: list[Effect] = []
        preemption = self._preemption
        if not self._live_sets.pending and (preemption is None or not preemption.waiting):
            return effects  # nothing waits: the tick costs nothing more
        alive = self._alive()
        resolved = self._live_sets.settle(alive, now, self.describe_process)
        if resolved is not None:
            error = resolved.error
            self._journal.append(journal.LiveSetDecided(resolved.callers, resolved.members,
                                                        type(error).__name__ if error else "",
                                                        str(error) if error else ""))
            effects.append(resolved)
        if self._preemption is not None:
            decided = self._preemption.settle(alive.keys(), now, self.describe_process)
            if decided is not None:
                if decided.step is not None:
                    self._journal.append(journal.PreemptionSyncDecided(decided.step))
                effects.append(decided)
        return effects

    def kv_set(self, client_uid: str, key: str, value: bytes, allow_overwrite: bool, *,
               proof: str = "") -> list[Effect]:
        """Stores a value for a live process; returns the change (empty when the key held that value already)."""
        self._check_kv_caller(client_uid, key, proof)
        if not self._kv.set(key, value, allow_overwrite):
            return []
        self._journal.append(journal.KeySet(key, value))
        return [KeyChanged(key, value)]

    def kv_increment(self, client_uid: str, key: str, amount: int, request_id: str = "", *,
                     proof: str = "") -> tuple[int, list[Effect]]:
        """Adds ``amount`` to the integer ``key`` holds (0 when unset) for a live process; returns the sum. A retry
        (the same ``request_id`` from the same client) is answered the sum it made, not applied again."""
        self._check_kv_caller(client_uid, key, proof)
        check_call_id("request_id", request_id, self.config.limits)
        if isinstance(answer := self._answers.get(client_uid, {}).get(request_id), int):
            return answer, []
        total = self._kv.increment(key, amount)
        self._journal.append(journal.KeyIncremented(key, total, client_uid, request_id))  # replayed as the value
        self._remember(client_uid, request_id, total)
        return total, [KeyChanged(key, str(total).encode())]

    def kv_compare_set(self, client_uid: str, key: str, expected: bytes, desired: bytes, request_id: str = "", *,
                       proof: str = "") -> tuple[bytes | None, list[Effect]]:
        """TCPStore's compare-and-set for a live process: ``key`` becomes ``desired`` when it holds ``expected`` (or
        is unset and ``expected`` is empty). Returns what the key holds now (None: unset). A retry of a swap (the
        same ``request_id`` from the same client) is answered as the swap was, not applied again."""
        self._check_kv_caller(client_uid, key, proof)
        check_call_id("request_id", request_id, self.config.limits)
        if isinstance(answer := self._answers.get(client_uid, {}).get(request_id), bytes):
            return answer, []
        value, changed = self._kv.compare_set(key, expected, desired)
        if not changed:  # nothing to remember: a retry compares again, as if this call never happened
            return value, []
        self._journal.append(journal.KeySwapped(key, desired, client_uid, request_id))
        self._remember(client_uid, request_id, desired)
        return value, [KeyChanged(key, desired)]

    def _check_kv_caller(self, client_uid: str, key: str, proof: str) -> None:
        """A live process of the topology may use any key; any caller (past the token) those under
        AGENT_KEY_PREFIX. UnknownClient, PermissionDenied or ProcessDeclaredFailed otherwise."""
        if not key.startswith(AGENT_KEY_PREFIX):
            self.process_id_of(client_uid, proof=proof)

    def _remember(self, client_uid: str, request_id: str, answer: int | bytes) -> None:
        if request_id:
            done = self._answers.setdefault(client_uid, {})
            done[request_id] = answer
            if len(done) > ANSWERS_REMEMBERED:
                del done[next(iter(done))]  # the oldest: its caller has long moved on
            if client_uid not in self._members:  # an agent: any number could come, so only the latest are kept
                self._agents.pop(client_uid, None)
                self._agents[client_uid] = None
                if len(self._agents) > AGENTS_REMEMBERED:
                    oldest = next(iter(self._agents))
                    del self._agents[oldest]
                    self._answers.pop(oldest, None)

    def kv_delete(self, client_uid: str, key: str, prefix: bool, *, proof: str = "") -> tuple[int, list[Effect]]:
        """Deletes ``key`` (or every key starting with it) for a live process; returns how many keys went."""
        self._check_kv_caller(client_uid, key, proof)
        deleted = self._kv.delete(key, prefix)
        if deleted:
            self._journal.append(journal.KeysDeleted(key, prefix))
        return len(deleted), [KeyChanged(k, None) for k in deleted]

    def kv_get(self, client_uid: str, key: str, *, proof: str = "") -> bytes | None:
        """The value of ``key`` for a live process, None while it is unset."""
        self._check_kv_caller(client_uid, key, proof)
        return self._kv.get(key)

    def kv_dir(self, client_uid: str, prefix: str, *, proof: str = "") -> list[tuple[str, bytes]]:
        """Every (key, value) under ``prefix``, sorted by key, for a live process."""
        self._check_kv_caller(client_uid, prefix, proof)
        return self._kv.dir(prefix)

    def _finished(self, effects: list[BarrierResolved]) -> list[Effect]:
        for e in effects:
            barrier = self._barriers.get(e.name)
            assert barrier is not None
            self._journal.append(journal.BarrierFinished(
                e.name, tuple(sorted(barrier.participants)), type(e.error).__name__ if e.error else "",
                str(e.error) if e.error else ""))
        return list(effects)

    def process_id_of(self, client_uid: str, *, proof: str = "") -> int:
        """The process id of a live, published client that proves it owns the registration (``proof``: the hash
        of its process secret); UnknownClient, PermissionDenied or ProcessDeclaredFailed otherwise."""
        member = self._members.get(client_uid)
        if member is None or self.topology is None or member.status is Status.JOINING:
            raise UnknownClient(f"client {client_uid} is not a registered process of the published topology")
        self._check_owner(member, proof)
        self._check_usable(member)
        return self._process_ids[_claim(member.registration)]

    def report(self, now: float) -> StatusReport:
        """The cluster as an operator sees it at ``now``: its state, every current process and its liveness."""
        config = self.config
        processes = []
        for claim, uid in self._holder.items():
            member = self._members[uid]
            r = member.registration
            pid = self._process_ids.get(claim, r.process_id)
            age = 0.0 if member.calls or member.sessions else max(0.0, now - member.last_seen)
            processes.append(ProcessReport(pid, r.hostname, r.host_address, r.local_rank, r.address, len(r.devices),
                                           member.status.value, member.reason, member.incarnation, age,
                                           member.sessions > 0))
        processes.sort(key=lambda p: (p.process_id is None, p.process_id or 0, p.hostname, p.host_address,
                                      p.local_rank))
        if self.topology is None:
            state = WAITING
        else:
            state = DEGRADED if any(p.phase == Status.FAILED.value for p in processes) else PUBLISHED
        return StatusReport(
            cluster_id=config.cluster_id, state=state, generation=self.topology.generation if self.topology else 0,
            registered=len(self._holder), expected=config.num_processes,
            missing_process_ids=tuple(sorted(self._missing_ids)) if self._explicit else (),
            waited_s=0.0 if self._first_registration_at is None else max(0.0, now - self._first_registration_at),
            processes=tuple(processes), sessions_open=sum(m.sessions for m in self._members.values()),
            heartbeat_timeout_s=config.heartbeat_timeout_s)

    def registration_of(self, process_id: int) -> Registration | None:
        """The registration of the current incarnation of ``process_id`` (None if no process holds it)."""
        claim = self._claims.get(process_id)
        return None if claim is None else self._members[self._holder[claim]].registration

    def describe_process(self, process_id: int) -> str:
        """``2 (host-c (10.0.0.3))``, for messages."""
        claim = self._claims.get(process_id)
        if claim is None:
            return str(process_id)
        return f"{process_id} ({self._members[self._holder[claim]].registration.describe()})"

    # Internals.
    def _check_fits(self, r: Registration) -> None:
        config = self.config
        if r.cluster_id and r.cluster_id != config.cluster_id:
            raise ClusterMismatch(f"{r.describe()} asked for cluster {r.cluster_id!r}; this coordinator serves "
                                  f"cluster {config.cluster_id!r}")
        if r.attempt is not None and r.attempt != config.attempt:
            raise ClusterMismatch(f"{r.describe()} belongs to attempt {r.attempt} of the job; this coordinator serves "
                                  f"attempt {config.attempt} of cluster {config.cluster_id!r}: a process of another "
                                  "attempt is refused (start it with the job's current attempt, IFRT_ATTEMPT)")
        if r.num_processes and r.num_processes != config.num_processes:
            raise ClusterMismatch(f"{r.describe()} expects {r.num_processes} processes; this coordinator's cluster "
                                  f"has {config.num_processes}")
        if r.process_id is not None:
            bound = min(config.num_processes, config.max_processes)
            if not 0 <= r.process_id < bound:
                raise InvalidArgument(f"process id {r.process_id} is out of range: expected 0 <= process_id < {bound} "
                                      f"(num_processes {config.num_processes}, id limit {config.max_processes})")
        if not config.allow_mixed_platforms and self._holder:
            first = self._members[next(iter(self._holder.values()))].registration
            if _platform(first) != _platform(r):
                raise ClusterMismatch(f"{r.describe()} uses plugin {r.plugin!r} with platforms "
                                      f"{sorted(_platform(r)[1])}, but {first.describe()} uses plugin "
                                      f"{first.plugin!r} with platforms {sorted(_platform(first)[1])}: start the "
                                      "coordinator with --allow-mixed-platforms to allow mixed clusters")
        explicit = r.process_id is not None
        if self._explicit is not None and explicit != self._explicit:
            if self._explicit:
                raise ClusterMismatch(f"{r.describe()} sent no process id, but this cluster uses explicit process "
                                      "ids: give every process an id, or none")
            raise ClusterMismatch(f"{r.describe()} sent process id {r.process_id}, but this cluster assigns process "
                                  "ids: give every process an id, or none")

    def _check_owner(self, member: Member, proof: str) -> None:
        """PermissionDenied unless ``proof`` matches the secret the process registered with (if it gave one)."""
        expected = member.registration.secret_hash
        if expected and not hmac.compare_digest(expected, proof):
            pid = self._process_ids.get(_claim(member.registration))
            who = f"process {pid}" if pid is not None else member.registration.describe()
            raise PermissionDenied(f"this call acts for {who} but does not carry its process secret "
                                   f"({'none was sent' if not proof else 'another was sent'}): only the process "
                                   "that registered may act for it")

    @staticmethod
    def _check_usable(member: Member) -> None:
        if member.status in (Status.FAILED, Status.LEFT):
            raise ProcessDeclaredFailed(f"this process ({member.registration.describe()}) was declared "
                                        f"{member.status.value}: {member.reason}; restart it to rejoin")

    def _answer(self, r: Registration) -> Waiting | Published:
        if self.topology is None:
            return Waiting(len(self._holder), self.config.num_processes)
        return Published(self._process_ids[_claim(r)], self.topology)

    def _publish_first(self) -> None:
        holders = {uid: claim for claim, uid in self._holder.items()}
        ids = assign_process_ids(self._members[uid].registration for uid in holders)
        self._process_ids = {holders[uid]: pid for uid, pid in ids.items()}
        self._claims = {pid: claim for claim, pid in self._process_ids.items()}
        for uid in holders:
            self._members[uid].status = Status.ALIVE
        self._in_topology = set(ids.values())
        self.topology = self._build(FIRST_GENERATION)
        self.published_at = self._history.add(GenerationPublished(FIRST_GENERATION))

    def _build(self, generation: int) -> TopologyContent:
        members = {self._process_ids[claim]: self._members[uid].registration for claim, uid in self._holder.items()}
        members = {pid: r for pid, r in members.items() if pid in self._in_topology}
        slice_keys = sorted({d.slice_key for r in members.values() for d in r.devices}, key=_natural)
        slice_index = {key: i for i, key in enumerate(slice_keys)}
        processes, devices = [], []
        trusted = Device.trusted
        with wire.gc_paused():  # ids and fields were checked at registration
            for pid in sorted(members):  # by process id, and each registration's devices by local id: sorted by id
                r = members[pid]
                processes.append(Process(pid, r.hostname, r.address))
                first = pid << LOCAL_ID_BITS
                devices.extend(trusted(first | d.local_id, pid, d.local_id, d.platform, d.kind,
                                       slice_index[d.slice_key], d.attributes, r.plugin, d.coordinates)
                               for d in r.devices)
            return TopologyContent(self.config.cluster_id, generation, len(processes), tuple(processes),
                                   tuple(devices))

    def _republish_if_changed(self) -> list[Effect]:
        assert self.topology is not None
        same_generation = self._build(self.topology.generation)
        if same_generation == self.topology:
            return []
        self.topology = replace(same_generation, generation=self.topology.generation + 1)
        self.published_at = self._history.add(GenerationPublished(self.topology.generation))
        return [Republish(self.topology, self.published_at)]

    def _restart(self, r: Registration, holder: Member, now: float) -> tuple[Published, list[Effect]]:
        claim = _claim(r)
        pid = self._process_ids[claim]
        if holder.status in (Status.JOINING, Status.ALIVE):
            holder.status, holder.reason = Status.FAILED, f"replaced by a restarted process from {r.describe()}"
        member = Member(r, Status.ALIVE, now, incarnation=holder.incarnation + 1)
        self._add_member(member)
        self._holder[claim] = r.client_uid
        self._down.pop(pid, None)
        effects: list[Effect] = [*self._finished(self._barriers.fail_including(pid, "restarted")),
                                 self._notify(ProcessRestarted(pid, member.incarnation))]
        self._incarnated_at[pid] = self._history.head
        self._in_topology.add(pid)
        effects += self._republish_if_changed()
        return Published(pid, self.topology), effects  # type: ignore[arg-type]

    def _fail(self, member: Member, why: str) -> list[Effect]:
        self._journal.append(journal.Failed(member.registration.client_uid, why))
        pid = self._process_ids[_claim(member.registration)]
        member.status, member.reason = Status.FAILED, why
        self._down[pid] = f"failed: {why}"
        effects: list[Effect] = []
        if member.sessions:
            effects.append(Evict(member.registration.client_uid, f"declared failed: {why}"))
        if self.config.on_failure is FailurePolicy.ELASTIC and not (
                pid in self._in_topology and len(self._in_topology) - 1 >= self.config.min_processes):
            why += (f"; only {len(self._in_topology) - 1} processes would remain, fewer than --min-processes "
                    f"{self.config.min_processes}: the cluster cannot continue")
        failed = self._notify(ProcessFailed(pid, why))  # numbered before the generation that drops it
        dropped = self._drop_if_elastic(pid, "failed")
        return [failed, *self._finished(self._barriers.fail_including(pid, f"failed: {why}")),
                *effects, *dropped]

    def _drop_if_elastic(self, pid: int, what: str) -> list[Effect]:
        if self.config.on_failure is not FailurePolicy.ELASTIC or pid not in self._in_topology:
            return []
        if len(self._in_topology) - 1 < self.config.min_processes:
            return []
        self._in_topology.discard(pid)
        return self._republish_if_changed()

    def _forget(self, member: Member, why: str) -> list[Effect]:
        r = member.registration
        self._journal.append(journal.Forgot(r.client_uid, why))
        claim = _claim(r)
        if self._holder.get(claim) == r.client_uid:
            del self._holder[claim]
            if r.process_id is not None:
                self._missing_ids.add(r.process_id)
        del self._members[r.client_uid]
        return [Forgotten(r.describe(), why)]


def _platform(r: Registration) -> tuple[str, frozenset[str]]:
    return r.plugin, frozenset(d.platform for d in r.devices)


def _natural(key: str) -> tuple:
    """Sort key that puts "slice-2" before "slice-10"; total: keys equal as numbers ("slice-1", "slice-01") fall
    back to the text itself, so no order is left to set iteration (which changes with the hash seed)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)), key


def _claim(r: Registration) -> object:
    return r.process_id if r.process_id is not None else r.stable_key


def _taken(r: Registration, holder: Registration) -> ProcessIdTaken:
    if r.process_id is not None:
        return ProcessIdTaken(f"process id {r.process_id} is already registered by {holder.describe()}, which is "
                              f"alive; {r.describe()} cannot take it: give each process its own id")
    return ProcessIdTaken(f"{r.describe()} is already registered by another live process: give each process on one "
                          "host its own local rank (IFRT_LOCAL_RANK), or explicit process ids")
