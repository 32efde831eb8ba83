"""A host's agent registers its processes in one call and carries their sessions on one stream (RegisterHost,
HostSession): each process is admitted, attached and failed as its own calls would have it, the answer is the same
bytes every process gets, only the job's agents may call, each only for its own host and for workers whose secret it
proves, and a worker's exit reaches every other host at once."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest

from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import Published, Waiting
from coordinator.core.job_records import Agent
from coordinator.core.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.errors import InvalidArgument, PermissionDenied, UnknownClient
from ifrt.events import ProcessFailed
from ifrt.protocol import SECRET_METADATA, proof_of
from tests.helpers import device, reg, together
from tests.replicas import Replicas
from tests.wire_agent import HostAgent

AGENT_PROOF = proof_of("the secret of the agent on h1")


def joined(s: ClusterState, host: str, ip: str, workers: int = 2) -> Agent:
    agent = Agent(f"agent-{host}", host, ip, proof_of(f"the secret of the agent on {host}"), workers)
    s.join_agent(agent, None)
    return agent


def four_on_two_hosts() -> list:
    """Two processes on each of two hosts, ids assigned by the coordinator, each with its own secret's proof."""
    return [reg(f"{host}-{rank}", host=host, ip=ip, rank=rank) for host, ip in (("h1", "10.0.0.1"),
                                                                                   ("h2", "10.0.0.2"))
            for rank in (0, 1)]


def test_a_hosts_registration_admits_each_process_as_its_own_register_would():
    by_host, by_process = (ClusterState(ClusterConfig(num_processes=4)) for _ in range(2))
    agents = [joined(by_host, "h1", "10.0.0.1"), joined(by_host, "h2", "10.0.0.2")]
    registrations = four_on_two_hosts()
    first, _ = by_host.register_host(agents[1], registrations[2:], 0.0)
    second, _ = by_host.register_host(agents[0], registrations[:2], 0.0)
    for r in registrations:
        by_process.register(r, 0.0)
    assert by_host.topology is not None and by_host.topology == by_process.topology
    assert [type(o) for o in first + second] == [Waiting, Waiting, Waiting, Published]  # the last completes it
    assert [by_host.current.answer(r.client_uid, 0.0).process_id for r in registrations] == [0, 1, 2, 3]  # h1 first


def test_a_refused_process_changes_nothing_and_its_hosts_others_are_admitted():
    s = ClusterState(ClusterConfig(num_processes=4))
    agent = joined(s, "h1", "10.0.0.1", workers=3)
    elsewhere = reg("h2-0", host="h2", ip="10.0.0.2")
    results, _ = s.register_host(agent, [reg("h1-0", host="h1"), elsewhere, InvalidArgument("bad devices")], 0.0)
    assert isinstance(results[0], Waiting)
    assert isinstance(results[1], PermissionDenied) and "process 'h2-0' (local rank 0) is on 'h2'" in str(results[1])
    assert isinstance(results[2], InvalidArgument) and str(results[2]) == "bad devices"
    assert s.registered == 1


def test_more_processes_than_the_agent_runs_or_no_agent_at_all_are_refused_and_change_nothing():
    s = ClusterState(ClusterConfig(num_processes=4))
    agent = joined(s, "h1", "10.0.0.1", workers=1)
    s.take_journal()
    with pytest.raises(InvalidArgument, match="registered 2 processes at once: expected at most 1"):
        s.register_host(agent, [reg("a", host="h1"), reg("b", host="h1", rank=1)], 0.0)
    with pytest.raises(PermissionDenied, match="is no agent of this job"):
        s.host_agent("intruder", AGENT_PROOF)
    with pytest.raises(PermissionDenied):
        s.host_agent(agent.uid, proof_of("a guess"))
    assert s.registered == 0 and s.take_journal() == []


