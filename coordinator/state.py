"""The coordinator's decisions as a deterministic state machine with no I/O: a router (``ClusterState``) that hands
each event to the sub-machine whose job it is (admission, liveness, barriers, key-values, agreement, preemption,
attempts, lost hosts) and journals what they decide.

    JOINING ──(the N-th process registers: generation 1 published)──▶ ALIVE ──(leave)──▶ LEFT
       │                                                                │
       └─(silent for the grace before publication: forgotten)           ├─(silent for the grace)──▶ FAILED
                                                                        └─(a new process takes its id)──▶ restarted

Once every process of the published run has left or failed, the next registration starts the job's next run
(``coordinator.runs``, journaled as ``RunStarted``): every sub-machine but the attempts starts empty, as for a new
attempt, and the new processes form generation 1 of it alone.

Every method is an event (time arrives as data, ``now``) and returns its effects for the shell to carry out. A
rejected event raises a typed ``ifrt.errors`` error and leaves the state exactly as it was. Every durable decision is
journaled (``take_journal``) for the shell to persist before acknowledging; ``replay`` of those entries gives the
same state and byte-identical topologies, on this coordinator or on the one that takes over.
"""

from __future__ import annotations

from dataclasses import replace

from coordinator import journal, runs
from coordinator.admission import FIRST_GENERATION, Admission, Joined, NextRun, Retry, Takeover, check_usable
from coordinator.agreement import LiveSets, Members
from coordinator.attempt_calls import JobAttemptCalls
from coordinator.attempts import Attempts
from coordinator.barriers import BarrierResolved, Barriers
from coordinator.catchup import catch_up
from coordinator.cluster import ClusterConfig, FailurePolicy
from coordinator.effects import (
    Effect,
    Evict,
    FirstPublication,
    Forgotten,
    Notify,
    Published,
    Republish,
    RunEnded,
    RunStarted,
    Waiting,
    WaitingForNextRun,
)
from coordinator.history import CatchUp, GenerationPublished, History
from coordinator.host_calls import HostCalls
from coordinator.keyvalues import KeyValues
from coordinator.kv import AGENT_KEY_PREFIX
from coordinator.kv_calls import KeyValueCalls
from coordinator.limits import check_call_id
from coordinator.liveness import Liveness
from coordinator.members import Member, Status
from coordinator.preemption import Preemption
from coordinator.registration import Registration
from coordinator.replacements import check_devices
from coordinator.report import cluster_report
from coordinator.shrink import JobShrinks
from coordinator.status import StatusReport
from coordinator.takeover import HostTakeovers
from ifrt.errors import IfrtError, InvalidArgument, ProcessDeclaredFailed, UnknownClient
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.progress import Progress
from ifrt.records import TopologyContent


