"""The job's attempts as a pure sub-machine: which attempt runs, why the latest ones ended, who the job's agents are,
the job's restart budget, and NextAttempt's decision, made once per attempt however many agents ask and however
often they retry. No I/O: the router (``ClusterState``) journals what this decides and starts its other
sub-machines afresh for a new attempt.

    attempt F ──(NextAttempt(F): restarts < budget)──▶ attempt F+1 ──▶ ... ──▶ attempt N
    attempt N ──(NextAttempt(N): restarts >= budget)──▶ exhausted ──(a new agent joins)──▶ attempt N+1, a new run
    attempt N ──(every agent gone, a new agent joins)──▶ attempt N+1, a new run

F is the first attempt of the run (the coordinator's ``--attempt``, 0 by default); the restarts made so far are N - F,
plus the processes replaced in the run (``NextAttempt`` with ``replace``: the attempt goes on, one process id starts
anew on its own agent, every other process keeps running), which count against the same budget.

Authority: only the job decides about the job.

- An agent joins with ``WatchJob`` (journaled: its id, host, the address it called from, the sha256 of its secret);
  every later call of that agent id must carry the same secret (``PermissionDenied`` otherwise), as a process's.
  The job's agents run at most ``num_processes`` workers together: once they cover the job, a new agent joins only
  in the place of one that is gone (absent longer than the heartbeat timeout) or of one on its own host (its
  restart). A new agent of a job whose restarts are exhausted, or whose agents are all gone, starts the job's next
  run: the next attempt, with no failure and the whole budget.
- Where agents are bound to hosts (``bound``: the coordinator's ``--agent-key-file``, each agent proving its host
  with that host's credential), a host has one agent: a new agent of a host whose agent watches the job now is
  refused (``HostHeld``, naming that agent); one whose agent does not watch takes its place (a restart, or a new
  agent after a partition), whether or not the job is covered. A host's place is its own: a gone agent's place is
  kept for an agent of its host, never taken by another host's credential (a host that replaces a lost one joins as
  a spare host, which the coordinator hands the lost host's ids). Unbound, where host names prove nothing, several
  agents may share one (as on one test machine) and a newcomer takes a gone agent's place, as described above.
- The restart budget is the job's: the coordinator's ``--max-restarts``, else the first agent's of the run, else 0.
  An agent stating another is refused (``ClusterMismatch``).
- Replacing a process needs an agent of the job asking about one of its own workers (registered with its hostname
  from its address, or not registered at all; where agents are bound, not registered while one of its workers is
  not): an agent cannot replace, nor make the job spend its budget on, another host's process. A replacement is
  decided once per request (retries answered the same) and bounded by the budget.
- The job's ``--recover`` mode is its first agent's (of the run); an agent stating another is refused
  (``ClusterMismatch``). A spare host (``ifrt run --spare-host``) joins as an agent that runs nothing and covers no
  process; only the coordinator hands it a lost host's ids (``coordinator.core.takeover``), counted as one replacement.
- Ending an attempt needs an agent of the job and a cause it may give: a process the coordinator declared failed in
  the attempt, or one of the agent's own workers (a process registered with its hostname from its address, or one
  it could not name, such as a worker that failed before it registered; where agents are bound, an id nobody holds
  is its own only while one of its workers is not registered). A failure of another host's process that
  the coordinator did not declare is refused (``PermissionDenied``), changing nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from coordinator.core import journal
from coordinator.core.job_records import (
    UNKNOWN_PROCESS,
    Agent,
    AttemptFailure,
    AttemptProcessFailed,
    AttemptsExhausted,
    AttemptStarted,
    Host,
    HostTakenOver,
    JobShrunk,
    JobView,
    NextAttempt,
    ProcessReplaced,
)
from coordinator.core.limits import FLAGS, Limits, check_call_id, shown
from coordinator.core.registration import Registration
from ifrt.errors import ClusterMismatch, HostHeld, InvalidArgument, PermissionDenied, ResourceExhausted

FAILURES_KEPT = 32
"""Ended attempts whose failure a JobState lists (the latest ones; the others are only counted): each is at most two
strings of ``--max-string-bytes``, so a JobState stays small however often the job restarted."""
REQUESTS_REMEMBERED = 1024
"""NextAttempt request ids remembered for their retries (one per agent and attempt; the oldest is forgotten)."""
class Attempts:
    """The current attempt, the latest failures, the job's agents and budget; ``decide`` answers NextAttempt."""

    def __init__(self, first: int, max_restarts: int | None = None) -> None:
        self.first = first
        self.current = first
        self.exhausted = False
        self._configured = max_restarts  # the coordinator's --max-restarts
        self._stated: int | None = None  # the first agent's, when the coordinator has none
        self._stated_by = ""
        self._failures: list[AttemptFailure] = []
        self._earlier = 0
        self._decided_by: dict[str, None] = {}  # request ids of the decisions, oldest first
        self._agents: dict[str, Agent] = {}  # by uid, in the order they joined
        self._agents_seen: tuple[frozenset[str], int] | None = None  # their uids, the workers of those running
        self._declared: dict[int, AttemptFailure] = {}  # processes the coordinator declared failed in this attempt
        self._replacements = 0  # processes replaced in this run
        self._mode = ""  # the job's --recover mode, as its first agent of the run stated it ("": none stated)
        self._mode_by = ""
        self._shrunk: set[int] = set()  # process ids a shrink dropped in this attempt (coordinator.core.shrink)
        self._replacing: set[int] = set()  # ids whose decided replacement has not registered yet in this run

    @property
    def budget(self) -> int:
        """The job's restart budget now."""
        return next((b for b in (self._configured, self._stated) if b is not None), 0)

    def view(self) -> JobView:
        """The job as agents see it now."""
        return JobView(self.current, tuple(self._failures), self.exhausted, self.budget, self._earlier,
                       self._replacements)

    @property
    def restarts(self) -> int:
        """The restarts of this run so far: attempts after the first, and processes replaced."""
        return self.current - self.first + self._replacements

    # Agents.
    def join(self, agent: Agent, max_restarts: int | None, num_processes: int, limits: Limits,
             absent: frozenset[str] = frozenset(), recover: str = "", watching: frozenset[str] = frozenset(),
             bound: bool = False) -> journal.AgentJoined | None:
        """The entry that makes ``agent`` one of the job's (to journal and ``apply_joined``); None when it is one
        already, as it is. ``absent``: the agents that have not watched the job for a while (gone, as far as the
        coordinator can tell); ``watching``: those whose job watch is open now. A new agent starts a new run of the job
        when the restarts are exhausted or every agent of the job is absent; it takes the place of absent agents, then
        of agents on its own host that do not watch now (a restart: a live agent there is never taken for it), when
        the job's agents would otherwise run more than ``num_processes`` workers. ``recover``: the ``--recover`` mode
        it states ("": none), which must be the job's. A spare host (``agent.spare``) runs no worker: it counts
        against no process, starts no run, and takes the place of absent spare hosts (at most ``--max-agents`` of
        them). ``bound``: agents are bound to hosts by their credentials, so a host has one agent (see the module's
        docstring). PermissionDenied (HostHeld), ClusterMismatch, InvalidArgument or ResourceExhausted, changing
        nothing, when it may not join."""
        _check_agent(agent, limits)
        known = self._agents.get(agent.uid)
        if known is not None:
            _check_secret(known, agent.secret_hash)
            if bound and known.host != agent.host:
                raise PermissionDenied(f"agent {shown(known.uid)} joined for host {shown(known.host)}: it acts for "
                                       f"that host only, not for {shown(agent.host)}")
        own_host = [a for a in self._agents.values() if a.host == agent.host] if bound and known is None else []
        if holding := [a for a in own_host if a.uid in watching]:
            raise HostHeld(f"host {shown(agent.host)} has an agent of the job that watches it: "
                           f"{', '.join(f'agent {shown(a.uid)} ({a.address})' for a in holding)}; a host has one "
                           "agent, and another presenting its credential takes its place only once that one is gone "
                           "(its watch ended, as a restarted agent's predecessor's has)")
        new_run = known is None and not agent.spare and (
            self.exhausted or (bool(self._agents) and self._agents.keys() <= absent))
        if recover and self._mode and not new_run and recover != self._mode:
            raise ClusterMismatch(f"this agent runs with --recover {recover}, but the job's agents run with "
                                  f"--recover {self._mode} (stated by the agent on {shown(self._mode_by)}): "
                                  "start every agent of the job with the same --recover")
        if max_restarts is not None:
            budget, origin = self._budget_origin(new_run)
            if budget is not None and budget != max_restarts:
                raise ClusterMismatch(f"this agent expects --max-restarts {max_restarts}, but the job's restart budget "
                                      f"is {budget} ({origin}): start every agent with the same --max-restarts, or "
                                      "without it to take the job's")
        if known == agent or (known is not None and agent.spare and not known.spare):
            return None  # one of the job's already (a spare host that took over a lost host's ids watches again)
        replaced = [] if new_run else [a.uid for a in own_host]  # gone: a restart, or back after a partition
        if known is None and agent.spare:
            others = [a for a in self._agents.values() if a.uid not in replaced]
            replaced += spare_places(others, absent, limits.agents)
        elif known is None and not new_run:
            running = self._seen()[1] - sum(a.workers for a in own_host if not a.spare)
            running_agents = [a for a in self._agents.values() if not a.spare and a.uid not in replaced] if (
                running + agent.workers > num_processes) else []  # a spare host runs nothing yet
            places = [] if bound else [  # bound: a host's place is its own agent's only
                *(a for a in running_agents if a.uid in absent),
                *(a for a in running_agents
                  if a.where == agent.where and a.uid not in absent and a.uid not in watching)]
            for old in places:
                if running + agent.workers <= num_processes:
                    break
                replaced.append(old.uid)
                running -= old.workers
            if running + agent.workers > num_processes:
                hosts = sorted({f"{shown(a.host)} ({a.address})" for a in running_agents})
                kept = [f"host {shown(a.host)} (agent {shown(a.uid)}, not watching now)" for a in running_agents
                        if a.uid not in watching]
                held = (f"; the places of {', '.join(kept[:8])}{' ...' if len(kept) > 8 else ''} are kept for "
                        "their own hosts' agents" if kept else "")
                why = (f"{held}: a host's credential takes no other host's place (an agent restarted on its host takes "
                       "its predecessor's; a host that replaces a lost one joins as a spare host, ifrt run "
                       "--spare-host)" if bound else
                       " (an agent restarted on its host, or one that comes once an agent is gone, takes its place)")
                raise ClusterMismatch(f"the job's agents on {', '.join(hosts[:8])}{' ...' if len(hosts) > 8 else ''} "
                                      f"run {running} workers; this agent's {agent.workers} would exceed the job's "
                                      f"{num_processes} processes: it is no agent of this job{why}")
        return journal.AgentJoined(agent.uid, agent.host, agent.address, agent.secret_hash, agent.workers,
                                   max_restarts, new_run, tuple(replaced), recover, agent.spare,
                                   agent.replace_timeout_s, agent.joined_unix_s)

    def apply_joined(self, entry: journal.AgentJoined) -> AttemptStarted | HostTakenOver | None:
        """Records an agent (joined now, or replayed); returns AttemptStarted when it started a new run of the job,
        HostTakenOver when it took the place of an agent on its own host (a lost host's agent came back)."""
        if entry.new_run:  # the next attempt, with no failure and the whole budget
            self.current += 1
            self.first, self.exhausted = self.current, False
            self._failures, self._earlier, self._declared, self._replacements = [], 0, {}, 0
            self._replacing, self._shrunk = set(), set()
            self._agents, self._stated, self._stated_by, self._mode, self._mode_by = {}, None, "", "", ""
        back = any(a.host == entry.host for uid in entry.replaced if (a := self._agents.get(uid)) is not None)
        for uid in entry.replaced:
            self._agents.pop(uid, None)
        self._agents[entry.agent_uid] = Agent(entry.agent_uid, entry.host, entry.host_address, entry.secret_hash,
                                              entry.workers, entry.spare, entry.replace_timeout_s,
                                              entry.joined_unix_s)
        self._agents_seen = None
        if entry.max_restarts is not None and self._stated is None:
            self._stated, self._stated_by = entry.max_restarts, entry.host
        if entry.recover and not self._mode:
            self._mode, self._mode_by = entry.recover, entry.host
        if entry.new_run:
            return AttemptStarted(self.view())
        if back and not entry.spare:  # its workers take their ids back as restarts: nobody waits for that host
            came = AttemptFailure(self.current, UNKNOWN_PROCESS, entry.host, "its agent came back")
            return HostTakenOver(came, entry.agent_uid, entry.host, (), self.view())
        return None

    @property
    def agents(self) -> frozenset[str]:
        """The ids of the job's agents."""
        return self._seen()[0]

    def _seen(self) -> tuple[frozenset[str], int]:
        """The agents' uids and the workers of those that run some, worked out once per change (a join at 2,048
        agents must not walk them all)."""
        if self._agents_seen is None:
            self._agents_seen = (frozenset(self._agents), sum(a.workers for a in self._agents.values() if not a.spare))
        return self._agents_seen

    def agent(self, uid: str, proof: str) -> Agent:
        """The agent ``uid`` whose secret ``proof`` proves; PermissionDenied otherwise."""
        known = self._agents.get(uid)
        if known is None:
            raise PermissionDenied(f"agent {shown(uid)} is no agent of this job: only the job's agents (`ifrt run`, "
                                   "which joins with WatchJob and its own secret) may end an attempt")
        _check_secret(known, proof)
        return known

    def deciding_agent(self, uid: str, proof: str) -> Agent:
        """The agent ``uid`` (as ``agent``) where it may decide about the job: a spare host decides nothing until it
        has taken over a host (it runs no worker of the job); PermissionDenied otherwise, changing nothing."""
        known = self.agent(uid, proof)
        if known.spare:
            raise PermissionDenied(f"agent {shown(uid)} on {shown(known.host)} is a spare host: it runs no worker of "
                                   "the job, so it may not end an attempt, replace or shrink until the coordinator "
                                   "hands it a lost host's processes")
        return known

    def proves(self, uid: str, proof: str) -> bool:
        """Whether ``proof`` is the secret hash of the job's agent ``uid`` (a watch counts as its presence only so)."""
        known = self._agents.get(uid)
        return known is not None and hmac.compare_digest(known.secret_hash, proof)

    # Decisions.
    def decide(self, call: NextAttempt, limits: Limits, agent: Agent, where_of: Callable[[int], Host | None],
               registered_from: Callable[[Host], tuple[int | None, ...]] = lambda where: ()
               ) -> journal.AttemptDecided | None:
        """The decision ``call`` of ``agent`` makes, to journal and ``apply``; None when it changes nothing (a retry,
        an attempt that ended already, or restarts exhausted already): the caller is answered ``view()``.
        InvalidArgument, ClusterMismatch or PermissionDenied, changing nothing, for an attempt ahead of the current
        one, strings over the limits, another budget, or a cause the agent may not give. ``where_of``: where the process
        holding an id in the current attempt registered from (None: no process holds it); ``registered_from``: the ids
        of the live processes registered from a host (None for an id not assigned yet; always empty where several
        agents may share a host, unbound)."""
        check_call(call, limits)
        if call.max_restarts is not None and call.max_restarts != self.budget:
            _, origin = self._budget_origin(False)
            raise ClusterMismatch(f"max_restarts {call.max_restarts} differs from the job's restart budget "
                                  f"{self.budget} ({origin}): leave it unset to take the job's")
        if call.ended_attempt > self.current:
            raise InvalidArgument(f"ended_attempt {call.ended_attempt} is ahead of the job's current attempt "
                                  f"{self.current}: expected the attempt the agent's workers ran (at most "
                                  f"{self.current})")
        if call.request_id in self._decided_by or call.ended_attempt < self.current or self.exhausted:
            return None
        own = _OwnWorkers(agent, where_of, registered_from)
        failure = self._own(call.failure, own) if call.replace else self._cause(call.failure, own)
        return journal.AttemptDecided(
            ended=call.ended_attempt, process_id=failure.process_id, host=failure.host, reason=failure.reason,
            exhausted=self.restarts >= self.budget, request_id=call.request_id, replace=call.replace)

    def apply(self, entry: journal.AttemptDecided) -> AttemptStarted | AttemptsExhausted | ProcessReplaced:
        """Records a decision (made now, or replayed) and returns its effect."""
        self._record(AttemptFailure(entry.ended, entry.process_id, entry.host, entry.reason))
        self._remember(entry.request_id)
        if entry.exhausted:
            self.exhausted = True
            return AttemptsExhausted(self.view())
        if entry.replace:
            self._replacements += 1
            self._declared.pop(entry.process_id, None)  # a later failure of that id is its new process's
            self._replacing.add(entry.process_id)
            return ProcessReplaced(self._failures[-1], self.view())
        self.current = entry.ended + 1
        self._declared, self._replacing, self._shrunk = {}, set(), set()
        return AttemptStarted(self.view())

    def apply_taken_over(self, entry: journal.HostTakenOver) -> HostTakenOver | AttemptsExhausted:
        """Records a lost host taken over by a spare host (decided now, or replayed; see coordinator.core.takeover): the
        spare host becomes an ordinary agent of the job running those ids, in the lost agent's place."""
        failure = AttemptFailure(entry.attempt, entry.process_ids[0], entry.host, entry.reason)
        self._record(failure)
        if entry.exhausted:
            self.exhausted = True
            return AttemptsExhausted(self.view())
        self._replacements += 1
        for pid in entry.process_ids:
            self._declared.pop(pid, None)
        self._replacing.update(entry.process_ids)  # the spare host's workers must bring the lost processes' devices
        self._agents.pop(entry.lost_uid, None)
        spare = self._agents[entry.spare_uid]
        self._agents[spare.uid] = replace(spare, spare=False, workers=len(entry.process_ids))
        self._agents_seen = None
        return HostTakenOver(failure, spare.uid, spare.host, entry.process_ids, self.view())

    def decided(self, request_id: str) -> bool:
        """Whether the call ``request_id`` decided already (its retry is answered the same)."""
        return request_id in self._decided_by

    def apply_shrunk(self, entry: journal.Shrunk) -> JobShrunk:
        """Records a shrink (decided now, or replayed; see coordinator.core.shrink): its processes are no longer
        awaited, neither replaced nor taken over; the restart budget is not spent."""
        self._remember(entry.request_id)
        for pid in entry.process_ids:
            self._declared.pop(pid, None)
        self._shrunk.update(entry.process_ids)
        return JobShrunk(entry.process_ids, self.view())

    @property
    def replacing(self) -> frozenset[int]:
        """The process ids whose replacement was decided in this run and has not registered yet: its registration
        must bring the replaced process's devices (``coordinator.core.replacements``)."""
        return frozenset(self._replacing)

    def replacement_registered(self, process_id: int) -> None:
        """The decided replacement of ``process_id`` registered: later processes of that id are ordinary restarts."""
        self._replacing.discard(process_id)

    def run_started(self) -> None:
        """A new run of the job: a replacement decided in the ended run takes no id of this one over."""
        self._replacing.clear()

    @property
    def shrunk(self) -> frozenset[int]:
        """The process ids a shrink dropped in this attempt (``coordinator.core.shrink``)."""
        return frozenset(self._shrunk)

    @property
    def declared(self) -> dict[int, AttemptFailure]:
        """The processes the coordinator declared failed in this attempt, none replaced since (read only)."""
        return dict(self._declared)

    def listed(self) -> list[Agent]:
        """The job's agents, in the order they joined."""
        return list(self._agents.values())

    def _remember(self, request_id: str) -> None:
        if request_id:
            self._decided_by[request_id] = None
            if len(self._decided_by) > REQUESTS_REMEMBERED:
                del self._decided_by[next(iter(self._decided_by))]

    def _record(self, failure: AttemptFailure) -> None:
        self._failures.append(failure)
        if len(self._failures) > FAILURES_KEPT:
            self._earlier += len(self._failures) - FAILURES_KEPT
            del self._failures[:-FAILURES_KEPT]

    def process_failed(self, process_id: int, host: str, reason: str, limits: Limits) -> AttemptProcessFailed:
        """Records that the coordinator declared ``process_id`` of the current attempt failed (replayed likewise);
        returns the effect that tells agents."""
        failure = AttemptFailure(self.current, process_id, _bounded(host, limits.string_bytes),
                                 _bounded(reason, limits.string_bytes))
        self._declared.setdefault(process_id, failure)
        return AttemptProcessFailed(failure)

    def _cause(self, reported: AttemptFailure, own: _OwnWorkers) -> AttemptFailure:
        """The failure that ends the attempt: the coordinator's own word on the process named, the agent's own worker
        as reported, else the first process the coordinator declared failed; PermissionDenied if none."""
        pid, agent = reported.process_id, own.agent
        if (declared := self._declared.get(pid)) is not None:
            return declared
        if pid == UNKNOWN_PROCESS or (why := own.not_own(pid)) is None:
            return replace(reported, attempt=self.current, host=agent.host)  # its own worker, or one it cannot name
        if self._declared:
            return next(iter(self._declared.values()))
        raise PermissionDenied(f"{why}, and the coordinator did not declare it failed: an agent may end an attempt "
                               "only for its own workers or a failure the coordinator declared")

    def _own(self, reported: AttemptFailure, own: _OwnWorkers) -> AttemptFailure:
        """The failure of the agent's own worker that a replacement replaces (the coordinator's word on it, if it
        declared it failed); PermissionDenied for another host's process, InvalidArgument for no process."""
        pid, agent = reported.process_id, own.agent
        if pid == UNKNOWN_PROCESS:
            raise InvalidArgument("a replacement names the process to replace: expected failure.process_id >= 0 (an "
                                  "agent that does not know its worker's id asks for the next attempt instead)")
        if pid in self._shrunk:
            raise ClusterMismatch(f"process {pid} was dropped by a shrink in attempt {self.current}: the job goes on "
                                  "without it until its next attempt, so it is not replaced")
        if (why := own.not_own(pid)) is not None:
            raise PermissionDenied(f"{why}: an agent may replace only its own workers")
        return self._declared.get(pid) or replace(reported, attempt=self.current, host=agent.host)

    def _budget_origin(self, new_run: bool) -> tuple[int | None, str]:
        if self._configured is not None:
            return self._configured, "the coordinator's --max-restarts"
        if self._stated is not None and not new_run:
            return self._stated, f"stated by the job's first agent, on {shown(self._stated_by)}"
        return None, "none stated: 0"