def test_an_exit_the_agent_reports_fails_its_worker_at_once_and_only_its_own_agent_with_its_secret_may():
    s = ClusterState(ClusterConfig(num_processes=4))
    h1, h2 = joined(s, "h1", "10.0.0.1"), joined(s, "h2", "10.0.0.2")
    registrations = [replace(r, secret_hash=proof_of(r.client_uid)) for r in four_on_two_hosts()]
    s.register_host(h1, registrations[:2], 0.0)
    s.register_host(h2, registrations[2:], 0.0)
    assert s.attach_worker(h1, "h1-1", 0.0, proof_of("h1-1")) == 1
    with pytest.raises(PermissionDenied, match="not on the agent's host"):
        s.attach_worker(h2, "h1-1", 0.0, proof_of("h1-1"))
    with pytest.raises(PermissionDenied, match="does not carry its process secret"):
        s.worker_exited(h1, "h1-1", "exited with 3", 0.1, proof_of("a guess"))
    with pytest.raises(UnknownClient):
        s.worker_exited(h1, "nobody", "exited with 3", 0.1, "")
    s.take_journal()
    effects = s.worker_exited(h1, "h1-1", "its worker exited with code 3", 0.1, proof_of("h1-1"))
    assert [e.event for e in effects if isinstance(getattr(e, "event", None), ProcessFailed)] == [
        ProcessFailed(1, "its worker exited with code 3")]
    assert [type(e).__name__ for e in s.take_journal()] == ["Failed"]
    assert s.worker_exited(h1, "h1-1", "again", 0.2, proof_of("h1-1")) == []  # failed already: nothing more


# Over the wire: a real coordinator, agents on raw channels.

def carried(agents: list[HostAgent]) -> None:
    """Each agent's two workers registered in one call, then attached on its host session (each attach answered)."""
    answers = together(agents, lambda a: a.register(a.request(0), a.request(1)))
    position = pb.RegisterResponse.FromString(answers[0].answer).event_position
    for agent in agents:
        agent.open(position)
        assert agent.next("attached").attached.client_uid == ""  # the host's own
        for rank in (0, 1):
            agent.attach(rank)
            assert agent.next("attached").attached.client_uid == f"{agent.host}-{rank}"


@pytest.fixture
def two_hosts(start_coordinator) -> Iterator[tuple[str, list[HostAgent]]]:
    coordinator = start_coordinator("--heartbeat-timeout", "1", "--max-devices-per-process", "4", num_processes=4)
    agents = [HostAgent(coordinator.address, host).join() for host in ("h1", "h2")]
    yield coordinator.address, agents
    for agent in agents:
        agent.close()


def test_hosts_registered_by_their_agents_get_the_bytes_workers_registering_alone_get(two_hosts, start_coordinator):
    _, agents = two_hosts
    answers = together(agents, lambda a: a.register(a.request(0), a.request(1)))
    assert [[p.process_id for p in answer.processes] for answer in answers] == [[0, 1], [2, 3]]
    assert answers[0].answer == answers[1].answer
    alone = start_coordinator(num_processes=4)
    with grpc.insecure_channel(alone.address) as channel:
        register = CoordinatorStub(channel).Register
        requests = [(p.request, agent.secrets[p.request.local_rank]) for agent in agents
                    for p in (agent.request(0), agent.request(1))]
        for request, _ in requests:
            request.wait_ms = 20_000
        direct = together(requests, lambda r: register(r[0], timeout=30, metadata=((SECRET_METADATA, r[1]),)))
    shared = pb.RegisterResponse.FromString(answers[0].answer)
    assert {(d.topology, d.fingerprint) for d in direct} == {(shared.topology, shared.fingerprint)}
    assert pb.RegisterResponse.FromString(pb.RegisterResponse(process_id=3).SerializeToString()
                                          + answers[1].answer).process_id == 3


def test_a_worker_past_the_limits_is_refused_naming_it_and_its_hosts_others_are_admitted(two_hosts):
    _, (h1, h2) = two_hosts
    too_many = h1.request(1, devices=[device(i) for i in range(5)])
    answer = h1.register(h1.request(0), too_many, wait_ms=100)
    admitted, refused = answer.processes
    assert (refused.code, refused.error) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "InvalidArgument")
    assert "5 devices" in refused.message and "--max-devices-per-process" in refused.message, refused.message
    assert (admitted.process_id, admitted.code) == (-1, 0)  # admitted, waiting for the others
    assert pb.RegisterResponse.FromString(answer.answer).progress.registered == 1
    again = together([h1, h2], lambda a: a.register(a.request(0), a.request(1)))
    assert sorted(p.process_id for answer in again for p in answer.processes) == [0, 1, 2, 3]


