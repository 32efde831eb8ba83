"""The host calls of the state machine: an ``ifrt run`` agent registers its host's processes in one call and carries
their sessions on one stream (``RegisterHost``, ``HostSession``). Each process is admitted, attached, detached and
failed exactly as its own calls would have it; the agent proves itself with its secret, and each worker with the
hash of that worker's own secret, and carries only processes of its own host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from coordinator.attempts import Agent, Attempts
from coordinator.effects import Effect, Published, Waiting, WaitingForNextRun
from coordinator.limits import shown
from coordinator.registration import Registration
from ifrt.errors import IfrtError, InvalidArgument, PermissionDenied, ResourceExhausted, UnknownClient

if TYPE_CHECKING:
    from coordinator.admission import Admission
    from coordinator.liveness import Liveness
    from coordinator.members import Member

Admitted = Waiting | Published | WaitingForNextRun


class HostCalls:
    """RegisterHost and HostSession's commands; ``ClusterState`` provides what is declared here."""

    attempts: Attempts
    _admission: Admission
    _liveness: Liveness

    if TYPE_CHECKING:  # ClusterState's
        def register(self, r: Registration, now: float) -> tuple[Admitted, list[Effect]]: ...
        def attach(self, client_uid: str, now: float, *, proof: str = "") -> int: ...
        def _fail(self, member: Member, why: str) -> list[Effect]: ...
        def _settle(self, now: float) -> list[Effect]: ...
        def _ended(self, was_over: bool) -> list[Effect]: ...
        def _over(self) -> bool: ...

    def host_agent(self, agent_uid: str, proof: str) -> Agent:
        """The job's agent ``agent_uid``, proven by ``proof`` (the hash of the secret its call carries);
        PermissionDenied otherwise: only an agent that joined the job with WatchJob carries a host."""
        if not agent_uid:
            raise PermissionDenied("a host call names no agent: only an agent of the job (`ifrt run`, joined with "
                                   "WatchJob) may register or carry its host's processes")
        return self.attempts.agent(agent_uid, proof)

    def register_host(self, agent: Agent, registrations: Sequence[Registration | IfrtError],
                      now: float) -> tuple[list[Admitted | IfrtError], list[Effect]]:
        """Admits each of a host's processes as its own Register would (``registrations``: each checked already, or
        why it was refused); one refused changes nothing and leaves the others admitted. InvalidArgument, changing
        nothing, for more processes than the agent runs."""
        most = max(agent.workers, 1)
        if len(registrations) > most:
            raise InvalidArgument(f"agent {shown(agent.uid)} on {shown(agent.host)} registered {len(registrations)} "
                                  f"processes at once: expected at most {most}, the workers it runs")
        results: list[Admitted | IfrtError] = []
        effects: list[Effect] = []
        for r in registrations:
            try:
                if isinstance(r, IfrtError):
                    raise r
                _check_host(agent, r.hostname, r.host_address,
                            f"process {shown(r.client_uid)} (local rank {r.local_rank})")
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
        self._own_worker(agent, client_uid)
        most = max(agent.workers, 1)
        if carried >= most:
            raise ResourceExhausted(f"agent {shown(agent.uid)} carries {carried} workers on its host session "
                                    f"already: expected at most {most}, the workers it runs")
        return self.attach(client_uid, now, proof=proof)

    def worker_exited(self, agent: Agent, client_uid: str, reason: str, now: float,
                      proof: str) -> list[Effect]:
        """The agent saw its worker exit, or stop answering it: the process fails at once (journaled) instead of
        after its reconnect grace. Nothing for a process that failed, left or was replaced already."""
        member = self._own_worker(agent, client_uid)
        self._admission.check_owner(member, proof)
        if not member.live:
            return []
        was_over = self._over()
        return self._fail(member, reason) + self._settle(now) + self._ended(was_over)

    def _own_worker(self, agent: Agent, client_uid: str) -> Member:
        member = self._admission.members.get(client_uid)
        if member is None:
            raise UnknownClient(f"client {shown(client_uid)} is not a registered process (the coordinator may have "
                                "restarted): register again")
        r = member.registration
        _check_host(agent, r.hostname, r.host_address, f"process {shown(client_uid)}")
        return member


def _check_host(agent: Agent, hostname: str, address: str, what: str) -> None:
    """PermissionDenied unless the process registered from the agent's own host (name and address)."""
    if (hostname, address) != agent.where:
        raise PermissionDenied(f"{what} is on {shown(hostname)} ({address}), not on the agent's host "
                               f"{shown(agent.host)} ({agent.address}): an agent carries only its own host's "
                               "processes")
