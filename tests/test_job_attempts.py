"""Job attempts decided by the coordinator (the JobAgents service that `ifrt run` agents call): the next attempt is
decided once, journaled, and starts every part of the state empty; the ended attempt's processes are refused and
its waits answered AttemptEnded; agents watch failures, attempts and exhaustion in order; a leader kill changes
none of it."""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

import ifrt
from coordinator.core import compaction, journal
from coordinator.core.attempts import FAILURES_KEPT, Attempts
from coordinator.core.job_records import (
    UNKNOWN_PROCESS,
    Agent,
    AttemptFailure,
    AttemptProcessFailed,
    AttemptsExhausted,
    AttemptStarted,
    NextAttempt,
)
from coordinator.core.state import ClusterState
from coordinator.local import LocalCoordinator
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.agent_credential import host_credential
from ifrt.errors import AttemptEnded, ClusterMismatch, InvalidArgument, PermissionDenied, from_rpc_error
from ifrt.events import CoordinatorLost
from ifrt.protocol import proof_of
from tests.helpers import TIMEOUT, admit, lose_session, published, reg, register_request, secret_file
from tests.replicas import LEADER_TTL, serving
from tests.resources import rss_bytes
from tests.wire_agent import WireAgent

FAILURE = AttemptFailure(0, 1, "h1", "worker exited with 1")
PROOF = proof_of("the secret of the agent on h1")
AGENT = Agent("agent-h1", "h1", "10.0.0.1", PROOF, 1)
"""The agent of process 1 (host h1 in ``published``)."""


def next_attempt(ended: int, request_id: str = "", failure: AttemptFailure = FAILURE, max_restarts: int | None = None,
                 agent_uid: str = AGENT.uid) -> NextAttempt:
    return NextAttempt(ended, replace(failure, attempt=ended), max_restarts, request_id, agent_uid)


def with_agent(s: ClusterState, max_restarts: int | None = 3, agent: Agent = AGENT) -> ClusterState:
    """``s`` once ``agent`` joined it, stating ``max_restarts``."""
    s.join_agent(agent, max_restarts)
    return s


def fingerprint(s: ClusterState) -> str:
    assert s.topology is not None
    return wire.fingerprint(wire.encode(s.topology))


def register_attempt(s: ClusterState, n: int, attempt: int, now: float = 1.0) -> None:
    for i in range(n):
        admit(s, replace(reg(f"p{i}-a{attempt}", i, host=f"h{i}"), attempt=attempt), now)


# The pure sub-machine, through the state machine.

def test_the_next_attempt_starts_every_part_of_the_state_empty_and_gives_the_same_ids_and_topology():
    s = with_agent(published(n=2))
    before = fingerprint(s)
    s.current.keys.set("p0", "jax/coordinator", b"10.0.0.1:1234", False)
    view, effects = s.next_attempt(next_attempt(0, request_id="r1"), PROOF)
    assert (view.attempt, view.failures, view.exhausted, view.max_restarts) == (1, (FAILURE,), False, 3)
    assert effects == [AttemptStarted(view)]
    assert [type(e) for e in s.take_journal()][-1] is journal.AttemptDecided
    assert s.topology is None and s.registered == 0
    with pytest.raises(Exception, match="not a registered process"):
        s.current.keys.get("p0", "jax/coordinator")
    register_attempt(s, 2, attempt=1)
    assert fingerprint(s) == before  # same hosts and devices: the same ids, generation and bytes
    assert s.current.keys.get("p0-a1", "jax/coordinator") is None


def test_a_retry_or_another_agent_asking_for_an_ended_attempt_changes_nothing():
    s = with_agent(published(n=2))
    first, _ = s.next_attempt(next_attempt(0, request_id="r1"), PROOF)
    s.take_journal()
    for call in (next_attempt(0, request_id="r1"), next_attempt(0, request_id="r2"),
                 next_attempt(0, failure=AttemptFailure(0, UNKNOWN_PROCESS, "", "another reason"))):
        assert s.next_attempt(call, PROOF) == (first, [])
    assert s.take_journal() == []


