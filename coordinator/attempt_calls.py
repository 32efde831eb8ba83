"""The job-attempt calls of the state machine (``ifrt run``'s agents joining, NextAttempt's decisions): a part of
``ClusterState``, which journals what ``coordinator.attempts`` decides and starts its other sub-machines afresh for
a new attempt."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from coordinator import journal
from coordinator.attempts import Agent, Attempts, AttemptStarted, Host, JobView, NextAttempt
from coordinator.effects import Effect

if TYPE_CHECKING:
    from coordinator.admission import Admission
    from coordinator.cluster import ClusterConfig
    from coordinator.members import Member
    from ifrt.records import TopologyContent


class JobAttemptCalls:
    """Agents joining and NextAttempt; ``ClusterState`` provides what is declared here."""

    config: ClusterConfig
    attempts: Attempts
    run: int
    _admission: Admission
    _journal: list[journal.Entry]
    topology: TopologyContent | None

    if TYPE_CHECKING:  # ClusterState's
        def _fail(self, member: Member, why: str) -> list[Effect]: ...

    def join_agent(self, agent: Agent, max_restarts: int | None, absent: frozenset[str] = frozenset(),
                   recover: str = "") -> list[Effect]:
        """An ``ifrt run`` agent joins the job (journaled; nothing when it is one already); ``absent``: the agents the
        shell has not seen watching for a while. A new run of the job (see coordinator.attempts) starts a new attempt
        with every sub-machine empty."""
        entry = self.attempts.join(agent, max_restarts, self.config.num_processes, self.config.limits, absent, recover)
        if entry is None:
            return []
        self._journal.append(entry)
        return self._agent_joined(entry)

    def next_attempt(self, call: NextAttempt, proof: str = "") -> tuple[JobView, list[Effect]]:
        """NextAttempt from the agent ``call.agent_uid`` (``proof``: the hash of the secret its call carries): ends
        the job's current attempt once (journaled) and starts the next with every sub-machine empty, or marks the
        restarts exhausted; a retry or a later caller is answered the same, changing nothing. PermissionDenied for a
        caller that is no agent of the job, or a cause it may not give (see coordinator.attempts)."""
        agent = self.attempts.agent(call.agent_uid, proof)
        entry = self.attempts.decide(call, self.config.limits, agent, self._registered_from)
        if entry is None:
            return self.attempts.view(), []
        replacing = entry.replace and not entry.exhausted and self.topology is not None
        member = self._admission.member_of(entry.process_id) if replacing else None
        failed = self._fail(member, f"its agent replaces it: {entry.reason}") if member and member.live else []
        self._journal.append(entry)  # after its holder's failure: watches hear of both in this order, as a replay does
        effects = failed + self._end_attempt(entry)
        return self.attempts.view(), effects

    def _end_attempt(self, entry: journal.AttemptDecided) -> list[Effect]:
        effect = self.attempts.apply(entry)
        if isinstance(effect, AttemptStarted):
            self._start_afresh()
        return [effect]

    def _agent_joined(self, entry: journal.AgentJoined) -> list[Effect]:
        effect = self.attempts.apply_joined(entry)
        if isinstance(effect, AttemptStarted):
            self._start_afresh()
        return [] if effect is None else [effect]

    def _start_afresh(self) -> None:
        """A new attempt: everything but the attempts, the run number (and the journal) starts empty."""
        attempts, entries, run = self.attempts, self._journal, self.run
        self.__init__(replace(self.config, attempt=attempts.current))  # type: ignore[misc]
        self.attempts, self._journal, self.run = attempts, entries, run

    def _registered_from(self, process_id: int) -> Host | None:
        """Where the process holding ``process_id`` in this attempt registered from (None: none holds it)."""
        if self.topology is not None:
            member = self._admission.member_of(process_id)
        else:  # before publication only explicit ids are known
            member = next((m for m in self._admission.members.values()
                           if m.registration.process_id == process_id and m.live), None)
        return None if member is None else (member.registration.hostname, member.registration.host_address)