@dataclass(frozen=True)
class _OwnWorkers:
    """Which processes may be ``agent``'s own workers: one registered from its host, or one not registered at all
    while some of its workers are not registered either (a worker that failed before it registered)."""

    agent: Agent
    where_of: Callable[[int], Host | None]
    registered_from: Callable[[Host], tuple[int | None, ...]]

    def not_own(self, pid: int) -> str | None:
        """Why process ``pid`` is none of the agent's workers; None when it is, or may be."""
        agent = self.agent
        where = self.where_of(pid)
        if where is not None:
            return None if where == agent.where else (
                f"process {pid} registered from {shown(where[0])} ({where[1]}), not from this agent's host "
                f"{shown(agent.host)} ({agent.address})")
        registered = self.registered_from(agent.where)
        if len(registered) < agent.workers:
            return None  # one of its workers is not registered: this may be it
        ids = ", ".join("(not assigned yet)" if i is None else str(i) for i in registered)
        return (f"process {pid} is not registered, and the {agent.workers} workers of agent {shown(agent.uid)} on "
                f"{shown(agent.host)} are registered as processes {ids}: it is none of them")


def spare_places(agents: Iterable[Agent], absent: frozenset[str], most: int) -> list[str]:
    """The spare hosts a new spare host replaces: those absent (gone); ResourceExhausted when ``most`` others watch
    still."""
    spares = [a for a in agents if a.spare]
    if len(spares) - sum(a.uid in absent for a in spares) >= most:
        raise ResourceExhausted(f"{len(spares)} spare hosts watch the job: expected at most {most} (the "
                                f"coordinator's {FLAGS['agents']})")
    return [a.uid for a in spares if a.uid in absent]