def test_an_attempt_ahead_or_strings_over_the_limits_are_refused_and_change_nothing():
    s = with_agent(published(n=2))
    s.take_journal()
    with pytest.raises(InvalidArgument, match="ended_attempt 1 is ahead of the job's current attempt 0"):
        s.next_attempt(next_attempt(1), PROOF)
    with pytest.raises(InvalidArgument, match=r"failure.reason .* is 2000 bytes long: expected at most 1024"):
        s.next_attempt(next_attempt(0, failure=replace(FAILURE, reason="x" * 2000)), PROOF)
    with pytest.raises(InvalidArgument, match="request_id is 2000 bytes long"):
        s.next_attempt(next_attempt(0, request_id="r" * 2000), PROOF)
    with pytest.raises(InvalidArgument, match=r"failure\.process_id -2 is out of range"):
        s.next_attempt(next_attempt(0, failure=replace(FAILURE, process_id=-2)), PROOF)
    assert s.take_journal() == [] and s.attempts.current == 0 and s.topology is not None


def test_after_max_restarts_the_job_is_exhausted_and_stays_so():
    s = with_agent(published(n=2), max_restarts=1)
    s.next_attempt(next_attempt(0), PROOF)
    register_attempt(s, 2, attempt=1)
    view, effects = s.next_attempt(next_attempt(1, failure=AttemptFailure(1, 1, "h1", "oom")), PROOF)
    assert view.exhausted and view.attempt == 1
    assert [f.attempt for f in view.failures] == [0, 1] and view.failures[1].reason == "oom"
    assert effects == [AttemptsExhausted(view)]
    assert s.topology is not None  # nothing restarts: the last attempt's state stays as it was
    assert s.next_attempt(next_attempt(1), PROOF) == (view, [])


def test_no_restart_is_allowed_with_max_restarts_0():
    view, effects = with_agent(published(n=2), max_restarts=0).next_attempt(next_attempt(0), PROOF)
    assert view.exhausted and view.attempt == 0 and isinstance(effects[0], AttemptsExhausted)


def test_a_process_of_another_attempt_is_refused_naming_both_and_one_naming_none_joins():
    s = with_agent(published(n=2))
    s.next_attempt(next_attempt(0), PROOF)
    s.take_journal()
    with pytest.raises(ClusterMismatch, match="belongs to attempt 0 of the job; this coordinator serves attempt 1 of "
                                              "cluster 'default'"):
        s.register(replace(reg("late", 0, host="h0"), attempt=0), 1.0)
    with pytest.raises(ClusterMismatch, match=r"belongs to attempt 2 .* serves attempt 1 .* has not decided .* retry"):
        s.register(replace(reg("early", 0, host="h0"), attempt=2), 1.0)
    assert s.take_journal() == [] and s.registered == 0
    assert admit(s, reg("any", 0, host="h0"), 1.0) is not None and s.registered == 1


def test_a_lost_process_is_reported_to_agents_with_its_attempt_and_host():
    s = published(n=2)
    lose_session(s, 1)
    effects = s.tick(TIMEOUT * 2)
    [failed] = [e for e in effects if isinstance(e, AttemptProcessFailed)]
    assert (failed.failure.attempt, failed.failure.process_id, failed.failure.host) == (0, 1, "h1")
    assert "lost its connection" in failed.failure.reason


def journal_of_three_attempts() -> tuple[ClusterState, list[journal.Entry]]:
    s = with_agent(published(n=2))
    entries = s.take_journal()
    for attempt in range(3):
        if attempt:
            register_attempt(s, 2, attempt)
        s.current.keys.set(f"p0-a{attempt}" if attempt else "p0", f"key-{attempt}", b"v", False)
        s.current.keys.increment(f"p1-a{attempt}" if attempt else "p1", "n", 1, f"r{attempt}")
        if attempt < 2:
            s.next_attempt(next_attempt(attempt, request_id=f"next-{attempt}"), PROOF)
        entries += s.take_journal()
    return s, entries