def test_an_exit_reported_by_its_agent_reaches_the_other_host_within_a_second(two_hosts):
    _, agents = two_hosts
    carried(agents)
    h1, h2 = agents
    h2.attach(0, secret="not its secret")
    assert h2.next("worker_ended").worker_ended.error == "PermissionDenied"
    h2.send(attach=pb.WorkerSession(client_uid="h1-0", proof=proof_of(h1.secrets[0])))  # not its host's
    assert "not on the agent's host" in h2.next("worker_ended").worker_ended.message
    killed = time.monotonic()
    h1.send(exited=pb.WorkerExit(client_uid="h1-1", proof=proof_of(h1.secrets[1]), reason="killed by SIGKILL"))
    failed = h2.next("process_failed")
    assert time.monotonic() - killed < 1.0
    assert (failed.process_failed.process_id, failed.process_failed.reason) == (1, "killed by SIGKILL")
    assert h1.next("worker_ended").worker_ended.error == "ProcessDeclaredFailed"  # its agent ends its session
    h1.secrets[1] = secrets.token_hex(16)  # its restart: a new client with a new secret, in the failed one's place
    restarted = h1.register(h1.request(1, client_uid="h1-1-again"))
    assert [p.process_id for p in restarted.processes] == [1]
    h1.send(attach=pb.WorkerSession(client_uid="h1-1-again", proof=proof_of(h1.secrets[1])))
    assert h1.next("attached").attached.client_uid == "h1-1-again"  # the failed one no longer counts as carried


def test_a_host_whose_session_is_gone_has_its_workers_failed_after_their_grace(two_hosts):
    _, agents = two_hosts
    carried(agents)
    h1, h2 = agents
    h1.stream.cancel()  # the agent's host session is gone (its agent killed, its host cut off)
    failed = {h2.next("process_failed").process_failed.process_id for _ in range(2)}
    assert failed == {0, 1}


def test_a_failover_during_registration_and_during_the_session_loses_nothing_and_sends_no_event_twice(etcd):
    with Replicas(etcd, num_processes=4, count=3) as replicas:
        h1, h2 = (HostAgent(replicas.leader.address, host).join() for host in ("h1", "h2"))
        waiting = h1.register(h1.request(0), h1.request(1), wait_ms=100)  # journaled, then its leader dies
        assert pb.RegisterResponse.FromString(waiting.answer).progress.registered == 2
        replicas.kill_leader()
        for agent in (h1, h2):
            agent.reconnect(replicas.leader.address)
        answers = together([h1, h2], lambda a: a.register(a.request(0), a.request(1)))
        assert [[p.process_id for p in answer.processes] for answer in answers] == [[0, 1], [2, 3]]
        position = pb.RegisterResponse.FromString(answers[0].answer).event_position
        for agent in (h1, h2):
            agent.open(position)
            agent.attach(0)
            agent.attach(1)
        h1.send(exited=pb.WorkerExit(client_uid="h1-1", proof=proof_of(h1.secrets[1]), reason="exited with 3"))
        first = h2.next("process_failed")
        replicas.kill_leader()  # the host sessions end with it; each agent opens its own again on the new leader
        for agent in (h1, h2):
            agent.reconnect(replicas.leader.address)
            agent.open(first.event_number)
            agent.attach(0)
        h2.send(exited=pb.WorkerExit(client_uid="h2-1", proof=proof_of(h2.secrets[1]), reason="exited with 4"))
        second = h1.next("process_failed")
        assert (second.process_failed.process_id, second.process_failed.reason) == (3, "exited with 4")
        assert second.event_number > first.event_number
        seen = [e for e in h1.drained() if e.event_number]  # every job event h1 got after reopening: none again
        assert all(e.event_number > first.event_number for e in seen), seen
        for agent in (h1, h2):
            agent.close()


def test_a_job_may_mix_hosts_by_agent_and_processes_on_their_own(two_hosts):
    address, (h1, h2) = two_hosts
    own = [h2.request(rank).request for rank in (0, 1)]  # h2's workers register on their own
    for request in own:
        request.wait_ms = 20_000
    with grpc.insecure_channel(address) as channel:
        register = CoordinatorStub(channel).Register
        answers = together([None, *own], lambda r: h1.register(h1.request(0), h1.request(1)) if r is None else
                           register(r, timeout=30, metadata=((SECRET_METADATA, h2.secrets[r.local_rank]),)))
    by_agent, *alone = answers
    shared = pb.RegisterResponse.FromString(by_agent.answer)
    assert [p.process_id for p in by_agent.processes] == [0, 1] and [a.process_id for a in alone] == [2, 3]
    assert {(a.topology, a.fingerprint) for a in alone} == {(shared.topology, shared.fingerprint)}
