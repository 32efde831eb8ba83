"""Job attempts decided by the coordinator (the JobAgents service that `ifrt run` agents call): the next attempt is
decided once, journaled, and starts every part of the state empty; the ended attempt's processes are refused and
its waits answered AttemptEnded; agents watch failures, attempts and exhaustion in order; a leader kill changes
none of it."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest

from coordinator import compaction, journal
from coordinator.attempts import (
    UNKNOWN_PROCESS,
    AttemptFailure,
    AttemptProcessFailed,
    AttemptsExhausted,
    AttemptStarted,
    NextAttempt,
)
from coordinator.local import LocalCoordinator
from coordinator.state import ClusterState
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub, JobAgentsStub
from ifrt.errors import AttemptEnded, ClusterMismatch, InvalidArgument, from_rpc_error
from ifrt.protocol import TOKEN_METADATA
from tests.helpers import TIMEOUT, admit, lose_session, published, reg, register_request
from tests.replicas import LEADER_TTL, serving

FAILURE = AttemptFailure(0, 1, "h1", "worker exited with 1")


def next_attempt(ended: int, max_restarts: int = 3, request_id: str = "", failure: AttemptFailure = FAILURE):
    return NextAttempt(ended, replace(failure, attempt=ended), max_restarts, request_id)


def fingerprint(s: ClusterState) -> str:
    assert s.topology is not None
    return wire.fingerprint(wire.encode(s.topology))


def register_attempt(s: ClusterState, n: int, attempt: int, now: float = 1.0) -> None:
    for i in range(n):
        admit(s, replace(reg(f"p{i}-a{attempt}", i, host=f"h{i}"), attempt=attempt), now)


# The pure sub-machine, through the state machine.

def test_the_next_attempt_starts_every_part_of_the_state_empty_and_gives_the_same_ids_and_topology():
    s = published(n=2)
    before = fingerprint(s)
    s.kv_set("p0", "jax/coordinator", b"10.0.0.1:1234", False)
    view, effects = s.next_attempt(next_attempt(0, request_id="r1"))
    assert (view.attempt, view.failures, view.exhausted) == (1, (FAILURE,), False)
    assert effects == [AttemptStarted(view)]
    assert [type(e) for e in s.take_journal()][-1] is journal.AttemptDecided
    assert s.topology is None and s.registered == 0
    with pytest.raises(Exception, match="not a registered process"):
        s.kv_get("p0", "jax/coordinator")
    register_attempt(s, 2, attempt=1)
    assert fingerprint(s) == before  # same hosts and devices: the same ids, generation and bytes
    assert s.kv_get("p0-a1", "jax/coordinator") is None


def test_a_retry_or_another_agent_asking_for_an_ended_attempt_changes_nothing():
    s = published(n=2)
    first, _ = s.next_attempt(next_attempt(0, request_id="r1"))
    s.take_journal()
    for call in (next_attempt(0, request_id="r1"), next_attempt(0, request_id="r2"),
                 next_attempt(0, failure=AttemptFailure(0, UNKNOWN_PROCESS, "", "another reason"))):
        assert s.next_attempt(call) == (first, [])
    assert s.take_journal() == []


def test_an_attempt_ahead_or_strings_over_the_limits_are_refused_and_change_nothing():
    s = published(n=2)
    s.take_journal()
    with pytest.raises(InvalidArgument, match="ended_attempt 1 is ahead of the job's current attempt 0"):
        s.next_attempt(next_attempt(1))
    with pytest.raises(InvalidArgument, match=r"failure.reason .* is 2000 bytes long: expected at most 1024"):
        s.next_attempt(next_attempt(0, failure=replace(FAILURE, reason="x" * 2000)))
    with pytest.raises(InvalidArgument, match="request_id is 2000 bytes long"):
        s.next_attempt(next_attempt(0, request_id="r" * 2000))
    with pytest.raises(InvalidArgument, match=r"failure\.process_id -2 is out of range"):
        s.next_attempt(next_attempt(0, failure=replace(FAILURE, process_id=-2)))
    assert s.take_journal() == [] and s.attempts.current == 0 and s.topology is not None


def test_after_max_restarts_the_job_is_exhausted_and_stays_so():
    s = published(n=2)
    s.next_attempt(next_attempt(0, max_restarts=1))
    register_attempt(s, 2, attempt=1)
    view, effects = s.next_attempt(next_attempt(1, max_restarts=1, failure=AttemptFailure(1, 0, "h0", "oom")))
    assert view.exhausted and view.attempt == 1
    assert [f.attempt for f in view.failures] == [0, 1] and view.failures[1].reason == "oom"
    assert effects == [AttemptsExhausted(view)]
    assert s.topology is not None  # nothing restarts: the last attempt's state stays as it was
    assert s.next_attempt(next_attempt(1, max_restarts=5)) == (view, [])


def test_no_restart_is_allowed_with_max_restarts_0():
    view, effects = published(n=2).next_attempt(next_attempt(0, max_restarts=0))
    assert view.exhausted and view.attempt == 0 and isinstance(effects[0], AttemptsExhausted)


def test_a_process_of_another_attempt_is_refused_naming_both_and_one_naming_none_joins():
    s = published(n=2)
    s.next_attempt(next_attempt(0))
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
    s = published(n=2)
    entries = s.take_journal()
    for attempt in range(3):
        if attempt:
            register_attempt(s, 2, attempt)
        s.kv_set(f"p0-a{attempt}" if attempt else "p0", f"key-{attempt}", b"v", False)
        s.kv_increment(f"p1-a{attempt}" if attempt else "p1", "n", 1, f"r{attempt}")
        if attempt < 2:
            s.next_attempt(next_attempt(attempt, request_id=f"next-{attempt}"))
        entries += s.take_journal()
    return s, entries


def observable(s: ClusterState):
    """The attempts, the topology, every key, and what a retry of the last increment is answered."""
    return s.attempts.view(), s.topology, s.kv_dir("p0-a2", ""), s.kv_increment("p1-a2", "n", 1, "r2")


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

def agents(address: str) -> tuple[CoordinatorStub, JobAgentsStub, grpc.Channel]:
    channel = grpc.insecure_channel(address)
    return CoordinatorStub(channel), JobAgentsStub(channel), channel


def wire_next(stub: JobAgentsStub, ended: int, *, max_restarts: int = 3, request_id: str = "",
              process_id: int = 1, reason: str = "worker exited with 1") -> pb.JobState:
    request = pb.NextAttemptRequest(ended_attempt=ended, max_restarts=max_restarts, request_id=request_id,
                                    failure=pb.AttemptFailure(attempt=ended, process_id=process_id,
                                                              host=f"host-{process_id}", reason=reason))
    return stub.NextAttempt(request, timeout=30).state


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
    coordinator = start_coordinator(num_processes=2)
    stub, job, channel = agents(coordinator.address)
    with channel:
        register_all(stub, 2, attempt=0)
        barrier = threading.Barrier(8)

        def agent(i: int) -> pb.JobState:
            barrier.wait()
            return wire_next(job, 0, request_id=f"agent-{i}", process_id=i % 2, reason=f"seen by agent {i}")

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(agent, range(8)))
        assert all(a == answers[0] for a in answers)
        assert answers[0].attempt == 1 and len(answers[0].failures) == 1
        assert coordinator.log.count("attempt 0 of the job ended") == 1
        assert stub.Status(pb.StatusRequest(), timeout=10).attempt == 1


def test_a_new_attempt_refuses_the_ended_one_ends_its_waits_and_forgets_its_keys(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="DEBUG")
    stub, job, channel = agents(coordinator.address)
    with channel:
        old = register_all(stub, 2, attempt=0)
        stub.KeyValueSet(pb.KeyValueSetRequest(client_uid="uid-0-a0", key="jax/coordinator", value=b"10.0.0.1:1"),
                         timeout=10)
        waiting = ThreadPoolExecutor(1).submit(lambda: typed(lambda: stub.Barrier(pb.BarrierRequest(
            client_uid="uid-0-a0", name="step-100", timeout_ms=60_000), timeout=90)))
        coordinator.wait_for_log("barrier 'step-100'", timeout=30)  # the barrier waits (logged at DEBUG)
        assert wire_next(job, 0).attempt == 1
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
    stub, job, channel = agents(coordinator.address)
    with channel:
        watch = job.WatchJob(pb.WatchJobRequest(host="host-0", agent_uid="agent-0"), timeout=120)
        first = next(watch)
        assert first.WhichOneof("kind") == "state" and first.state.attempt == 0 and not first.state.exhausted
        register_all(stub, 2, attempt=0)  # no session is opened: both are failed once the timeout passes
        failed = [next(watch), next(watch)]
        assert {e.process_failed.process_id for e in failed} == {0, 1}
        assert {e.process_failed.host for e in failed} == {"host-0", "host-1"}
        assert all(e.process_failed.attempt == 0 and "did not come back" in e.process_failed.reason for e in failed)
        wire_next(job, 0, max_restarts=1)
        started = next(watch)
        assert started.WhichOneof("kind") == "attempt_started" and started.attempt_started.attempt == 1
        wire_next(job, 1, max_restarts=1, process_id=0, reason="oom")
        end = next(watch)
        assert end.WhichOneof("kind") == "exhausted" and end.exhausted.exhausted
        assert [(f.attempt, f.reason) for f in end.exhausted.failures] == [(0, "worker exited with 1"), (1, "oom")]
        again = next(job.WatchJob(pb.WatchJobRequest(host="host-1", agent_uid="agent-1"), timeout=30))
        assert again.state == end.exhausted  # a watch opened later starts from the same state
        watch.cancel()


def test_watches_are_bounded_and_checked(start_coordinator):
    coordinator = start_coordinator("--max-agents", "1", num_processes=2)
    _, job, channel = agents(coordinator.address)
    with channel:
        watch = job.WatchJob(pb.WatchJobRequest(host="host-0", agent_uid="a"), timeout=60)
        assert next(watch).state.attempt == 0
        with pytest.raises(grpc.RpcError) as full:
            next(job.WatchJob(pb.WatchJobRequest(host="host-1", agent_uid="b"), timeout=30))
        assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 agents watch the job: expected at most 1 (the coordinator's --max-agents)" in full.value.details()
        watch.cancel()
        with pytest.raises(grpc.RpcError) as empty:
            next(job.WatchJob(pb.WatchJobRequest(host="", agent_uid="c"), timeout=30))
        assert empty.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "host" in empty.value.details()
        with pytest.raises(grpc.RpcError) as ahead:
            wire_next(job, 5)
        assert ahead.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "ended_attempt 5 is ahead of the job's current attempt 0" in ahead.value.details()


def test_after_a_leader_kill_the_new_leader_serves_the_same_attempt_and_a_retry_does_not_advance(etcd):
    args = ("--store", etcd.url, "--cluster-id", "job", "--leader-ttl", LEADER_TTL)
    replicas = [LocalCoordinator(*args, num_processes=2), LocalCoordinator(*args, num_processes=2)]
    try:
        leader = serving(*replicas)
        stub, job, channel = agents(leader.address)
        with channel:
            register_all(stub, 2, attempt=0)
            decided = wire_next(job, 0, request_id="agent-0-after-0")
        leader.stop(signal.SIGKILL)
        standby = serving(*[r for r in replicas if r is not leader], timeout=60)
        stub, job, channel = agents(standby.address)
        with channel:
            assert wire_next(job, 0, request_id="agent-0-after-0") == decided  # the retry: the same answer
            assert decided.attempt == 1 and len(decided.failures) == 1
            assert next(job.WatchJob(pb.WatchJobRequest(host="h", agent_uid="a"), timeout=30)).state == decided
            assert stub.Status(pb.StatusRequest(), timeout=10).attempt == 1
            assert [a.process_id for a in register_all(stub, 2, attempt=1)] == [0, 1]
    finally:
        for r in replicas:
            r.close()


def test_a_process_that_names_no_attempt_joins_the_current_one(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    stub, job, channel = agents(coordinator.address)
    with channel:
        register_all(stub, 1, attempt=None)
        wire_next(job, 0)
        assert register_all(stub, 1, attempt=None)[0].process_id == 0


def test_agents_need_the_cluster_token_like_processes(start_coordinator, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    coordinator = start_coordinator("--token-file", str(token_file), num_processes=1)
    _, job, channel = agents(coordinator.address)
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            wire_next(job, 0)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        request = pb.WatchJobRequest(host="host-0", agent_uid="a")
        with pytest.raises(grpc.RpcError) as watch_refused:
            next(job.WatchJob(request, timeout=30))
        assert watch_refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        watch = job.WatchJob(request, timeout=30, metadata=[(TOKEN_METADATA, "s3cret")])
        assert next(watch).state.attempt == 0
        watch.cancel()