def observable(s: ClusterState):
    """The attempts, the topology, every key, and what a retry of the last increment is answered."""
    keys = s.current.keys
    return s.attempts.view(), s.topology, keys.dir("p0-a2", ""), keys.increment("p1-a2", "n", 1, "r2")


def test_replay_rebuilds_the_same_attempt_history_and_state():
    s, entries = journal_of_three_attempts()
    fresh = ClusterState(s.config)
    for entry in [journal.decode(journal.encode(e)) for e in entries]:
        fresh.replay(entry)
    assert observable(fresh) == observable(s)
    assert observable(fresh)[2:] == ([("key-2", b"v"), ("n", b"1")], (1, []))  # nothing of attempts 0 and 1


def test_compaction_drops_ended_attempts_key_values_and_keeps_the_history_whole_or_in_part():
    s, entries = journal_of_three_attempts()
    keep = compaction.needed(entries)
    dropped = [e for e, k in zip(entries, keep, strict=True) if not k]
    assert {type(e) for e in dropped} == {journal.KeySet, journal.KeyIncremented}
    assert all(k for e, k in zip(entries, keep, strict=True) if isinstance(e, journal.AttemptDecided))
    expected = observable(s)
    for cut in range(len(entries) + 1):  # a store that compacts oldest first may stop anywhere
        part = [e for e, k in zip(entries[:cut], keep[:cut], strict=True) if k] + entries[cut:]
        fresh = ClusterState(s.config)
        for entry in part:
            fresh.replay(entry)
        assert observable(fresh) == expected, cut


# Over gRPC, against a real coordinator.

def register_all(stub: CoordinatorStub, n: int, attempt: int | None) -> list[pb.RegisterResponse]:
    """Every process of attempt ``attempt`` registers (each a new uid, as a restarted worker is)."""
    def one(pid: int) -> pb.RegisterResponse:
        fields = {"attempt": attempt} if attempt is not None else {}
        request = register_request(pid, client_uid=f"uid-{pid}-a{attempt}", wait_ms=30_000, **fields)
        while not (answer := stub.Register(request, timeout=60)).fingerprint:
            pass
        return answer

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def typed(call) -> Exception:
    try:
        call()
    except grpc.RpcError as e:
        return from_rpc_error(e, "test")
    raise AssertionError("the call succeeded")


def test_the_next_attempt_is_decided_once_under_concurrent_calls_from_every_agent(start_coordinator):
    coordinator = start_coordinator(num_processes=8)
    crowd = [WireAgent(coordinator.address, f"host-{i}").join() for i in range(8)]
    try:
        register_all(crowd[0].coordinator, 8, attempt=0)
        barrier = threading.Barrier(8)

        def ask(agent: WireAgent) -> pb.JobState:
            barrier.wait()
            return agent.next(0, request_id=f"{agent.uid}-0", reason=f"seen by {agent.uid}")

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, crowd))
        assert all(a == answers[0] for a in answers)
        assert answers[0].attempt == 1 and len(answers[0].failures) == 1
        assert coordinator.log.count("attempt 0 of the job ended") == 1
        assert crowd[0].coordinator.Status(pb.StatusRequest(), timeout=10).attempt == 1
    finally:
        for agent in crowd:
            agent.close()


