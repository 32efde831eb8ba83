"""One run of one job attempt as a deterministic state machine with no I/O (``Run``): its registrations, liveness,
barriers, key-values, live-set agreements, preemption and numbered events, and the decisions that span them (a
failure fails the barriers that wait on the process, a restart republishes once the generation is whole).

    JOINING ──(the N-th process registers: generation 1 published)──▶ ALIVE ──(leave)──▶ LEFT
       │                                                                │
       └─(silent for the grace before publication: forgotten)           ├─(silent for the grace)──▶ FAILED
                                                                        └─(a new process takes its id)──▶ restarted

A run starts empty, as a new object: the router (``coordinator.core.state``) makes one for every new attempt and every
new run of the job, and the run's events go on numbering from the last event of the one before, so an event position
never goes back within a journal. Every method is an event (time arrives as data, ``now``) and returns its effects;
a rejected event raises a typed ``ifrt.errors`` error and changes nothing. What it decides durably it keeps, in order,
for the router to take (``take_entries``) into the journal ahead of the router's own next decision; a replay runs the
same event again (``coordinator.core.replays``), so a run's decision cannot apply one way live and another after a
failover.
"""

from __future__ import annotations

from dataclasses import replace

from coordinator.core import journal, runs
from coordinator.core.admission import (
    FIRST_GENERATION,
    Admission,
    Attaching,
    Joined,
    NextRun,
    Retry,
    Takeover,
    check_usable,
)
from coordinator.core.agreement import LiveSets, Members
from coordinator.core.attempts import Attempts
from coordinator.core.barriers import BarrierResolved, Barriers
from coordinator.core.catchup import catch_up
from coordinator.core.cluster import ClusterConfig, FailurePolicy
from coordinator.core.effects import (
    Effect,
    Evict,
    FirstPublication,
    Forgotten,
    Notify,
    Published,
    Republish,
    SuspectSelf,
    Waiting,
    WaitingForHolder,
    WaitingForNextRun,
)
from coordinator.core.history import CatchUp, GenerationPublished, History
from coordinator.core.keyvalues import KeyValues
from coordinator.core.kv import AGENT_KEY_PREFIX
from coordinator.core.kv_calls import KeyValueCalls
from coordinator.core.limits import check_call_id
from coordinator.core.liveness import Liveness
from coordinator.core.members import Member, Status
from coordinator.core.preemption import Preemption
from coordinator.core.registration import Registration
from coordinator.core.replacements import check_devices
from coordinator.core.report import cluster_report
from coordinator.core.status import StatusReport
from ifrt.errors import IfrtError, InvalidArgument, UnknownClient
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.progress import Progress
from ifrt.records import TopologyContent


