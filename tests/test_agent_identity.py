"""An agent's identity is something it cannot make up: behind the token, a caller joins as the agent of a host only
with that host's credential (``ifrt.agent_credential``); a spare host decides nothing; a shrink never races the
replacement of a process by its own agent; a registration with no devices is refused. The attacks first reproduced
against the coordinator as each test's comment says; decisions pure where they are the state machine's, the rest on a
real coordinator over loopback."""

from __future__ import annotations

import secrets

import grpc
import pytest

from coordinator.core import journal
from coordinator.core.cluster import ClusterConfig
from coordinator.core.job_records import Agent, AttemptFailure, NextAttempt
from coordinator.core.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.agent_credential import host_credential
from ifrt.errors import ClusterMismatch, PermissionDenied
from ifrt.protocol import SECRET_METADATA, proof_of
from tests.helpers import TIMEOUT, device, reg, register_request, secret_file, status_json
from tests.wire_agent import WireAgent

TOKEN = "the job's token"

# The decisions (pure): hosts ha (process 0), hb (process 1), and a spare host hs.

A = Agent("agent-a", "ha", "10.0.0.1", proof_of("a"), 1, replace_timeout_s=30.0)
B = Agent("agent-b", "hb", "10.0.0.2", proof_of("b"), 1, replace_timeout_s=30.0)
SPARE = Agent("agent-s", "hs", "10.0.0.3", proof_of("s"), 1, spare=True)


def job() -> ClusterState:
    """A published replace-mode job of 2 processes that shrinks to 1; the coordinator declared process 1 failed."""
    s = ClusterState(ClusterConfig(num_processes=2, heartbeat_timeout_s=TIMEOUT, min_processes=1, shrink=True))
    for agent in (A, B, SPARE):
        s.join_agent(agent, 3, recover="replace")
    for uid, host, ip in (("a0", "ha", "10.0.0.1"), ("b0", "hb", "10.0.0.2")):
        s.register(reg(uid, host=host, ip=ip), 0.0)
    for uid in ("a0", "b0"):
        s.current.attach(uid, 0.0)
    s.current.detach("b0", 0.0)
    s.tick(10 * TIMEOUT)
    assert set(s.attempts.declared) == {1} and s.topology is not None
    s.take_journal()
    return s


def call(agent: Agent, *, pid: int = 1, shrink: tuple[int, ...] = (), replace: bool = False,
         request_id: str = "r1") -> NextAttempt:
    return NextAttempt(0, AttemptFailure(0, pid, agent.host, "exited 1"), None, request_id, agent.uid,
                       replace=replace, shrink=shrink)


def test_a_spare_host_decides_nothing_until_it_took_over_a_host():
    # Reproduced: a spare joiner's NextAttempt with no failure (-1, "its own worker that never registered") ended
    # attempts 1, 2, 3 and then the job's budget; its shrink was accepted 0.3 s after a failure.
    s = job()
    before = s.attempts.view()
    for asked in (call(SPARE, pid=-1), call(SPARE, shrink=(1,)), call(SPARE, pid=1, replace=True)):
        with pytest.raises(PermissionDenied, match="'hs' is a spare host: it runs no worker of the job"):
            (s.shrink if asked.shrink else s.next_attempt)(asked, SPARE.secret_hash)
    assert s.attempts.view() == before and s.take_journal() == []
    assert s.next_attempt(call(B), B.secret_hash)[0].attempt == 1  # the job's own agent still may


def test_a_shrink_waits_for_the_failed_processs_own_agent_and_never_races_its_replacement():
    # Reproduced: a shrink accepted 0.3 s after the failure while the failed process's agent replaced it; the
    # replacement was accepted too, so the job shrank and grew back in one attempt and spent a restart.
    s = job()
    answer, effects = s.shrink(call(A, shrink=(1,)), A.secret_hash, waited=lambda pid: 0.3)
    assert 29 < answer.wait_s <= 29.7 and answer.refused == "" and effects == [] and s.take_journal() == []
    assert s.attempts.shrunk == set()
    answer, _ = s.shrink(call(A, shrink=(1,)), A.secret_hash, waited=lambda pid: 0.3, absent=frozenset({B.uid}))
    assert answer.wait_s == 0 and s.attempts.shrunk == {1}  # its agent is gone: nobody replaces it
    assert [type(e) for e in s.take_journal()] == [journal.Shrunk]
    with pytest.raises(ClusterMismatch, match="process 1 was dropped by a shrink in attempt 0"):
        s.next_attempt(call(B, replace=True, request_id="r2"), B.secret_hash)
    assert s.attempts.view().replacements == 0 and s.take_journal() == []


def test_a_shrink_after_the_own_agents_replace_timeout_is_decided():
    s = job()
    answer, _ = s.shrink(call(A, shrink=(1,)), A.secret_hash, waited=lambda pid: 30.5)
    assert answer.wait_s == 0 and s.attempts.shrunk == {1}