def test_a_new_attempt_refuses_the_ended_one_ends_its_waits_and_forgets_its_keys(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="DEBUG")
    with WireAgent(coordinator.address, "host-1").join() as agent:
        stub = agent.coordinator
        old = register_all(stub, 2, attempt=0)
        stub.KeyValueSet(pb.KeyValueSetRequest(client_uid="uid-0-a0", key="jax/coordinator", value=b"10.0.0.1:1"),
                         timeout=10)
        waiting = ThreadPoolExecutor(1).submit(lambda: typed(lambda: stub.Barrier(pb.BarrierRequest(
            client_uid="uid-0-a0", name="step-100", timeout_ms=60_000), timeout=90)))
        coordinator.wait_for_log("barrier 'step-100'", timeout=30)  # the barrier waits (logged at DEBUG)
        assert agent.next(0).attempt == 1
        error = waiting.result(timeout=30)
        assert isinstance(error, AttemptEnded), error
        assert "attempt 0 of the job ended while barrier 'step-100' waited: attempt 1 runs now" in str(error)

        stale = typed(lambda: stub.Register(register_request(0, client_uid="late", attempt=0, wait_ms=1000),
                                            timeout=10))
        assert isinstance(stale, ClusterMismatch)
        assert "belongs to attempt 0 of the job; this coordinator serves attempt 1" in str(stale)

        new = register_all(stub, 2, attempt=1)
        assert [a.process_id for a in new] == [a.process_id for a in old] == [0, 1]
        assert {a.fingerprint for a in new} == {old[0].fingerprint}
        answer = stub.KeyValueTryGet(pb.KeyValueTryGetRequest(client_uid="uid-0-a1", key="jax/coordinator"),
                                     timeout=10)
        assert not answer.found


def test_an_agent_watches_failures_attempts_and_exhaustion_in_order(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2)
    with WireAgent(coordinator.address, "host-0", max_restarts=1) as agent:
        watch, first = agent.watch()
        assert first.WhichOneof("kind") == "state" and first.state.attempt == 0 and not first.state.exhausted
        assert first.state.max_restarts == 1
        register_all(agent.coordinator, 2, attempt=0)  # no session is opened: both are failed once the timeout passes
        failed = [next(watch), next(watch)]
        assert {e.process_failed.process_id for e in failed} == {0, 1}
        assert {e.process_failed.host for e in failed} == {"host-0", "host-1"}
        assert all(e.process_failed.attempt == 0 and "did not come back" in e.process_failed.reason for e in failed)
        agent.next(0, process_id=1)  # another host's process: what the coordinator declared is the cause
        started = next(watch)
        assert started.WhichOneof("kind") == "attempt_started" and started.attempt_started.attempt == 1
        agent.next(1, reason="oom")
        end = next(watch)
        assert end.WhichOneof("kind") == "exhausted" and end.exhausted.exhausted
        [declared] = [e.process_failed for e in failed if e.process_failed.process_id == 1]
        assert [(f.attempt, f.process_id, f.reason) for f in end.exhausted.failures] == [
            (0, 1, declared.reason), (1, 0, "oom")]
        only_watching = pb.WatchJobRequest(host="host-1", agent_uid="agent-1")  # workers 0: watches, joins nothing
        again = next(agent.jobs.WatchJob(only_watching, timeout=30, metadata=agent.metadata))
        assert again.state == end.exhausted  # a watch opened later starts from the same state
        watch.cancel()