class Run:
    """Run ``number`` of attempt ``config.attempt``: every process of it, its liveness, the published generation,
    barriers, key-values and events. ``attempts`` is the job's (it outlives runs): a failure is recorded there, and
    a replacement it decided is checked here."""

    def __init__(self, config: ClusterConfig, number: int, attempts: Attempts, first_event: int = 0) -> None:
        self.config, self.number, self._attempts = config, number, attempts
        self._entries: list[journal.Entry] = []
        self._record = self._entries.append
        self.admission = Admission(config)
        self.liveness = Liveness(config)
        self.barriers = Barriers(config.limits, config.num_processes)
        self.kv = KeyValues(config.limits, self._record)
        self.keys = KeyValueCalls(self.kv, self._check_kv_caller, self.is_agent)
        """The run's key-value calls, each checking its caller for every key it touches."""
        self._live_sets = LiveSets()
        self._preemption: Preemption | None = None
        self.history = History(config.limits.event_history, first_event)
        self.published_at = first_event
        """The job event number that published the current generation."""
        self._incarnated_at: dict[int, int] = {}  # process id -> event number of its latest restart

    @property
    def attempt(self) -> int:
        return self.config.attempt

    @property
    def topology(self) -> TopologyContent | None:
        return self.admission.topology

    def carry_from(self, ended: Run) -> None:
        """This run follows ``ended``: the agents' keys (torchrun's rendezvous, outside any run) carry over, and the
        registrations journaled in the attempt stay counted against ``--max-registration-bytes``."""
        self.admission.held = ended.admission.held
        self.kv.carry(ended.kv, AGENT_KEY_PREFIX)

    def reset_liveness(self, now: float) -> None:
        """After a replay: nobody is attached yet, and every live process has the grace period from ``now``."""
        self.liveness.reset(self.admission.members.values(), now)

    def take_entries(self) -> list[journal.Entry]:
        """The durable decisions the run made since the last call, in order (the router journals them)."""
        entries, self._entries[:] = list(self._entries), []
        return entries

    # Registration.
    def register(self, r: Registration, now: float, *, restoring: bool = False
                 ) -> tuple[Waiting | Published | WaitingForNextRun | WaitingForHolder, list[Effect]]:
        """Admits a process, recognizes its retry, takes over the id of a dead one (a restart), or tells it to wait
        for the next run (its id left the run) or for its id's holder to attach or fail."""
        admission = self.admission
        decision = admission.admit(r, now, self.attempt, restoring=restoring)
        if isinstance(decision, Retry):
            return admission.answer(r), []
        if isinstance(decision, NextRun):
            return runs.waiting(admission, self.number), []
        if isinstance(decision, Attaching):
            holder = decision.holder
            return WaitingForHolder(admission.describe_process(admission.process_id(holder)),
                                    now - holder.last_seen), []
        attempts = self._attempts
        if isinstance(decision, Takeover) and (pid := admission.process_id(decision.holder)) in attempts.replacing:
            check_devices(r, decision.holder.registration, pid)  # a decided replacement: refused, nothing changed
            attempts.replacement_registered(pid)
        self._record(journal.Registered(r, now))
        if isinstance(decision, Takeover):
            return self._restart(r, decision.holder, now)
        assert isinstance(decision, Joined)
        self.liveness.track(decision.member)
        outcome = admission.answer(r, admission.admitted(r))
        if decision.completed:
            assert isinstance(outcome, Published)
            self.published_at = self.history.add(GenerationPublished(FIRST_GENERATION))
            outcome = replace(outcome, first=FirstPublication(outcome.topology, self.published_at,
                                                              admission.waited_s(now)))
        return outcome, []

    def over(self) -> bool:
        """Whether every process of the published run left or failed (see coordinator.core.runs)."""
        return runs.over(self.admission, self.liveness.down)

    def answer(self, client_uid: str, now: float) -> Waiting | Published:
        """What a registered process's waiting call answers now; UnknownClient if it was forgotten meanwhile,
        ProcessDeclaredFailed if it failed or was replaced while it waited."""
        member = self.admission.members.get(client_uid)
        if member is None:
            raise UnknownClient(f"client {client_uid} is not registered (its registration was forgotten): register "
                                "again")
        check_usable(member)
        member.last_seen = now
        return self.admission.answer(member.registration)

    def progress(self, now: float) -> Progress:
        """Who has registered and who is missing, as of ``now``."""
        return self.admission.progress(now)

    # Liveness (coordinator.core.liveness).
    def call_started(self, client_uid: str, now: float) -> None:
        """A Register call of this client is in flight (it is alive while it waits on us)."""
        self.liveness.call_started(self.admission.members.get(client_uid), now)

    def call_ended(self, client_uid: str, now: float) -> None:
        """The call answered: without a session, the process has the heartbeat timeout to call or attach again."""
        if (member := self.admission.members.get(client_uid)) is not None:
            self.liveness.call_ended(member, now)

    def attach(self, client_uid: str, now: float, *, proof: str = "") -> int:
        """A session opened; returns the process id. UnknownClient, PermissionDenied or ProcessDeclaredFailed if it
        may not."""
        member = self._published_member(client_uid, proof, " (the coordinator may have restarted): register again")
        self.liveness.attached(member, now)
        return self.admission.process_id(member)

    def heard(self, client_uid: str, now: float) -> None:
        """A Heartbeat on a session of ``client_uid`` (its owner was checked when the session opened)."""
        if (member := self.admission.members.get(client_uid)) is not None:
            self.liveness.heard(member, now)

    def detach(self, client_uid: str, now: float, *, carried: bool = False) -> None:
        """A session ended (closed, or its connection dropped; ``carried``: the agent's host session that carried it
        ended): unless another is open, the process has its grace to attach again (``Liveness.detached``)."""
        if (member := self.admission.members.get(client_uid)) is not None:
            self.liveness.detached(member, now, carried=carried)

    def leave(self, client_uid: str, now: float, *, proof: str = "") -> list[Effect]:
        """A graceful exit: the process is reported as left (and dropped, with the elastic policy). Leaving again
        is a no-op; UnknownClient for a client that never registered, PermissionDenied for a caller that does
        not own the process."""
        member = self.admission.members.get(client_uid)
        if member is None:
            raise UnknownClient(f"client {client_uid} is not a registered process: nothing to leave")
        self.admission.check_owner(member, proof)
        return self.left(member) + self.settle(now)

    def tick(self, now: float) -> list[Effect]:
        """Fails processes silent beyond their grace (forgets them before publication), in the order they went
        silent, and barriers past their deadline; decides what waits on who is alive. When most of the job went
        silent at once (``Liveness.mass_silence``), the processes lost by silence are not failed: SuspectSelf tells
        the shell to step aside (nothing journaled); those whose connections closed are failed as always."""
        effects: list[Effect] = []
        found = self.liveness.overdue(now, self.admission.members)
        suspicion = self.liveness.mass_silence(found, self.admission.members)
        if suspicion is not None:
            spared = [o for o in found if o.by_silence and o.member.status is Status.ALIVE]
            self.liveness.spare(spared)
            found = [o for o in found if not (o.by_silence and o.member.status is Status.ALIVE)]
            effects.append(SuspectSelf(suspicion, self.config.step_aside_s))
        for overdue in found:
            joining = overdue.member.status is Status.JOINING
            effects += (self.forget if joining else self.fail)(overdue.member, overdue.why)
        effects += self._journal_barriers(self.barriers.expire(now, self.describe_process))
        return effects + self.settle(now)

    # Barriers.
    def arrive(self, client_uid: str, name: str, process_ids: frozenset[int], timeout_s: float,
               now: float, *, proof: str = "", supersedes: str = "") -> tuple[BarrierResolved | None, list[Effect]]:
        """This process arrived at barrier ``name`` (all processes of the topology when ``process_ids`` is empty),
        which forgets the barrier it ``supersedes`` once it completes. Returns the barrier's result once it is
        resolved (None while others are awaited) and the effects. A second participant arriving at a finished
        barrier that one held alone is journaled (``journal.BarrierJoined``): a replay gives it back to its share."""
        pid = self.process_id_of(client_uid, proof=proof)
        participants = process_ids or frozenset(self.admission.in_topology)
        unknown = participants - self.admission.claims.keys()
        if unknown:
            raise InvalidArgument(f"barrier {name!r} names process ids {sorted(unknown)} that are not in the "
                                  f"topology (process ids 0..{self.config.num_processes - 1})")
        down = self.liveness.down
        finished, holder = self.barriers.outcome(name), self.barriers.holder(name)
        _, effects = self.barriers.arrive(name, pid, participants, timeout_s, now,
                                          {p: down[p] for p in participants & down.keys()}, supersedes=supersedes)
        if finished is not None and holder is not None and self.barriers.holder(name) is None:
            self._record(journal.BarrierJoined(name, pid))
        return self.barriers.outcome(name), self._journal_barriers(effects)

    def barrier_outcome(self, name: str) -> BarrierResolved | None:
        """How barrier ``name`` ended, or None while it is pending (or unknown)."""
        return self.barriers.outcome(name)

    def cancel_barrier(self, client_uid: str, name: str, now: float, *, process_ids: frozenset[int] = frozenset(),
                       proof: str = "") -> tuple[bool, list[Effect]]:
        """This participant fails barrier ``name`` with BarrierCancelled for every current and future waiter; before
        anyone arrived, when the barrier starts, if it is a participant then (``Barriers.cancel``). ``process_ids``:
        the participants as the caller names them (empty: not named). False, changing nothing, when the barrier had
        completed or failed already; PermissionDenied, changing nothing, for a caller that is not a participant."""
        del now  # a cancel's effect does not depend on the time
        pid = self.process_id_of(client_uid, proof=proof)
        unknown = process_ids - self.admission.claims.keys()
        if unknown:
            raise InvalidArgument(f"the cancel of barrier {name!r} names process ids {sorted(unknown)} that are not "
                                  f"in the topology (process ids 0..{self.config.num_processes - 1})")
        cancelled, effects = self.barriers.cancel(name, pid, process_ids, f"process {self.describe_process(pid)}")
        if cancelled and not effects:  # nobody arrived yet: kept for when the barrier starts
            error = self.barriers.early_cancels(name)[pid]
            self._record(journal.BarrierFinished(name, (), *journal.error_fields(error), canceller=pid))
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
        member = self.admission.members[client_uid]
        self._live_sets.call(pid, client_uid, call_id, member.incarnation, timeout_s, now)
        effects = self.settle(now)
        return self._live_sets.answer(client_uid, call_id), effects

    def restore_live_set(self, callers: tuple[tuple[str, str], ...], members: Members, error: IfrtError | None) -> None:
        """A decided agreement (replayed): each caller's answer."""
        self._live_sets.restore(callers, members, error)

    def live_answer(self, client_uid: str, call_id: str) -> Members | IfrtError | None:
        """The decided answer to this call (the same for every caller); None while it is pending or unknown."""
        return self._live_sets.answer(client_uid, call_id)

    # Preemption.
    def preemption_notice(self, client_uid: str, now: float, *, proof: str = "") -> list[Effect]:
        """This process will be preempted: every process is told, once (a second notice changes nothing)."""
        pid = self.process_id_of(client_uid, proof=proof)
        if self._preemption is not None:
            return []
        self._record(journal.PreemptionNoticed(pid))
        return [self.noticed(pid)]

    def noticed(self, process_id: int) -> Notify:
        """Process ``process_id`` gave the run's preemption notice (now, or replayed); the effect tells everyone."""
        self._preemption = Preemption(process_id)
        return self._notify(PreemptionNotice(process_id))

    def restore_sync(self, step: int) -> None:
        """The preemption sync step was decided (replayed)."""
        assert self._preemption is not None
        self._preemption.sync_step = step

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
            effects += self.settle(now)
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
        """The number of the latest job event (the last of the runs before, until this run has one)."""
        return self.history.head

    def catch_up(self, process_id: int, since: int, generation: int) -> CatchUp:
        """What the session of ``process_id``, holding ``generation`` and opening from job event ``since``, is sent
        before newer events (see coordinator.core.catchup); InvalidArgument past the latest event."""
        notice = self.notices()
        return catch_up(self.history, self.admission, self.published_at, self._incarnated_at,
                        notice[0] if notice else None, process_id, since, generation)

    # Questions about processes.
    def process_id_of(self, client_uid: str, *, proof: str = "") -> int:
        """The process id of a live, published client that proves it owns the registration (``proof``: the hash
        of its process secret); UnknownClient, PermissionDenied or ProcessDeclaredFailed otherwise."""
        return self.admission.process_id(self._published_member(client_uid, proof))

    def report(self, now: float) -> StatusReport:
        """The cluster as an operator sees it at ``now``: its state, every current process and its liveness."""
        return cluster_report(self.admission, now)

    def registration_of(self, process_id: int) -> Registration | None:
        """The registration of the current incarnation of ``process_id`` (None if no process holds it)."""
        member = self.admission.member_of(process_id)
        return None if member is None else member.registration

    def describe_process(self, process_id: int) -> str:
        """``2 (host-c (10.0.0.3))``, for messages."""
        return self.admission.describe_process(process_id)

    # The decisions that span the run's parts, and what they record.
    def fail(self, member: Member, why: str) -> list[Effect]:
        """Declares ``member`` failed (recorded): its sessions are evicted, every session told, the barriers that
        wait on it failed, the attempt's failures counted, and with the elastic policy the generation shrinks."""
        self._record(journal.Failed(member.uid, why))
        pid = self.admission.process_id(member)
        effects: list[Effect] = []
        if self.liveness.fail(member, pid, why):
            effects.append(Evict(member.uid, f"declared failed: {why}"))
        if self.config.on_failure is FailurePolicy.ELASTIC and not self.admission.survivors_suffice(pid):
            why += (f"; only {len(self.admission.in_topology) - 1} processes would remain, fewer than "
                    f"--min-processes {self.config.min_processes}: the cluster cannot continue")
        failed = self._notify(ProcessFailed(pid, why))  # numbered before the generation that drops it
        dropped = self._drop_if_elastic(pid)
        told = self._attempts.process_failed(pid, member.registration.hostname, why, self.config.limits)
        effects.append(replace(told, went_on=bool(dropped)) if dropped else told)
        return [failed, *self._journal_barriers(self.barriers.fail_including(pid, f"failed: {why}")),
                *effects, *dropped]

    def drop(self, process_ids: tuple[int, ...]) -> list[Effect]:
        """The job shrinks without ``process_ids`` (an agents' shrink): the next generation, once it is whole."""
        if self.topology is None:
            return []
        return self._published(self.admission.drop(*process_ids)) + self._publish_if_whole()

    def settle(self, now: float) -> list[Effect]:
        """Decides the pending live-set agreement and preemption sync point when they can be (recorded)."""
        effects: list[Effect] = []
        preemption = self._preemption
        if not self._live_sets.pending and (preemption is None or not preemption.waiting):
            return effects  # nothing waits: the tick costs nothing more
        alive = self._alive()
        resolved, left_out = self._live_sets.settle(alive, now, self.describe_process, self.admission.why_left_out)
        effects += left_out
        if resolved is not None:
            self._record(journal.LiveSetDecided(resolved.callers, resolved.members,
                                                *journal.error_fields(resolved.error)))
            effects.append(resolved)
        if preemption is not None:
            decided = preemption.settle(alive.keys(), now, self.describe_process)
            if decided is not None:
                if decided.step is not None:
                    self._record(journal.PreemptionSyncDecided(decided.step))
                effects.append(decided)
        return effects

    def _published_member(self, client_uid: str, proof: str, hint: str = "") -> Member:
        member = self.admission.members.get(client_uid)
        if member is None or self.topology is None or member.status is Status.JOINING:
            raise UnknownClient(f"client {client_uid} is not a registered process of the published topology{hint}")
        self.admission.check_owner(member, proof)
        check_usable(member)
        return member

    def _restart(self, r: Registration, holder: Member, now: float) -> tuple[Waiting | Published, list[Effect]]:
        admission = self.admission
        pid, member = admission.take_over(r, holder, now)
        self.liveness.restarted(member, pid)
        effects: list[Effect] = self._journal_barriers(self.barriers.fail_including(pid, "restarted"))
        admission.pending.add(member.uid)
        effects += self._publish_if_whole()  # numbered first: a peer holds the generation when it hears the restart
        effects.append(self._notify(ProcessRestarted(pid, member.incarnation)))
        if holder.sessions:  # it stopped answering, its session still open: the restart ends it
            effects.append(Evict(holder.uid, f"replaced by a restarted process from {r.describe()}"))
        self._incarnated_at[pid] = self.history.head
        return admission.answer(r), effects

    def _publish_if_whole(self) -> list[Effect]:
        """Answers the restarted processes once every id of the generation is held by a process that neither
        failed nor left: the next generation when theirs changed it. Until then none is published, so no process
        is handed a generation holding a process known to be gone."""
        admission = self.admission
        if not admission.pending or admission.gone():
            return []
        admission.pending.clear()
        return self._published(admission.republish_if_changed())

    def left(self, member: Member) -> list[Effect]:
        """``member`` left (recorded): reported, its barriers failed, dropped with the elastic policy."""
        if not member.live:
            return []
        if member.status is Status.JOINING:
            return self.forget(member, "left before the topology was published")
        self._record(journal.Left(member.uid))
        pid = self.admission.process_id(member)
        self.liveness.leave(member, pid)
        self.admission.left.add(pid)
        return [self._notify(ProcessLeft(pid)), *self._journal_barriers(self.barriers.fail_including(pid, "left")),
                *self._drop_if_elastic(pid)]

    def forget(self, member: Member, why: str) -> list[Effect]:
        """``member`` is forgotten before publication (recorded): its id is free again."""
        self._record(journal.Forgot(member.uid, why))
        self.admission.forget(member)
        return [Forgotten(member.registration.describe(), why)]

    def _drop_if_elastic(self, pid: int) -> list[Effect]:
        if self.config.on_failure is not FailurePolicy.ELASTIC or not self.admission.survivors_suffice(pid):
            return []
        return self._published(self.admission.drop(pid)) + self._publish_if_whole()

    def _published(self, topology: TopologyContent | None) -> list[Effect]:
        """Numbers a new generation (if any) in the job's history; returns the effect that sends it."""
        if topology is None:
            return []
        self.published_at = self.history.add(GenerationPublished(topology.generation))
        return [Republish(topology, self.published_at)]

    def _journal_barriers(self, effects: list[BarrierResolved]) -> list[Effect]:
        """Records each barrier that just finished (with its participants, error, the barrier it forgot and the
        process that holds it alone, if one does); returns the effects."""
        for e in effects:
            barrier = self.barriers.get(e.name)
            assert barrier is not None
            self._record(journal.BarrierFinished(e.name, tuple(sorted(barrier.participants)),
                                                 *journal.error_fields(e.error), forgot=barrier.supersedes,
                                                 held_by=self.barriers.holder(e.name)))
        return list(effects)

    def _notify(self, event: ProcessFailed | ProcessRestarted | ProcessLeft | PreemptionNotice) -> Notify:
        """Numbers ``event`` in the job's history; returns the effect that tells the sessions."""
        return Notify(event, self.history.add(event))

    def _alive(self) -> dict[int, tuple[str, int]]:
        """Process id -> (client uid, incarnation) of every process of the topology that is not failed or left."""
        up = sorted(self.admission.in_topology - self.liveness.down.keys())
        return {pid: (m.uid, m.incarnation) for pid in up if (m := self.admission.member_of(pid)) is not None}

    def _check_kv_caller(self, client_uid: str, key: str, proof: str) -> None:
        """A live process of the topology may use any key; any caller (past the token) those under
        AGENT_KEY_PREFIX. UnknownClient, PermissionDenied or ProcessDeclaredFailed otherwise."""
        if not key.startswith(AGENT_KEY_PREFIX):
            self.process_id_of(client_uid, proof=proof)

    def is_agent(self, client_uid: str) -> bool:
        """Whether the caller is no process (a torchrun agent): only the latest such callers' answers are kept."""
        return client_uid not in self.admission.members

