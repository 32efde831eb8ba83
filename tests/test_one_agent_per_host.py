"""One agent per host: where the coordinator binds agents to hosts (``--agent-key-file``), a second agent presenting
a host's credential is refused while that host's agent watches, and takes its place only once it is gone (a restart);
a gone host's place is kept for its own agent, never taken by another host's credential; and an agent acts only for
its own host's processes. Real coordinators behind the token, raw gRPC calls as tests/wire_agent.py makes them, and
one real ``ifrt run`` that waits for its host's old watch to end."""

from __future__ import annotations

import secrets
import sys
import time

import grpc
import pytest

from coordinator.core.cluster import ClusterConfig
from coordinator.core.job_records import Agent
from coordinator.core.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
from ifrt.agent_credential import host_credential
from ifrt.errors import ClusterMismatch, HostHeld, PermissionDenied, from_rpc_error
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA, proof_of
from tests.helpers import HOST, register_request, secret_file, status_json
from tests.run_agents import loopback_env
from tests.wire_agent import WireAgent

TOKEN = "the job's token"
HEARTBEAT_S = 1.0


@pytest.fixture
def guarded(start_coordinator, tmp_path):
    """A coordinator of 2 processes behind the token with an agent key; a factory of agents with a host's credential."""
    token = secret_file(tmp_path / "token", TOKEN)
    key_file = secret_file(tmp_path / "agent-key")
    coordinator = start_coordinator("--token-file", str(token), "--agent-key-file", str(key_file),
                                    "--heartbeat-timeout", str(HEARTBEAT_S), num_processes=2)
    key = key_file.read_text().strip()
    opened: list[WireAgent] = []

    def agent(host: str, uid: str | None = None, *, credential_of: str | None = None, workers: int = 1) -> WireAgent:
        made = WireAgent(coordinator.address, host, uid=uid, token=TOKEN, workers=workers,
                         credential=host_credential(key, credential_of or host))
        opened.append(made)
        return made

    yield coordinator, agent, {"IFRT_TOKEN_FILE": str(token)}
    for made in opened:
        made.close()


def refused(call) -> Exception:
    try:
        call()
    except grpc.RpcError as e:
        return from_rpc_error(e, "test")
    raise AssertionError("the call succeeded")


def register(agent: WireAgent, process_id: int) -> None:
    """Process ``process_id`` registers from ``agent``'s host (its hostname, from 127.0.0.1), with the token."""
    request = register_request(process_id, hostname=agent.host, client_uid=f"uid-{process_id}")
    agent.coordinator.Register(request, timeout=30, metadata=[(TOKEN_METADATA, TOKEN),
                                                              (SECRET_METADATA, secrets.token_hex(16))])


def listed(coordinator, env) -> list[tuple[str, bool]]:
    """The job's agents as ``ifrt status`` shows them: host, watching now."""
    return [(a["host"], a["watching"]) for a in status_json(coordinator.address, env)["agents"]]


def test_a_second_agent_with_a_watching_hosts_credential_is_refused_naming_the_host_and_its_agent(guarded):
    # Reproduced: a second WatchJob with host-0's credential, a new agent uid and workers=1, while host-0's agent
    # watched, was accepted (the agents did not cover the job yet); host-1's own agent was then refused ("the job's
    # agents on 'host-0' ... run 2 workers").
    coordinator, agent, env = guarded
    real = agent("host-0", "agent-0")
    watch, _ = real.watch(timeout=60)
    second = agent("host-0", "second")
    error = refused(lambda: second.watch(timeout=10))
    assert isinstance(error, HostHeld), error
    assert "host 'host-0' has an agent of the job that watches it: agent 'agent-0' (127.0.0.1)" in str(error), error
    other = agent("host-1", "agent-1")
    other_watch, first = other.watch(timeout=60)  # host-1's own agent joins
    assert first.state.attempt == 0
    assert sorted(listed(coordinator, env)) == [("host-0", True), ("host-1", True)]
    other_watch.cancel()
    watch.cancel()


def test_an_agent_may_not_end_an_attempt_or_replace_for_another_hosts_process_not_registered_yet(guarded):
    # Reproduced: an agent's NextAttempt naming process 1 (another host's, not registered yet) was taken as its own
    # worker's failure and ended the attempt.
    _, agent, _ = guarded
    a0, a1 = agent("host-0", "agent-0").join(), agent("host-1", "agent-1").join()
    register(a0, 0)  # host-0's one worker is process 0: process 1 cannot be one of its own
    for replace in (False, True):
        request = pb.NextAttemptRequest(ended_attempt=0, agent_uid=a0.uid, request_id=f"r-{replace}", replace=replace,
                                        failure=pb.AttemptFailure(attempt=0, process_id=1, host="host-0",
                                                                  reason="exited 1"))
        error = refused(lambda r=request: a0.jobs.NextAttempt(r, timeout=30, metadata=a0.metadata))
        assert isinstance(error, PermissionDenied), error
        assert "process 1 is not registered, and the 1 workers of agent 'agent-0' on 'host-0' are registered as " \
               "processes 0" in str(error), error
    watch, first = a1.watch(timeout=30)
    assert first.state.attempt == 0 and list(first.state.failures) == []  # nothing changed
    watch.cancel()
    assert a0.next(0, process_id=0).attempt == 1  # its own worker: it may