def test_watches_are_bounded_and_checked(start_coordinator):
    coordinator = start_coordinator("--max-agents", "1", num_processes=2)
    with WireAgent(coordinator.address, "host-0") as agent:
        job = agent.jobs
        watch, first = agent.watch(timeout=60)
        assert first.state.attempt == 0
        with pytest.raises(grpc.RpcError) as full:
            next(job.WatchJob(pb.WatchJobRequest(host="host-1", agent_uid="b"), timeout=30))
        assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 agents watch the job: expected at most 1 (the coordinator's --max-agents)" in full.value.details()
        watch.cancel()
        with pytest.raises(grpc.RpcError) as empty:
            next(job.WatchJob(pb.WatchJobRequest(host="", agent_uid="c"), timeout=30))
        assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "host" in empty.value.details()
        with pytest.raises(grpc.RpcError) as no_secret:
            next(job.WatchJob(pb.WatchJobRequest(host="host-1", agent_uid="d", workers=1), timeout=30))
        assert no_secret.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "this agent's call carries no secret" in no_secret.value.details()
        with pytest.raises(grpc.RpcError) as ahead:
            agent.next(5)
        assert ahead.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "ended_attempt 5 is ahead of the job's current attempt 0" in ahead.value.details()


def test_after_a_leader_kill_the_new_leader_serves_the_same_attempt_and_a_retry_does_not_advance(etcd):
    args = ("--store", etcd.url, "--cluster-id", "job", "--leader-ttl", LEADER_TTL)
    replicas = [LocalCoordinator(*args, num_processes=2), LocalCoordinator(*args, num_processes=2)]
    secret = secrets.token_hex(16)
    try:
        leader = serving(*replicas)
        with WireAgent(leader.address, "host-1", secret=secret).join() as agent:
            register_all(agent.coordinator, 2, attempt=0)
            decided = agent.next(0, request_id="agent-1-after-0")
        leader.stop(signal.SIGKILL)
        standby = serving(*[r for r in replicas if r is not leader], timeout=60)
        with WireAgent(standby.address, "host-1", secret=secret) as agent:  # the same agent, on the new leader
            assert agent.next(0, request_id="agent-1-after-0") == decided  # the retry: the same answer
            assert decided.attempt == 1 and len(decided.failures) == 1
            assert agent.watch()[1].state == decided
            with WireAgent(standby.address, "host-1", secret="another") as impostor, \
                    pytest.raises(grpc.RpcError) as refused:
                impostor.next(1)  # the agent's id and secret hash survived the failover: another secret is refused
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert agent.coordinator.Status(pb.StatusRequest(), timeout=10).attempt == 1
            assert [a.process_id for a in register_all(agent.coordinator, 2, attempt=1)] == [0, 1]
    finally:
        for r in replicas:
            r.close()


def test_a_process_that_names_no_attempt_joins_the_current_one(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    with WireAgent(coordinator.address, "host-0").join() as agent:
        register_all(agent.coordinator, 1, attempt=None)
        agent.next(0)
        assert register_all(agent.coordinator, 1, attempt=None)[0].process_id == 0


def test_agents_need_the_cluster_token_like_processes(start_coordinator, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    key = secret_file(tmp_path / "agent-key")
    coordinator = start_coordinator("--token-file", str(token_file), "--agent-key-file", str(key), num_processes=1)
    with WireAgent(coordinator.address, "host-0") as agent:
        with pytest.raises(grpc.RpcError) as refused:
            agent.next(0)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as watch_refused:
            agent.watch(timeout=30)
        assert watch_refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with WireAgent(coordinator.address, "host-0", token="s3cret",
                   credential=host_credential(key.read_text().strip(), "host-0")) as agent:
        watch, first = agent.watch(timeout=30)
        assert first.state.attempt == 0
        watch.cancel()


# Authority: only the job decides about the job.

def test_an_agent_of_the_job_may_end_an_attempt_only_for_its_own_workers_or_a_declared_failure():
    s = with_agent(published(n=2))
    other = Agent("agent-h0", "h0", "10.0.0.1", proof_of("h0's secret"), 1)
    s.join_agent(other, None)
    s.take_journal()
    with pytest.raises(PermissionDenied, match=r"process 1 registered from 'h1' \(10\.0\.0\.1\), not from this "
                                               r"agent's host 'h0' \(10\.0\.0\.1\)"):
        s.next_attempt(next_attempt(0, agent_uid=other.uid), other.secret_hash)
    with pytest.raises(PermissionDenied, match="does not carry its secret"):  # h1's id, h0's secret
        s.next_attempt(next_attempt(0), other.secret_hash)
    with pytest.raises(PermissionDenied, match="is no agent of this job"):
        s.next_attempt(next_attempt(0, agent_uid="nobody"), PROOF)
    assert s.take_journal() == [] and s.attempts.current == 0 and s.topology is not None
    lose_session(s, 1)
    s.tick(TIMEOUT * 2)  # the coordinator declares process 1 failed: any agent of the job may end the attempt
    view, _ = s.next_attempt(next_attempt(0, agent_uid=other.uid), other.secret_hash)
    assert view.attempt == 1 and view.failures[0].process_id == 1 and "lost its connection" in view.failures[0].reason


def test_an_agent_may_report_its_own_worker_that_never_registered():
    s = with_agent(published(n=2))
    s.next_attempt(next_attempt(0), PROOF)
    view, _ = s.next_attempt(next_attempt(1, failure=AttemptFailure(1, UNKNOWN_PROCESS, "", "local rank 0: exit "
                                                                                           "code 3")), PROOF)
    assert view.attempt == 2 and view.failures[-1] == AttemptFailure(1, UNKNOWN_PROCESS, "h1", "local rank 0: exit "
                                                                                             "code 3")


def test_the_jobs_agents_are_bounded_by_its_processes_and_a_restarted_agent_takes_its_hosts_place():
    s = with_agent(published(n=2))
    s.join_agent(Agent("agent-h0", "h0", "10.0.0.1", proof_of("h0"), 1), None)
    with pytest.raises(ClusterMismatch, match="this agent's 1 would exceed the job's 2 processes"):
        s.join_agent(Agent("intruder", "elsewhere", "10.0.0.9", proof_of("x"), 1), None)
    with pytest.raises(PermissionDenied, match="does not carry its secret"):
        s.join_agent(replace(AGENT, secret_hash=proof_of("another")), None)
    restarted = Agent("agent-h1-again", "h1", "10.0.0.1", proof_of("new"), 1)  # h1's agent, restarted
    s.join_agent(restarted, None)
    with pytest.raises(PermissionDenied, match="is no agent of this job"):
        s.next_attempt(next_attempt(0), PROOF)  # the old one's place is taken
    assert s.next_attempt(next_attempt(0, agent_uid=restarted.uid), restarted.secret_hash)[0].attempt == 1


def test_a_restarted_agent_never_takes_the_place_of_a_live_agent_on_the_same_host_and_address():
    # Several agents of one job on one machine (same hostname and address): host 1's agent is killed and restarted
    # before the heartbeat timeout makes it absent; host 0's agent watches all along and keeps its place.
    s = published(n=2)
    live, killed = (Agent(f"agent-{rank}", "vm", "127.0.0.1", proof_of(f"s{rank}"), 1) for rank in range(2))
    s.join_agent(live, None)
    s.join_agent(killed, None)
    restarted = Agent("agent-1-again", "vm", "127.0.0.1", proof_of("again"), 1)
    s.join_agent(restarted, None, watching=frozenset({live.uid}))  # the killed one's watch ended with it
    assert restarted.uid in s.attempts.agents and live.uid in s.attempts.agents and killed.uid not in s.attempts.agents
    with pytest.raises(ClusterMismatch, match="would exceed the job's 2 processes"):  # both watch: no place is free
        s.join_agent(Agent("agent-third", "vm", "127.0.0.1", proof_of("3"), 1), None,
                     watching=frozenset({live.uid, restarted.uid}))


def test_the_restart_budget_is_the_coordinators_or_the_first_agents_and_another_is_refused():
    s = with_agent(published(n=2), max_restarts=2)
    other = Agent("agent-h0", "h0", "10.0.0.1", proof_of("h0"), 1)
    with pytest.raises(ClusterMismatch, match=r"expects --max-restarts 9, but the job's restart budget is 2 \(stated "
                                              r"by the job's first agent, on 'h1'\)"):
        s.join_agent(other, 9)
    s.join_agent(other, None)  # states none: takes the job's
    s.take_journal()
    with pytest.raises(ClusterMismatch, match="max_restarts 1000 differs from the job's restart budget 2"):
        s.next_attempt(next_attempt(0, max_restarts=1000), PROOF)
    assert s.take_journal() == [] and s.attempts.view().max_restarts == 2
    configured = with_agent(published(n=2, max_restarts=1), max_restarts=None)
    with pytest.raises(ClusterMismatch, match=r"budget is 1 \(the coordinator's --max-restarts\)"):
        configured.join_agent(other, 0)
    assert with_agent(published(n=2), max_restarts=None).attempts.view().max_restarts == 0


def test_a_new_agent_of_an_exhausted_job_starts_its_next_run_clean_and_a_replay_agrees():
    s = with_agent(published(n=2), max_restarts=0)
    entries = s.take_journal()
    view, _ = s.next_attempt(next_attempt(0), PROOF)
    assert view.exhausted
    assert s.join_agent(AGENT, 0) == []  # the exhausted job's own agent: nothing changes
    newcomer = Agent("next-run", "h1", "10.0.0.1", proof_of("next"), 1)
    [started] = s.join_agent(newcomer, 1)
    assert started == AttemptStarted(s.attempts.view())
    assert s.attempts.view() == replace(s.attempts.view(), attempt=1, failures=(), exhausted=False, max_restarts=1)
    assert s.topology is None and s.registered == 0  # the exhausted run's registrations are gone
    register_attempt(s, 2, attempt=1)
    assert s.next_attempt(next_attempt(1, agent_uid=newcomer.uid), newcomer.secret_hash)[0].attempt == 2
    entries += s.take_journal()
    fresh = ClusterState(replace(s.config, attempt=0))  # as the coordinator started: --attempt 0
    for entry in [journal.decode(journal.encode(e)) for e in entries]:
        fresh.replay(entry)
    assert fresh.attempts.view() == s.attempts.view()
    with pytest.raises(PermissionDenied):  # the old run's agents are gone with it
        fresh.next_attempt(next_attempt(2), PROOF)


def test_failures_kept_are_bounded_in_count_and_text():
    s = with_agent(published(n=2), max_restarts=1000)
    for attempt in range(FAILURES_KEPT + 8):
        s.next_attempt(next_attempt(attempt, failure=replace(FAILURE, reason="r" * 1024)), PROOF)
    view = s.attempts.view()
    assert len(view.failures) == FAILURES_KEPT and view.earlier == 8
    assert view.failures[-1].attempt == FAILURES_KEPT + 7
    failed = Attempts(0).process_failed(0, "h" * 5000, "why " * 1000, s.config.limits).failure  # bounded as kept
    assert len(failed.host.encode()) == len(failed.reason.encode()) == s.config.limits.string_bytes


def test_an_agent_cannot_act_for_another_or_end_an_attempt_for_another_hosts_process(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    with WireAgent(coordinator.address, "host-0").join() as a0, WireAgent(coordinator.address, "host-1").join() as a1:
        register_all(a0.coordinator, 2, attempt=0)
        other_host = typed(lambda: a0.next(0, process_id=1))  # on main: attempt 1 started
        assert isinstance(other_host, PermissionDenied), other_host
        assert "process 1 registered from 'host-1' (127.0.0.1), not from this agent's host 'host-0'" in str(other_host)
        with WireAgent(coordinator.address, "host-1", secret="a guess") as impostor:  # a1's id, another secret
            acting = typed(lambda: impostor.next(0))
            assert isinstance(acting, PermissionDenied) and "does not carry its secret" in str(acting), acting
            rejoining = typed(lambda: impostor.watch(timeout=10))
            assert isinstance(rejoining, PermissionDenied), rejoining
        assert a0.coordinator.Status(pb.StatusRequest(), timeout=10).attempt == 0
        assert a1.next(0).attempt == 1  # its own worker: it may


def test_a_watchs_first_message_lists_the_latest_failures_only(start_coordinator):
    coordinator = start_coordinator("--max-restarts", "1000", num_processes=1)
    restarts = FAILURES_KEPT + 40
    with WireAgent(coordinator.address, "host-0", max_restarts=None) as agent:
        agent.join()
        for attempt in range(restarts):
            agent.next(attempt, reason="r" * 1024)  # the longest reason a failure may have (--max-string-bytes)
        watch, first = agent.watch(timeout=30)
        watch.cancel()
    assert first.state.attempt == restarts and first.state.earlier_failures == 40
    assert len(first.state.failures) == FAILURES_KEPT and first.state.failures[-1].attempt == restarts - 1
    assert first.ByteSize() < FAILURES_KEPT * (2 * 1024 + 32)  # on main: every failure, 2.1 MB after 1,024


def test_many_unread_watches_of_a_job_restarted_a_thousand_times_hold_little_memory(start_coordinator):
    coordinator = start_coordinator("--max-restarts", "2000", num_processes=1)
    with WireAgent(coordinator.address, "host-0", max_restarts=None) as agent:
        agent.join()
        for attempt in range(1024):
            agent.next(attempt, reason="r" * 1024)
        time.sleep(2)  # one round of the daemon's collection of garbage
        pid = coordinator.process.pid
        before = rss_bytes(pid)
        only_watching = pb.WatchJobRequest(host="onlooker", agent_uid="onlooker")
        unread = [agent.jobs.WatchJob(only_watching, timeout=120) for _ in range(300)]  # none is read
        time.sleep(3)  # each watch's first message is sent, or waits in the daemon
        grown = rss_bytes(pid) - before
        for call in unread:
            call.cancel()
    assert grown < 48 << 20, f"300 unread watches grew the coordinator by {grown >> 20} MiB"  # before: 239 MiB


def test_a_gone_agents_place_goes_to_a_newcomer_and_a_job_whose_agents_are_all_gone_starts_a_new_run():
    s = with_agent(published(n=2))
    h0 = Agent("agent-h0", "h0", "10.0.0.1", proof_of("h0"), 1)
    s.join_agent(h0, None)
    newcomer = Agent("agent-h9", "h9", "10.0.0.9", proof_of("h9"), 1)
    with pytest.raises(ClusterMismatch, match="would exceed the job's 2 processes"):
        s.join_agent(newcomer, None)  # while both are present
    assert s.join_agent(newcomer, None, absent=frozenset({h0.uid})) == []  # h0's agent is gone: its place is free
    assert s.attempts.agents == {AGENT.uid, newcomer.uid} and s.attempts.current == 0 and s.topology is not None
    later = Agent("next-run", "h7", "10.0.0.7", proof_of("next"), 1)
    [started] = s.join_agent(later, None, absent=frozenset({AGENT.uid, newcomer.uid}))
    assert started.view.attempt == 1 and started.view.failures == ()
    assert s.attempts.agents == {later.uid} and s.topology is None


def test_agents_that_are_gone_make_room_for_the_next_run_of_the_job(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2)
    first = [WireAgent(coordinator.address, f"host-{i}") for i in range(2)]
    watches = [agent.watch()[0] for agent in first]
    register_all(first[0].coordinator, 2, attempt=0)
    with WireAgent(coordinator.address, "host-9") as intruder:
        refused = typed(lambda: intruder.watch(timeout=10))
        assert isinstance(refused, ClusterMismatch) and "would exceed the job's 2 processes" in str(refused), refused
    for watch, agent in zip(watches, first, strict=True):  # the job is over: its agents exit
        watch.cancel()
        agent.close()
    time.sleep(1.5)  # longer than the heartbeat timeout
    second = [WireAgent(coordinator.address, f"host-{i}", uid=f"second-{i}") for i in (2, 3)]
    try:
        states = [agent.watch(timeout=10)[1].state for agent in second]
        assert [s.attempt for s in states] == [1, 1] and states[0].failures == []
        assert "a new run of the job starts as attempt 1" in coordinator.log
    finally:
        for agent in second:
            agent.close()


def test_a_process_whose_attempt_ended_says_so_not_that_it_lost_the_coordinator(start_coordinator, caplog):
    coordinator = start_coordinator(num_processes=1)
    caplog.set_level(logging.INFO, logger="ifrt.client")
    with WireAgent(coordinator.address, "host-1").join() as agent, \
            ifrt.Client(coordinator.address, process_id=0, attempt=0, transfer=False, timeout=30) as client:
        ended = threading.Event()
        client.on_event(lambda e: isinstance(e, CoordinatorLost) and ended.set())
        client.discover()
        assert client.wait_attached(30)
        assert agent.next(0).attempt == 1
        assert ended.wait(30)
    said = [r for r in caplog.records if "attempt 0 of the job ended and attempt 1 starts" in r.getMessage()]
    assert said and said[0].levelno == logging.INFO
    assert not [r for r in caplog.records if "lost the coordinator" in r.getMessage()]
