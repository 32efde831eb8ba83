"""The coordinator's decisions as a deterministic state machine with no I/O: a router (``ClusterState``) over the
job's attempts (``coordinator.core.attempts``, which outlive runs) and the current run (``coordinator.core.run.Run``,
every per-run part), which journals what they decide. Host takeovers (``coordinator.core.takeover``), shrinks
(``coordinator.core.shrink``) and the host calls' rules (``coordinator.core.host_calls``) are pure decisions it applies.

    attempt A, run R ──(NextAttempt decided: a failure restarts the job)──────────▶ attempt A+1, a new Run
         │         └──(every process of run R left or failed, then a registration)──▶ attempt A, run R+1, a new Run
         ├──(an agent's NextAttempt replaces one process: same run, its id taken over)
         ├──(a lost host's agent absent: a spare host takes over its ids, journaled)
         └──(the agents give up on failed processes: the run shrinks to its survivors, journaled)

A new attempt or run is a new ``Run`` object, numbering its events on from the last of the one before. Every method
is an event (time arrives as data, ``now``) and returns its effects for the shell to carry out. A rejected event
raises a typed ``ifrt.errors`` error and leaves the state exactly as it was. Every durable decision is journaled
(``take_journal``) for the shell to persist before acknowledging; ``replay`` of those entries gives the same state and
byte-identical topologies, on this coordinator or on the one that takes over.

A decision of the router's own has one shape: a pure ``decide`` over plain facts returns the entry, a refusal or
nothing; the live path journals the entry and applies it with ``APPLY``, the same row a replay applies, so a decision
cannot apply one way live and another after a failover. The run's decisions come first in the journal, in the order
they were made (``Run.take_entries``), and replay through ``coordinator.core.replays``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from coordinator.core import journal, runs
from coordinator.core.admission import Admission
from coordinator.core.agreement import Members
from coordinator.core.attempts import Attempts
from coordinator.core.barriers import BarrierResolved
from coordinator.core.cluster import ClusterConfig, FailurePolicy
from coordinator.core.effects import (
    Effect,
    Published,
    RunEnded,
    RunStarted,
    Waiting,
    WaitingForHolder,
    WaitingForNextRun,
)
from coordinator.core.history import CatchUp
from coordinator.core.host_calls import check_agent_named, check_batch, check_carried, check_host, own_worker
from coordinator.core.job_records import Agent, AttemptStarted, Host, HostTakenOver, JobView, NextAttempt
from coordinator.core.kv_calls import KeyValueCalls
from coordinator.core.limits import shown
from coordinator.core.members import claim_of
from coordinator.core.registration import Registration
from coordinator.core.replays import REPLAYS
from coordinator.core.run import Run
from coordinator.core.shrink import AttemptFacts, ShrinkAnswer, Wait
from coordinator.core.shrink import decide as decide_shrink
from coordinator.core.status import StatusReport
from coordinator.core.takeover import LostHost, find_lost
from coordinator.core.takeover import decide as decide_takeover
from coordinator.core.transfer_parties import Parties, parties
from ifrt.errors import IfrtError, StaleSession
from ifrt.events import PreemptionNotice
from ifrt.progress import Progress
from ifrt.records import TopologyContent

Admitted = Waiting | Published | WaitingForNextRun | WaitingForHolder


class ClusterState:
    """The job on this coordinator: its attempts, the current run of the current attempt, and the journal."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._journal: list[journal.Entry] = []
        self.attempts = Attempts(config.attempt, config.max_restarts)
        self.current = Run(config, runs.FIRST_RUN, self.attempts)
        """The current run: every per-run call goes to it."""

    @property
    def run(self) -> int:
        """The job's run on this coordinator (``coordinator.core.runs``)."""
        return self.current.number

    def _next_run(self, number: int) -> None:
        """Run ``number`` of the current attempt starts empty, its events numbered on from the last one's."""
        config = replace(self.config, attempt=self.attempts.current)
        self._journal += self.current.take_entries()  # the ended run's decisions stay ahead of the next one's
        self.current = Run(config, number, self.attempts, self.current.event_position)

    # Journal.
    def take_journal(self) -> list[journal.Entry]:
        """The durable decisions made since the last call, in order, for the shell to persist."""
        entries, self._journal[:] = [*self._journal, *self.current.take_entries()], []
        return entries

    def replay(self, entry: journal.Entry) -> None:
        """Applies one journaled decision again (on restart or takeover); nothing is journaled anew."""
        self._apply(entry)
        self._journal.clear()
        self.current.take_entries()

    def _commit(self, entry: journal.Entry) -> list[Effect]:
        """Journals one of the router's decisions, after what the run decided before it, and applies it as a replay
        would (``APPLY``)."""
        self._journal += self.current.take_entries()
        self._journal.append(entry)
        return self._apply(entry)

    def _apply(self, entry: journal.Entry) -> list[Effect]:
        apply = APPLY.get(type(entry))
        if apply is not None:
            return apply(self, entry)
        REPLAYS[type(entry)](self.current, entry)
        return []

    def reset_liveness(self, now: float) -> None:
        """After a replay: nobody is attached yet, and every live process has the grace period from ``now``."""
        self.current.reset_liveness(now)

    def check_current(self, run: int, attempt: int) -> None:
        """StaleSession for a session opened for another run or attempt of the job than the current one (0: not
        said): its registrations belong to one that ended, and it registers again."""
        if (run and run != self.run) or (attempt and attempt != self.attempts.current):
            current = self.attempts.current
            raise StaleSession(f"this session is for run {run or self.run} of attempt {attempt or current} of the "
                               f"job, which ended: the job is in run {self.run} of attempt {current}; register again")

    # Registration and the job's runs.
    def register(self, r: Registration, now: float, *, restoring: bool = False) -> tuple[Admitted, list[Effect]]:
        """Admits a process, recognizes its retry, takes over the id of a dead one (a restart), or tells it to wait
        for the next run (its id left the run). The first registration after every process of the run left or
        failed starts the next run. The answer says what the shell logs and wakes: the admission, and the first
        publication when this completed the cluster."""
        started: list[Effect] = []
        admission = self.current.admission
        if (r.client_uid not in admission.members or r.client_uid in admission.pending) and self.current.over():
            # a new process, or a restart that never got a generation of the run: either starts the next run
            trial = Admission(self.current.config)
            trial.held = admission.held
            trial.check_fits(r, self.attempts.current)  # refused, it changes nothing (not even the run)
            started = self._commit(journal.RunStarted(self.run + 1))
        outcome, effects = self.current.register(r, now, restoring=restoring)
        return outcome, started + effects

    def waiting_for_next_run(self) -> WaitingForNextRun | None:
        """What a registration that waits for the next run is told now; None once the run is over (it may start
        the next one)."""
        return None if self.current.over() else runs.waiting(self.current.admission, self.run)

    def _start_run(self, entry: journal.RunStarted) -> list[Effect]:
        """Starts run ``entry.run``: a new Run; the agents' keys (torchrun's rendezvous, outside any run) carry over,
        and the registrations journaled in this attempt stay counted against ``--max-registration-bytes``."""
        ended = self.current
        self._next_run(entry.run)
        self.current.carry_from(ended)
        self.attempts.run_started()
        return [RunStarted(ended.number, entry.run)]

    def _ended(self, was_over: bool) -> list[Effect]:
        """RunEnded when the event just handled ended the run (registrations waiting for the next one may start
        it)."""
        return [RunEnded(self.run)] if not was_over and self.current.over() else []

    def leave(self, client_uid: str, now: float, *, proof: str = "") -> list[Effect]:
        """A graceful exit (see Run.leave); RunEnded when it was the run's last process."""
        was_over = self.current.over()
        return self.current.leave(client_uid, now, proof=proof) + self._ended(was_over)

    def tick(self, now: float) -> list[Effect]:
        """The run's clock (see Run.tick); RunEnded when its last process failed."""
        was_over = self.current.over()
        return self.current.tick(now) + self._ended(was_over)

    # Attempts: ifrt run's agents joining, NextAttempt's decisions.
    def join_agent(self, agent: Agent, max_restarts: int | None, absent: frozenset[str] = frozenset(),
                   recover: str = "", watching: frozenset[str] = frozenset(), bound: bool = False) -> list[Effect]:
        """An ``ifrt run`` agent joins the job (journaled; nothing when it is one already); ``absent``: the agents the
        shell has not seen watching for a while, ``watching``: those watching now, ``bound``: agents prove their
        host with its credential (one agent per host). A new run of the job (see coordinator.core.attempts) starts a new
        attempt with a new Run."""
        entry = self.attempts.join(agent, max_restarts, self.config.num_processes, self.config.limits, absent, recover,
                                   watching, bound)
        return [] if entry is None else self._commit(entry)

    def next_attempt(self, call: NextAttempt, proof: str = "", bound: bool = False) -> tuple[JobView, list[Effect]]:
        """NextAttempt from the agent ``call.agent_uid`` (``proof``: the hash of the secret its call carries): ends
        the job's current attempt once (journaled) and starts the next with a new Run, or marks the restarts
        exhausted; a retry or a later caller is answered the same, changing nothing. PermissionDenied for a caller
        that is no agent of the job, or a cause it may not give (see coordinator.core.attempts). ``bound``: agents prove
        their host (one agent per host), so a process id nobody holds is none of an agent whose workers are all
        registered."""
        agent = self.attempts.deciding_agent(call.agent_uid, proof)
        entry = self.attempts.decide(call, self.config.limits, agent, self._registered_from,
                                     self._ids_registered_from if bound else lambda where: ())
        if entry is None:
            return self.attempts.view(), []
        replacing = entry.replace and not entry.exhausted and self.current.topology is not None
        member = self.current.admission.member_of(entry.process_id) if replacing else None
        failed = (self.current.fail(member, f"its agent replaces it: {entry.reason}")
                  if member and member.live else [])
        effects = failed + self._commit(entry)  # after its holder's failure: watches and a replay hear both in order
        return self.attempts.view(), effects

    def _end_attempt(self, entry: journal.AttemptDecided) -> list[Effect]:
        effect = self.attempts.apply(entry)
        if isinstance(effect, AttemptStarted):
            self._next_run(self.run)
        return [effect]

    def _agent_joined(self, entry: journal.AgentJoined) -> list[Effect]:
        effect = self.attempts.apply_joined(entry)
        if isinstance(effect, AttemptStarted):
            self._next_run(self.run)
        return [] if effect is None else [effect]

    def _registered_from(self, process_id: int) -> Host | None:
        """Where the process holding ``process_id`` in this attempt registered from (None: none holds it)."""
        admission = self.current.admission
        if admission.topology is not None:
            member = admission.member_of(process_id)
        else:  # before publication only explicit ids are known
            member = next((m for m in admission.members.values()
                           if m.registration.process_id == process_id and m.live), None)
        return None if member is None else (member.registration.hostname, member.registration.host_address)

    def _ids_registered_from(self, where: Host) -> tuple[int | None, ...]:
        """The ids of the live processes of this attempt registered from ``where`` (hostname, address), in their
        order; None for one whose id is not assigned yet."""
        admission = self.current.admission
        return tuple(admission.process_ids.get(claim_of(m.registration)) if admission.topology is not None
                     else m.registration.process_id for m in admission.members.values()
                     if m.live and (m.registration.hostname, m.registration.host_address) == where)

    # Lost hosts (coordinator.core.takeover) and shrinks (coordinator.core.shrink).
    def lost_hosts(self, absent: frozenset[str]) -> list[LostHost]:
        """The job's hosts lost in this attempt (``absent``: agents not seen watching for the heartbeat timeout)."""
        if self.current.topology is None or self.attempts.exhausted:
            return []
        admission, shrunk = self.current.admission, self.attempts.shrunk
        elastic = self.current.config.on_failure is FailurePolicy.ELASTIC  # its dropped ids come back
        return find_lost(self.attempts.listed(), absent, self.attempts.declared,
                         lambda where: tuple(p for p in admission.ids_from(where, dropped=elastic) if p not in shrunk))

    def take_over_host(self, absent: frozenset[str]) -> list[Effect]:
        """The coordinator's own decision: a spare host takes over a lost host's ids (journaled, once; see
        coordinator.core.takeover); nothing when no host is lost or no spare host can."""
        attempts = self.attempts
        entry = decide_takeover(self.lost_hosts(absent), attempts.listed(), absent, attempt=attempts.current,
                                exhausted_now=attempts.restarts >= attempts.budget)
        if entry is None:
            return []
        # The lost host's processes still within their grace fail now, before their ids change hands: declared later,
        # a failure would name the spare host's new worker of that id. Watches and a replay hear both in this order.
        members = [] if entry.exhausted else [self.current.admission.member_of(pid) for pid in entry.process_ids]
        failed = [e for m in members if m is not None and m.live
                  for e in self.current.fail(m, f"its host is taken over: {entry.reason}")]
        return failed + self._commit(entry)

    def _taken_over(self, entry: journal.HostTakenOver) -> list[Effect]:
        effect = self.attempts.apply_taken_over(entry)
        if isinstance(effect, HostTakenOver):
            spare = next(a for a in self.attempts.listed() if a.uid == entry.spare_uid)
            admission = self.current.admission
            admission.grant(entry.process_ids, spare.where)
            return [replace(effect, explicit_ids=admission.names_ids)]
        return [effect]

    def shrink(self, call: NextAttempt, proof: str = "", waited: Callable[[int], float] = lambda pid: math.inf,
               absent: frozenset[str] = frozenset()) -> tuple[ShrinkAnswer, list[Effect]]:
        """NextAttempt with ``shrink`` from the agent ``call.agent_uid`` (``proof``: the hash of its call's secret):
        drops the named failed processes once (journaled) and publishes a new generation over the survivors, refuses,
        or says how long to wait while a process's own agent may still replace it (see coordinator.core.shrink;
        ``waited``: seconds since the coordinator declared a process failed, ``absent``: agents gone).
        PermissionDenied for a caller that is no agent of the job, or a spare host."""
        self.attempts.deciding_agent(call.agent_uid, proof)
        config = self.config
        in_topology = self.current.admission.in_topology if self.current.topology is not None else set()
        attempts = self.attempts
        facts = AttemptFacts(attempts.current, attempts.decided(call.request_id) or attempts.exhausted,
                             attempts.shrunk, frozenset(attempts.declared), tuple(attempts.listed()))
        decision = decide_shrink(call, facts, in_topology, allowed=config.shrink,
                                 min_processes=config.min_processes, num_processes=config.num_processes,
                                 limits=config.limits, where_of=self._registered_from, waited=waited, absent=absent)
        if isinstance(decision, Wait):
            return ShrinkAnswer(self.attempts.view(), wait_s=decision.seconds), []
        if isinstance(decision, str) or decision is None:
            return ShrinkAnswer(self.attempts.view(), decision or ""), []
        effects = self._commit(decision)
        return ShrinkAnswer(self.attempts.view()), effects

    def _shrunk(self, entry: journal.Shrunk) -> list[Effect]:
        return [self.attempts.apply_shrunk(entry), *self.current.drop(entry.process_ids)]

    # Host calls: RegisterHost and HostSession's commands (rules in coordinator.core.host_calls).
    def host_agent(self, agent_uid: str, proof: str) -> Agent:
        """The job's agent ``agent_uid``, proven by ``proof`` (the hash of the secret its call carries);
        PermissionDenied otherwise: only an agent that joined the job with WatchJob carries a host."""
        check_agent_named(agent_uid)
        return self.attempts.deciding_agent(agent_uid, proof)

    def register_host(self, agent: Agent, registrations: Sequence[Registration | IfrtError],
                      now: float) -> tuple[list[Admitted | IfrtError], list[Effect]]:
        """Admits each of a host's processes as its own Register would (``registrations``: each checked already, or
        why it was refused); one refused changes nothing and leaves the others admitted. InvalidArgument, changing
        nothing, for more processes than the agent runs."""
        check_batch(agent, len(registrations))
        results: list[Admitted | IfrtError] = []
        effects: list[Effect] = []
        for r in registrations:
            try:
                if isinstance(r, IfrtError):
                    raise r
                check_host(agent, r.hostname, r.host_address, f"process {shown(r.client_uid)} (local rank "
                                                              f"{r.local_rank})")
                outcome, more = self.register(r, now)
            except IfrtError as e:
                results.append(e)
                continue
            results.append(outcome)
            effects += more
        return results, effects

    def attach_worker(self, agent: Agent, client_uid: str, now: float, proof: str, carried: int = 0) -> int:
        """A worker's session opened with its agent: the host's session, which carries ``carried`` others, vouches
        for it from now on (as its own session would); returns its process id. UnknownClient, PermissionDenied or
        ProcessDeclaredFailed as for its own session, PermissionDenied for another host's process, and
        ResourceExhausted past the workers the agent runs."""
        own_worker(agent, self.current.admission.members.get(client_uid), client_uid)
        check_carried(agent, carried)
        return self.current.attach(client_uid, now, proof=proof)

    def worker_exited(self, agent: Agent, client_uid: str, reason: str, now: float, proof: str) -> list[Effect]:
        """The agent saw its worker exit, or stop answering it: the process fails at once (journaled) instead of
        after its reconnect grace. Nothing for a process that failed, left or was replaced already."""
        run = self.current
        member = own_worker(agent, run.admission.members.get(client_uid), client_uid)
        run.admission.check_owner(member, proof)
        if not member.live:
            return []
        was_over = run.over()
        return run.fail(member, reason) + run.settle(now) + self._ended(was_over)

    # The current run's calls, for the shell: the router hands each to whichever run is current (the rules are
    # ``coordinator.core.run.Run``'s, under the same names).
    def attach(self, client_uid: str, now: float, *, proof: str = "") -> int:
        return self.current.attach(client_uid, now, proof=proof)

    def detach(self, client_uid: str, now: float, *, carried: bool = False) -> None:
        self.current.detach(client_uid, now, carried=carried)

    def heard(self, client_uid: str, now: float) -> None:
        self.current.heard(client_uid, now)

    def call_started(self, client_uid: str, now: float) -> None:
        self.current.call_started(client_uid, now)

    def call_ended(self, client_uid: str, now: float) -> None:
        self.current.call_ended(client_uid, now)

    def answer(self, client_uid: str, now: float) -> Waiting | Published:
        return self.current.answer(client_uid, now)

    def catch_up(self, process_id: int, since: int, generation: int) -> CatchUp:
        return self.current.catch_up(process_id, since, generation)

    def notices(self) -> list[PreemptionNotice]:
        return self.current.notices()

    @property
    def keys(self) -> KeyValueCalls:
        return self.current.keys

    def arrive(self, client_uid: str, name: str, process_ids: frozenset[int], timeout_s: float, now: float, *,
               proof: str = "", supersedes: str = "") -> tuple[BarrierResolved | None, list[Effect]]:
        return self.current.arrive(client_uid, name, process_ids, timeout_s, now, proof=proof, supersedes=supersedes)

    def cancel_barrier(self, client_uid: str, name: str, now: float, *, process_ids: frozenset[int] = frozenset(),
                       proof: str = "") -> tuple[bool, list[Effect]]:
        return self.current.cancel_barrier(client_uid, name, now, process_ids=process_ids, proof=proof)

    def live_processes(self, client_uid: str, call_id: str, timeout_s: float, now: float, *,
                       proof: str = "") -> tuple[Members | IfrtError | None, list[Effect]]:
        return self.current.live_processes(client_uid, call_id, timeout_s, now, proof=proof)

    def preemption_notice(self, client_uid: str, now: float, *, proof: str = "") -> list[Effect]:
        return self.current.preemption_notice(client_uid, now, proof=proof)

    def preemption_sync(self, client_uid: str, step: int, timeout_s: float, now: float, *,
                        proof: str = "") -> tuple[int | IfrtError | None, list[Effect]]:
        return self.current.preemption_sync(client_uid, step, timeout_s, now, proof=proof)

    def transfer_parties(self, client_uid: str, peer: int, proof: str) -> Parties:
        return parties(self.current, client_uid, peer, proof)

    def report(self, now: float) -> StatusReport:
        return self.current.report(now)

    def progress(self, now: float) -> Progress:
        return self.current.progress(now)

    def describe_process(self, process_id: int) -> str:
        return self.current.describe_process(process_id)

    def registration_of(self, process_id: int) -> Registration | None:
        return self.current.registration_of(process_id)

    # What the shell and the operator's view read of the current run.
    @property
    def topology(self) -> TopologyContent | None:
        return self.current.topology

    @property
    def registered(self) -> int:
        return self.current.admission.registered

    @property
    def published_at(self) -> int:
        """The job event number that published the current generation."""
        return self.current.published_at

    @property
    def event_position(self) -> int:
        """The number of the latest job event (0: none yet)."""
        return self.current.event_position


APPLY: dict[type, Callable[[ClusterState, Any], list[Effect]]] = {
    journal.AttemptDecided: ClusterState._end_attempt,
    journal.AgentJoined: ClusterState._agent_joined,
    journal.RunStarted: ClusterState._start_run,
    journal.HostTakenOver: ClusterState._taken_over,
    journal.Shrunk: ClusterState._shrunk,
}
"""The router's journaled decisions and how each applies: the live path (after ``decide`` and the journal) and a
replay alike. Every other entry is the current run's (``coordinator.core.replays``)."""