def _check_secret(known: Agent, proof: str) -> None:
    if not hmac.compare_digest(known.secret_hash, proof):
        raise PermissionDenied(f"this call acts for agent {shown(known.uid)} on {shown(known.host)} but does not carry "
                               f"its secret ({'none was sent' if not proof else 'another was sent'}): only the agent "
                               "that joined may act for it")


def _check_agent(agent: Agent, limits: Limits) -> None:
    if agent.workers < 1:
        raise InvalidArgument(f"workers {agent.workers} is out of range: an agent of the job runs at least 1 worker")
    if not agent.secret_hash:
        raise InvalidArgument("this agent's call carries no secret (metadata ifrt-process-secret): expected a random "
                              "secret of its own, the same on each of its calls")
    for what, text in (("host", agent.host), ("agent_uid", agent.uid)):
        size = len(text.encode())
        if not size or size > limits.string_bytes:
            raise InvalidArgument(f"{what} {shown(text)} is {size} bytes long: expected 1 to {limits.string_bytes} "
                                  f"(the coordinator's {FLAGS['string_bytes']})")


def _bounded(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (on a character boundary)."""
    raw = text.encode()
    return text if len(raw) <= limit else raw[:limit].decode(errors="ignore")


def check_attempt(r: Registration, current: int, cluster_id: str) -> None:
    """ClusterMismatch, naming both attempts, unless ``r`` belongs to the job's ``current`` attempt (or names none)."""
    if r.attempt is None or r.attempt == current:
        return
    if r.attempt < current:
        raise ClusterMismatch(f"{r.describe()} belongs to attempt {r.attempt} of the job; this coordinator serves "
                              f"attempt {current} of cluster {cluster_id!r}: a process of another attempt is refused "
                              "(start it with the job's current attempt, IFRT_ATTEMPT)")
    raise ClusterMismatch(f"{r.describe()} belongs to attempt {r.attempt} of the job; this coordinator serves "
                          f"attempt {current} of cluster {cluster_id!r}: the process was started for an attempt this "
                          "coordinator has not decided (yet): retry once the coordinator serves it (after a failover, "
                          "the new leader replays the decision)")


def check_call(call: NextAttempt, limits: Limits) -> None:
    """InvalidArgument, naming the field, for a request id, host or reason over the limits or a process id out of
    range."""
    check_call_id("request_id", call.request_id, limits)
    failure = call.failure
    for what, text in (("failure.host", failure.host), ("failure.reason", failure.reason)):
        size = len(text.encode())
        if size > limits.string_bytes:
            raise InvalidArgument(f"{what} {shown(text)} is {size} bytes long: expected at most {limits.string_bytes} "
                                  f"(the coordinator's {FLAGS['string_bytes']})")
    if failure.process_id < UNKNOWN_PROCESS:
        raise InvalidArgument(f"failure.process_id {failure.process_id} is out of range: expected a process id >= 0, "
                              f"or {UNKNOWN_PROCESS} when the process is not known")