class ClusterState(JobAttemptCalls, KeyValueCalls, HostTakeovers, JobShrinks, HostCalls):
    """All processes of one cluster, their liveness, the published generation, barriers and key-values."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._admission = Admission(config)
        self._liveness = Liveness(config)
        self._barriers = Barriers(config.limits)
        self._kv = KeyValues(config.limits, self._journal_entry)
        self._live_sets = LiveSets()
        self._preemption: Preemption | None = None
        self._journal: list[journal.Entry] = []
        self.attempts = Attempts(config.attempt, config.max_restarts)
        self._history = History(config.limits.event_history)
        self.published_at = 0
        """The job event number that published the current generation."""
        self._incarnated_at: dict[int, int] = {}  # process id -> event number of its latest restart
        self.run = runs.FIRST_RUN
        """The job's run on this coordinator (``coordinator.runs``): kept, like the attempts, when state restarts."""

    @property
    def topology(self) -> TopologyContent | None:
        return self._admission.topology

    @property
    def registered(self) -> int:
        return self._admission.registered

    # Journal.
    def _journal_entry(self, entry: journal.Entry) -> None:
        self._journal.append(entry)

    def take_journal(self) -> list[journal.Entry]:
        """The durable decisions made since the last call, in order, for the shell to persist."""
        entries, self._journal = self._journal, []
        return entries

    def replay(self, entry: journal.Entry) -> None:
        """Applies one journaled decision again (on restart or takeover); nothing is journaled anew."""
        members = self._admission.members
        match entry:
            case journal.Registered(registration=r, now=now):
                self.register(r, now, restoring=True)
            case journal.Failed(client_uid=uid, why=why):
                self._fail(members[uid], why)
            case journal.Left(client_uid=uid):
                self._leave(members[uid])
            case journal.Forgot(client_uid=uid, why=why):
                self._forget(members[uid], why)
            case journal.KeySet() | journal.KeyIncremented() | journal.KeySwapped() | journal.KeysDeleted():
                self._kv.replay(entry, agent=self._is_agent(getattr(entry, "client_uid", "")))
            case journal.BarrierFinished(name=name, participants=participants, error_type=kind, error=message):
                self._barriers.restore(name, frozenset(participants), journal.error_of(kind, message))
            case journal.LiveSetDecided(callers=callers, members=decided, error_type=kind, error=message):
                self._live_sets.restore(callers, decided, journal.error_of(kind, message))
            case journal.PreemptionNoticed(process_id=pid):
                self._preemption = Preemption(pid)
                self._history.add(PreemptionNotice(pid))
            case journal.PreemptionSyncDecided(step=step):
                assert self._preemption is not None
                self._preemption.sync_step = step
            case journal.AttemptDecided():
                self._end_attempt(entry)
            case journal.AgentJoined():
                self._agent_joined(entry)
            case journal.RunStarted():
                self._start_run(entry)
            case journal.HostTakenOver():
                self._taken_over(entry)
            case journal.Shrunk():
                self._shrunk(entry)
        self._journal.clear()

    def reset_liveness(self, now: float) -> None:
        """After a replay: nobody is attached yet, and every live process has the grace period from ``now``."""
        self._liveness.reset(self._admission.members.values(), now)

    # Registration.
    def register(self, r: Registration, now: float, *,
                 restoring: bool = False) -> tuple[Waiting | Published | WaitingForNextRun, list[Effect]]:
        """Admits a process, recognizes its retry, takes over the id of a dead one (a restart), or tells it to wait
        for the next run (its id left the run). The first registration after every process of the run left or
        failed starts the next run. The answer says what the shell logs and wakes: the admission, and the first
        publication when this completed the cluster."""
        started: list[Effect] = []
        admission = self._admission
        if (r.client_uid not in admission.members or r.client_uid in admission.pending) and self._over():
            # a new process, or a restart that never got a generation of the run: either starts the next run
            fresh = Admission(self.config)
            fresh.held = admission.held
            fresh.check_fits(r, self.attempts.current)  # refused, it changes nothing (not even the run)
            entry = journal.RunStarted(self.run + 1)
            self._journal.append(entry)
            started = self._start_run(entry)
        admission = self._admission
        decision = admission.admit(r, now, self.attempts.current, restoring=restoring)
        if isinstance(decision, Retry):
            return admission.answer(r), started
        if isinstance(decision, NextRun):
            return runs.waiting(admission, self.run), started
        if isinstance(decision, Takeover) and (pid := admission.process_id(decision.holder)) in self.attempts.replacing:
            check_devices(r, decision.holder.registration, pid)  # a decided replacement: refused, nothing changed
            self.attempts.replacing.discard(pid)
        self._journal.append(journal.Registered(r, now))
        if isinstance(decision, Takeover):
            outcome, effects = self._restart(r, decision.holder, now)
            return outcome, started + effects
        assert isinstance(decision, Joined)
        self._liveness.track(decision.member)
        outcome = admission.answer(r, admission.admitted(r))
        if decision.completed:
            assert isinstance(outcome, Published)
            self.published_at = self._history.add(GenerationPublished(FIRST_GENERATION))
            outcome = replace(outcome, first=FirstPublication(outcome.topology, self.published_at,
                                                              admission.waited_s(now)))
        return outcome, started

    def waiting_for_next_run(self) -> WaitingForNextRun | None:
        """What a registration that waits for the next run is told now; None once the run is over (it may start
        the next one)."""
        return None if self._over() else runs.waiting(self._admission, self.run)

    def _start_run(self, entry: journal.RunStarted) -> list[Effect]:
        """Starts run ``entry.run``: every sub-machine but the attempts starts empty; the agents' keys (torchrun's
        rendezvous, outside any run) carry over, and the registrations journaled in this attempt stay counted
        against ``--max-registration-bytes``."""
        ended, attempts, entries, kv = self.run, self.attempts, self._journal, self._kv
        held = self._admission.held  # the ended runs' registrations stay in the attempt's journal: still counted
        self.__init__(replace(self.config, attempt=attempts.current))  # type: ignore[misc]
        self.attempts, self._journal, self.run = attempts, entries, entry.run
        self._admission.held = held
        attempts.replacing.clear()  # a replacement decided in the ended run takes no id of this one over
        self._kv.carry(kv, AGENT_KEY_PREFIX)
        return [RunStarted(ended, entry.run)]

    def _over(self) -> bool:
        return runs.over(self._admission, self._liveness.down)

    def _ended(self, was_over: bool) -> list[Effect]:
        """RunEnded when the event just handled ended the run (registrations waiting for the next one may start
        it)."""
        return [RunEnded(self.run)] if not was_over and self._over() else []

    def answer(self, client_uid: str, now: float) -> Waiting | Published:
        """What a registered process's waiting call answers now; UnknownClient if it was forgotten meanwhile,
        ProcessDeclaredFailed if it failed or was replaced while it waited."""
        member = self._admission.members.get(client_uid)
        if member is None:
            raise UnknownClient(f"client {client_uid} is not registered (its registration was forgotten): register "
                                "again")
        check_usable(member)
        member.last_seen = now
        return self._admission.answer(member.registration)

    def progress(self, now: float) -> Progress:
        """Who has registered and who is missing, as of ``now``."""
        return self._admission.progress(now)

    # Liveness (coordinator.liveness).
    def call_started(self, client_uid: str, now: float) -> None:
        """A Register call of this client is in flight (it is alive while it waits on us)."""
        self._liveness.call_started(self._admission.members.get(client_uid), now)

    def call_ended(self, client_uid: str, now: float) -> None:
        """The call answered: without a session, the process has the heartbeat timeout to call or attach again."""
        if (member := self._admission.members.get(client_uid)) is not None:
            self._liveness.call_ended(member, now)

    def attach(self, client_uid: str, now: float, *, proof: str = "") -> int:
        """A session opened; returns the process id. UnknownClient, PermissionDenied or ProcessDeclaredFailed if it
        may not."""
        member = self._published_member(client_uid, proof, " (the coordinator may have restarted): register again")
        self._liveness.attached(member, now)
        return self._admission.process_id(member)

    def heard(self, client_uid: str, now: float) -> None:
        """A Heartbeat on a session of ``client_uid`` (its owner was checked when the session opened)."""
        if (member := self._admission.members.get(client_uid)) is not None:
            self._liveness.heard(member, now)

    def detach(self, client_uid: str, now: float) -> None:
        """A session ended (closed, or its connection dropped): unless another is open, the process has the
        reconnect grace to attach again."""
        if (member := self._admission.members.get(client_uid)) is not None:
            self._liveness.detached(member, now)

    def leave(self, client_uid: str, now: float, *, proof: str = "") -> list[Effect]:
        """A graceful exit: the process is reported as left (and dropped, with the elastic policy). Leaving again
        is a no-op; UnknownClient for a client that never registered, PermissionDenied for a caller that does
        not own the process."""
        member = self._admission.members.get(client_uid)
        if member is None:
            raise UnknownClient(f"client {client_uid} is not a registered process: nothing to leave")
        self._admission.check_owner(member, proof)
        was_over = self._over()
        return self._leave(member) + self._settle(now) + self._ended(was_over)

    def tick(self, now: float) -> list[Effect]:
        """Fails processes silent beyond their grace (forgets them before publication), in the order they went
        silent, and barriers past their deadline; decides what waits on who is alive."""
        effects: list[Effect] = []
        was_over = self._over()
        for overdue in self._liveness.overdue(now, self._admission.members):
            joining = overdue.member.status is Status.JOINING
            effects += (self._forget if joining else self._fail)(overdue.member, overdue.why)
        effects += self._journal_barriers(self._barriers.expire(now, self.describe_process))
        return effects + self._settle(now) + self._ended(was_over)

    # Barriers.
    def arrive(self, client_uid: str, name: str, process_ids: frozenset[int], timeout_s: float,
               now: float, *, proof: str = "") -> tuple[BarrierResolved | None, list[Effect]]:
        """This process arrived at barrier ``name`` (all processes of the topology when ``process_ids`` is empty).
        Returns the barrier's result once it is resolved (None while others are awaited) and the effects."""
        pid = self.process_id_of(client_uid, proof=proof)
        participants = process_ids or frozenset(self._admission.in_topology)
        unknown = participants - self._admission.claims.keys()
        if unknown:
            raise InvalidArgument(f"barrier {name!r} names process ids {sorted(unknown)} that are not in the "
                                  f"topology (process ids 0..{self.config.num_processes - 1})")
        down = self._liveness.down
        _, effects = self._barriers.arrive(name, pid, participants, timeout_s, now,
                                           {p: down[p] for p in participants & down.keys()})
        return self._barriers.outcome(name), self._journal_barriers(effects)

    def barrier_outcome(self, name: str) -> BarrierResolved | None:
        """How barrier ``name`` ended, or None while it is pending (or unknown)."""
        return self._barriers.outcome(name)

    def cancel_barrier(self, client_uid: str, name: str, now: float, *, proof: str = "") -> tuple[bool, list[Effect]]:
        """Fails barrier ``name`` with BarrierCancelled for every current and future waiter (also before anyone
        arrived); returns False, changing nothing, when it had completed or failed already."""
        pid = self.process_id_of(client_uid, proof=proof)
        cancelled, effects = self._barriers.cancel(name, f"process {self.describe_process(pid)}", now)
        return cancelled, self._journal_barriers(effects)

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
        member = self._admission.members[client_uid]
        self._live_sets.call(pid, client_uid, call_id, member.incarnation, timeout_s, now)
        effects = self._settle(now)
        return self._live_sets.answer(client_uid, call_id), effects

    def live_answer(self, client_uid: str, call_id: str) -> Members | IfrtError | None:
        """The decided answer to this call (the same for every caller); None while it is pending or unknown."""
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
        before newer events (see coordinator.catchup); InvalidArgument past the latest event."""
        notice = self.notices()
        return catch_up(self._history, self._admission, self.published_at, self._incarnated_at,
                        notice[0] if notice else None, process_id, since, generation)

    # Questions about processes.
    def process_id_of(self, client_uid: str, *, proof: str = "") -> int:
        """The process id of a live, published client that proves it owns the registration (``proof``: the hash
        of its process secret); UnknownClient, PermissionDenied or ProcessDeclaredFailed otherwise."""
        return self._admission.process_id(self._published_member(client_uid, proof))

    def report(self, now: float) -> StatusReport:
        """The cluster as an operator sees it at ``now``: its state, every current process and its liveness."""
        return cluster_report(self._admission, now)

    def registration_of(self, process_id: int) -> Registration | None:
        """The registration of the current incarnation of ``process_id`` (None if no process holds it)."""
        member = self._admission.member_of(process_id)
        return None if member is None else member.registration

    def describe_process(self, process_id: int) -> str:
        """``2 (host-c (10.0.0.3))``, for messages."""
        return self._admission.describe_process(process_id)

    # Internals: the decisions that span sub-machines, and what they journal.
    def _published_member(self, client_uid: str, proof: str, hint: str = "") -> Member:
        member = self._admission.members.get(client_uid)
        if member is None or self.topology is None or member.status is Status.JOINING:
            raise UnknownClient(f"client {client_uid} is not a registered process of the published topology{hint}")
        self._admission.check_owner(member, proof)
        check_usable(member)
        return member

    def _restart(self, r: Registration, holder: Member, now: float) -> tuple[Waiting | Published, list[Effect]]:
        admission = self._admission
        pid, member = admission.take_over(r, holder, now)
        self._liveness.restarted(member, pid)
        effects: list[Effect] = self._journal_barriers(self._barriers.fail_including(pid, "restarted"))
        admission.pending.add(member.uid)
        effects += self._publish_if_whole()  # numbered first: a peer holds the generation when it hears the restart
        effects.append(self._notify(ProcessRestarted(pid, member.incarnation)))
        if holder.sessions:  # it stopped answering, its session still open: the restart ends it
            effects.append(Evict(holder.uid, f"replaced by a restarted process from {r.describe()}"))
        self._incarnated_at[pid] = self._history.head
        return admission.answer(r), effects

    def _publish_if_whole(self) -> list[Effect]:
        """Answers the restarted processes once every id of the generation is held by a process that neither
        failed nor left: the next generation when theirs changed it. Until then none is published, so no process
        is handed a generation holding a process known to be gone."""
        admission = self._admission
        if not admission.pending or admission.gone():
            return []
        admission.pending.clear()
        return self._published(admission.republish_if_changed())

    def _fail(self, member: Member, why: str) -> list[Effect]:
        self._journal.append(journal.Failed(member.uid, why))
        pid = self._admission.process_id(member)
        effects: list[Effect] = []
        if self._liveness.fail(member, pid, why):
            effects.append(Evict(member.uid, f"declared failed: {why}"))
        if self.config.on_failure is FailurePolicy.ELASTIC and not self._admission.survivors_suffice(pid):
            why += (f"; only {len(self._admission.in_topology) - 1} processes would remain, fewer than "
                    f"--min-processes {self.config.min_processes}: the cluster cannot continue")
        failed = self._notify(ProcessFailed(pid, why))  # numbered before the generation that drops it
        dropped = self._drop_if_elastic(pid)
        effects.append(self.attempts.process_failed(pid, member.registration.hostname, why, self.config.limits))
        return [failed, *self._journal_barriers(self._barriers.fail_including(pid, f"failed: {why}")),
                *effects, *dropped]

    def _leave(self, member: Member) -> list[Effect]:
        if not member.live:
            return []
        if member.status is Status.JOINING:
            return self._forget(member, "left before the topology was published")
        self._journal.append(journal.Left(member.uid))
        pid = self._admission.process_id(member)
        self._liveness.leave(member, pid)
        self._admission.left.add(pid)
        return [self._notify(ProcessLeft(pid)), *self._journal_barriers(self._barriers.fail_including(pid, "left")),
                *self._drop_if_elastic(pid)]

    def _forget(self, member: Member, why: str) -> list[Effect]:
        self._journal.append(journal.Forgot(member.uid, why))
        self._admission.forget(member)
        return [Forgotten(member.registration.describe(), why)]

    def _drop_if_elastic(self, pid: int) -> list[Effect]:
        if self.config.on_failure is not FailurePolicy.ELASTIC or not self._admission.survivors_suffice(pid):
            return []
        return self._published(self._admission.drop(pid)) + self._publish_if_whole()

    def _published(self, topology: TopologyContent | None) -> list[Effect]:
        """Numbers a new generation (if any) in the job's history; returns the effect that sends it."""
        if topology is None:
            return []
        self.published_at = self._history.add(GenerationPublished(topology.generation))
        return [Republish(topology, self.published_at)]

    def _journal_barriers(self, effects: list[BarrierResolved]) -> list[Effect]:
        """Journals each barrier that just finished (with its participants and error); returns the effects."""
        for e in effects:
            barrier = self._barriers.get(e.name)
            assert barrier is not None
            self._journal.append(journal.BarrierFinished(e.name, tuple(sorted(barrier.participants)),
                                                         *journal.error_fields(e.error)))
        return list(effects)

    def _notify(self, event: ProcessFailed | ProcessRestarted | ProcessLeft | PreemptionNotice) -> Notify:
        """Numbers ``event`` in the job's history; returns the effect that tells the sessions."""
        return Notify(event, self._history.add(event))

    def _alive(self) -> dict[int, tuple[str, int]]:
        """Process id -> (client uid, incarnation) of every process of the topology that is not failed or left."""
        up = sorted(self._admission.in_topology - self._liveness.down.keys())
        return {pid: (m.uid, m.incarnation) for pid in up if (m := self._admission.member_of(pid)) is not None}

    def _settle(self, now: float) -> list[Effect]:
        """Decides the pending live-set agreement and preemption sync point when they can be (journaled)."""
        effects: list[Effect] = []
        preemption = self._preemption
        if not self._live_sets.pending and (preemption is None or not preemption.waiting):
            return effects  # nothing waits: the tick costs nothing more
        alive = self._alive()
        resolved, left_out = self._live_sets.settle(alive, now, self.describe_process, self._why_left_out)
        effects += left_out
        if resolved is not None:
            self._journal.append(journal.LiveSetDecided(resolved.callers, resolved.members,
                                                        *journal.error_fields(resolved.error)))
            effects.append(resolved)
        if preemption is not None:
            decided = preemption.settle(alive.keys(), now, self.describe_process)
            if decided is not None:
                if decided.step is not None:
                    self._journal.append(journal.PreemptionSyncDecided(decided.step))
                effects.append(decided)
        return effects

    def _why_left_out(self, client_uid: str) -> IfrtError:
        """The answer of a caller left out of the agreement: it failed, left or was replaced while it waited."""
        member = self._admission.members.get(client_uid)
        if member is None:
            return UnknownClient(f"client {client_uid} is not a registered process of the published topology")
        try:
            check_usable(member)
        except IfrtError as e:
            return e
        return ProcessDeclaredFailed(f"this process ({member.registration.describe()}) no longer holds its id")