# On a real coordinator, behind the token.

@pytest.fixture
def guarded(start_coordinator, tmp_path):
    """A coordinator with the token and an agent key; the key."""
    token = secret_file(tmp_path / "token", TOKEN)
    key = secret_file(tmp_path / "agent-key")
    coordinator = start_coordinator("--token-file", str(token), "--agent-key-file", str(key),
                                    "--heartbeat-timeout", "2", num_processes=2)
    return coordinator, key.read_text().strip(), {"IFRT_TOKEN_FILE": str(token)}


def refusal(agent: WireAgent, workers: int | None = None, spare: bool = False) -> tuple[grpc.StatusCode, str]:
    request = pb.WatchJobRequest(host=agent.host, agent_uid=agent.uid, workers=agent.workers if workers is None
                                 else workers, spare_host=spare)
    with pytest.raises(grpc.RpcError) as refused:
        next(agent.jobs.WatchJob(request, timeout=30, metadata=agent.metadata))
    return refused.value.code(), refused.value.details()


def test_a_token_holder_without_a_hosts_credential_joins_as_no_agent_spare_or_not(guarded):
    coordinator, key, env = guarded
    # Reproduced: a token holder that runs nothing joined as a spare host; another joined first with workers = the
    # job's processes and every real `ifrt run` was refused (squatting).
    with WireAgent(coordinator.address, "node-1", token=TOKEN, workers=2) as squatter:
        code, details = refusal(squatter)
        assert code is grpc.StatusCode.PERMISSION_DENIED and "claims host 'node-1' without its credential" in details
        assert refusal(squatter, workers=1, spare=True)[0] is grpc.StatusCode.PERMISSION_DENIED
    with WireAgent(coordinator.address, "node-1", token=TOKEN, credential=host_credential(key, "node-2")) as other:
        assert refusal(other)[0] is grpc.StatusCode.PERMISSION_DENIED  # another host's credential names another host
    with WireAgent(coordinator.address, "node-1", token=TOKEN, credential=host_credential(key, "node-1")) as agent:
        watch, first = agent.watch(timeout=30)
        assert first.state.attempt == 0
        [listed] = status_json(coordinator.address, env)["agents"]
        assert (listed["host"], listed["address"], listed["workers"], listed["spare"], listed["watching"]) == (
            "node-1", "127.0.0.1", 1, False, True) and listed["joined_unix_s"] > 0
        # Reproduced: a token holder on the same address claimed the running agent's hostname, replaced it and
        # wedged the job. Now it is refused, naming the agent that holds the host.
        with WireAgent(coordinator.address, "node-1", token=TOKEN, uid="evictor") as evictor:
            code, details = refusal(evictor)
            assert code is grpc.StatusCode.PERMISSION_DENIED
            assert f"agent '{agent.uid}' (127.0.0.1, watching now)" in details, details
        assert [a["host"] for a in status_json(coordinator.address, env)["agents"]] == ["node-1"]
        watch.cancel()


def test_naming_an_agents_id_without_its_secret_is_no_presence(guarded):
    # Read in the code: watching the job with a lost agent's id needed no secret and counted that agent present,
    # which would block its host's takeover.
    coordinator, key, env = guarded
    with WireAgent(coordinator.address, "node-1", token=TOKEN, credential=host_credential(key, "node-1")) as agent:
        agent.join()
    with WireAgent(coordinator.address, "node-1", token=TOKEN, uid=agent.uid, workers=0) as poser:
        watch, _ = poser.watch(timeout=30)
        [listed] = status_json(coordinator.address, env)["agents"]
        assert listed["watching"] is False
        watch.cancel()


def test_behind_the_token_without_an_agent_key_no_caller_joins_as_an_agent(start_coordinator, tmp_path):
    token = secret_file(tmp_path / "token", TOKEN)
    coordinator = start_coordinator("--token-file", str(token), num_processes=1)
    with WireAgent(coordinator.address, "node-1", token=TOKEN) as agent:
        code, details = refusal(agent)
    assert code is grpc.StatusCode.PERMISSION_DENIED and "no agent key (--agent-key-file)" in details
    assert "no agent key (--agent-key-file)" in coordinator.log


def test_a_registration_with_no_devices_is_refused_and_changes_nothing(start_coordinator):
    # Reproduced: a registration with 0 devices was accepted, and the topology showed 1 device for that process.
    coordinator = start_coordinator(num_processes=1)
    with grpc.insecure_channel(coordinator.address) as channel:
        stub, metadata = CoordinatorStub(channel), [(SECRET_METADATA, secrets.token_hex(16))]
        request = register_request(0)
        del request.devices[:]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(request, timeout=30, metadata=metadata)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "no devices: expected at least 1" in refused.value.details()
        assert status_json(coordinator.address)["registered"] == 0
        request.devices.append(device(0))
        assert stub.Register(request, timeout=30, metadata=metadata).generation == 1

