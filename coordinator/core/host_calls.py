"""The rules of the host calls (``RegisterHost``, ``HostSession``), pure: an ``ifrt run`` agent registers and carries
only its own host's processes, at most the workers it runs. The router (``coordinator.core.state``) admits, attaches and
fails each process exactly as its own calls would have it; the agent proves itself with its secret, and each worker
with the hash of that worker's own secret."""

from __future__ import annotations

from coordinator.core.job_records import Agent
from coordinator.core.limits import shown
from coordinator.core.members import Member
from ifrt.errors import InvalidArgument, PermissionDenied, ResourceExhausted, UnknownClient


def check_agent_named(agent_uid: str) -> None:
    """PermissionDenied for a host call that names no agent."""
    if not agent_uid:
        raise PermissionDenied("a host call names no agent: only an agent of the job (`ifrt run`, joined with "
                               "WatchJob) may register or carry its host's processes")


def check_batch(agent: Agent, count: int) -> None:
    """InvalidArgument for more processes registered at once than the agent runs."""
    most = max(agent.workers, 1)
    if count > most:
        raise InvalidArgument(f"agent {shown(agent.uid)} on {shown(agent.host)} registered {count} processes at "
                              f"once: expected at most {most}, the workers it runs")


def check_carried(agent: Agent, carried: int) -> None:
    """ResourceExhausted when the agent's host session carries as many workers as it runs already."""
    most = max(agent.workers, 1)
    if carried >= most:
        raise ResourceExhausted(f"agent {shown(agent.uid)} carries {carried} workers on its host session already: "
                                f"expected at most {most}, the workers it runs")


def own_worker(agent: Agent, member: Member | None, client_uid: str) -> Member:
    """The registered process ``client_uid`` of the agent's own host: UnknownClient, or PermissionDenied for another
    host's."""
    if member is None:
        raise UnknownClient(f"client {shown(client_uid)} is not a registered process (the coordinator may have "
                            "restarted): register again")
    r = member.registration
    check_host(agent, r.hostname, r.host_address, f"process {shown(client_uid)}")
    return member


def check_host(agent: Agent, hostname: str, address: str, what: str) -> None:
    """PermissionDenied unless the process registered from the agent's own host (name and address)."""
    if (hostname, address) != agent.where:
        raise PermissionDenied(f"{what} is on {shown(hostname)} ({address}), not on the agent's host "
                               f"{shown(agent.host)} ({agent.address}): an agent carries only its own host's "
                               "processes")