def test_a_gone_hosts_place_is_kept_for_its_own_agent_never_taken_by_another_hosts_credential(guarded):
    # Reproduced: once host-1's watch had been gone longer than the heartbeat timeout, an agent with another host's
    # credential took its place, and host-1's own agent was refused for good ("would exceed the job's 2 processes").
    coordinator, agent, env = guarded
    a0 = agent("host-0", "agent-0")
    watch0, _ = a0.watch(timeout=120)
    a1 = agent("host-1", "agent-1")
    watch1, _ = a1.watch(timeout=120)
    watch1.cancel()  # host-1 is cut off
    time.sleep(3 * HEARTBEAT_S)
    for intruder in (agent("host-9", "intruder"), agent("host-0", "second-of-host-0")):
        error = refused(lambda i=intruder: i.watch(timeout=10))
        assert isinstance(error, ClusterMismatch | HostHeld), error
        if isinstance(error, ClusterMismatch):
            assert "host 'host-1' (agent 'agent-1', not watching now)" in str(error), error
    back, first = a1.watch(timeout=60)  # host-1's agent comes back: its place was kept
    assert first.state.attempt == 0
    back.cancel()
    time.sleep(0.5)
    restarted = agent("host-1", "agent-1-restarted")  # or a restart of it: its own host's place
    again, _ = restarted.watch(timeout=60)
    assert sorted(listed(coordinator, env)) == [("host-0", True), ("host-1", True)]
    assert isinstance(refused(lambda: a1.next(0, process_id=1)), PermissionDenied)  # its place is the restart's
    again.cancel()
    watch0.cancel()


def test_a_restarted_agent_takes_its_hosts_place_as_soon_as_the_old_watch_ends(guarded):
    coordinator, agent, env = guarded
    old = agent("host-0", "agent-0")
    watch, _ = old.watch(timeout=60)
    restarted = agent("host-0", "agent-0-restarted")
    assert isinstance(refused(lambda: restarted.watch(timeout=10)), HostHeld)  # the old one still watches
    watch.cancel()
    time.sleep(0.5)  # its watch ends with it (killed: its kernel closes the connection)
    new_watch, _ = restarted.watch(timeout=60)
    assert listed(coordinator, env) == [("host-0", True)]
    assert isinstance(refused(lambda: old.next(0, process_id=0)), PermissionDenied)  # its place is taken
    new_watch.cancel()


# The decisions, pure: bound (an agent key) and unbound (every caller is the job's; agents may share a hostname).

def test_unbound_agents_may_share_a_hostname_and_bound_ones_may_not():
    live = Agent("agent-0", "vm", "127.0.0.1", proof_of("s0"), 1)
    second = Agent("agent-1", "vm", "127.0.0.1", proof_of("s1"), 1)
    unbound = ClusterState(ClusterConfig(num_processes=2))
    unbound.join_agent(live, None)
    unbound.join_agent(second, None, watching=frozenset({live.uid}))
    assert unbound.attempts.agents == {live.uid, second.uid}
    bound = ClusterState(ClusterConfig(num_processes=2))
    bound.join_agent(live, None, bound=True)
    bound.take_journal()
    with pytest.raises(HostHeld, match="host 'vm' has an agent of the job that watches it: agent 'agent-0'"):
        bound.join_agent(second, None, watching=frozenset({live.uid}), bound=True)
    assert bound.attempts.agents == {live.uid} and bound.take_journal() == []
    bound.join_agent(second, None, bound=True)  # the first is gone: a restart takes its place
    assert bound.attempts.agents == {second.uid}


# A real `ifrt run` whose host's old agent still watches (its connection not yet dropped: a partition).

def test_an_ifrt_run_agent_waits_for_its_hosts_old_watch_to_end_then_runs(start_coordinator, agents, tmp_path):
    token = secret_file(tmp_path / "token", TOKEN)
    key_file = secret_file(tmp_path / "agent-key")
    coordinator = start_coordinator("--token-file", str(token), "--agent-key-file", str(key_file), num_processes=1)
    with WireAgent(coordinator.address, HOST, uid="old-agent", token=TOKEN,
                   credential=host_credential(key_file.read_text().strip(), HOST)) as old:
        watch, _ = old.watch(timeout=120)
        run = agents("--token-file", str(token), "--agent-key-file", str(key_file), "--", sys.executable, "-c", "pass",
                     env={**loopback_env(coordinator.address), "IFRT_FAILOVER_WINDOW": "60"})
        deadline = time.monotonic() + 60
        while not any("old-agent" in line for line in run.err) and time.monotonic() < deadline:
            assert run.process.poll() is None, run.output()  # on main: it joined beside the old one and finished
            time.sleep(0.1)
        assert any(f"host {HOST!r} has an agent of the job that watches it: agent 'old-agent'" in line
                   for line in run.err), run.output()
        watch.cancel()
        assert run.wait() == 0, run.output()
    assert "all 1 workers finished" in "\n".join(run.err), run.output()
