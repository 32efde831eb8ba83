"""``ifrt run --recover replace``: a failed worker is replaced by its agent with the same process id while every other
worker keeps running; the coordinator decides each replacement once (journaled), within the restart budget, and only
for the job's own agents about their own workers. The agent's decisions (pure), the coordinator's (pure), and real
agents, workers and coordinators on loopback."""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import time
from dataclasses import replace

import grpc
import pytest

from coordinator.core import journal
from coordinator.core.effects import Notify
from coordinator.core.job_records import Agent as JobAgent
from coordinator.core.job_records import AttemptFailure, AttemptsExhausted, NextAttempt, ProcessReplaced
from coordinator.core.state import ClusterState
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import JobAgentsStub
from ifrt.errors import PermissionDenied
from ifrt.events import ProcessFailed
from ifrt.protocol import SECRET_METADATA, proof_of
from ifrt.run import agent as core
from ifrt.run.agent import Agent, Recover
from ifrt.run.messages import (
    AskNextAttempt,
    AskReplace,
    Exit,
    Failure,
    IdsKnown,
    JobUpdate,
    JobView,
    Kill,
    LearnIds,
    ProcessFailedSeen,
    ReplaceAnswered,
    ReplaceSeen,
    Say,
    Start,
    StartWorker,
    Stop,
    Tick,
    WorkerExited,
)
from tests.helpers import poll_until, published
from tests.replicas import Replicas
from tests.run_agents import RUN_WORKER, WAIT_S, kinds, loopback_env, started_lines

HEARTBEAT_S = 1.0


# The agent's decisions.

def replacing(nproc: int = 2, ids: dict[int, int] | None = None) -> Agent:
    agent = Agent(nproc, "node-a", ids=dict(ids if ids is not None else {0: 2, 1: 3}), recover=Recover.REPLACE)
    assert kinds(agent.handle(JobUpdate(JobView(0)), 0.0)) == [Start]
    return agent


def test_a_failed_worker_is_replaced_alone_once_the_coordinator_decided_it():
    agent = replacing()
    failure = Failure(0, 3, "node-a", "killed by SIGKILL")
    assert kinds(agent.handle(WorkerExited(0, 1, -signal.SIGKILL), 1.0)) == [AskReplace]  # no Stop: others run on
    assert agent.handle(ReplaceAnswered(0, 1, JobView(0, (failure,), replacements=1)), 1.1) == []
    assert agent.handle(ProcessFailedSeen(failure), 1.2) == []  # the old worker's failure: no kill
    actions = agent.handle(ReplaceSeen(failure), 1.3)
    assert kinds(actions) == [StartWorker] and actions[-1] == StartWorker(0, 1, 1)
    assert agent.handle(WorkerExited(0, 1, -signal.SIGKILL, incarnation=0), 1.4) == []  # the old one: no news
    later = Failure(0, 3, "node-a", "stopped answering")
    assert kinds(agent.handle(ProcessFailedSeen(later), 2.0)) == [Kill]  # the new one hangs: killed, then replaced
    assert kinds(agent.handle(WorkerExited(0, 1, -signal.SIGKILL, incarnation=1), 2.1)) == [AskReplace]


def test_a_hung_worker_is_killed_then_replaced_under_the_coordinators_reason():
    agent = replacing()
    hung = Failure(0, 2, "node-a", "stopped answering: no heartbeat for 1.0s")
    assert agent.handle(ProcessFailedSeen(hung), 1.0)[-1] == Kill(0)
    assert agent.handle(WorkerExited(0, 0, -signal.SIGKILL), 1.1)[-1] == AskReplace(0, 0, hung)


def test_a_worker_that_hangs_before_its_id_is_known_is_found_by_learning_the_ids_and_killed():
    agent = replacing(ids={})  # ids assigned by the coordinator, not learned yet
    hung = Failure(0, 3, "node-a", "stopped answering: no heartbeat for 1.0s")
    actions = agent.handle(ProcessFailedSeen(hung), 1.0)
    assert kinds(actions) == [LearnIds] and actions[-1] == LearnIds(0)
    assert agent.handle(IdsKnown({0: 2, 1: 3}), 1.2)[-1] == Kill(1)
    assert agent.handle(WorkerExited(0, 1, -signal.SIGKILL), 1.3)[-1] == AskReplace(0, 1, hung)


def test_a_failure_on_this_hostname_that_is_no_worker_here_kills_nothing_once_the_ids_are_known():
    agent = replacing(ids={})  # another agent on the same hostname (another address) runs process 5
    assert kinds(agent.handle(ProcessFailedSeen(Failure(0, 5, "node-a", "lost")), 1.0)) == [LearnIds]
    assert kinds(agent.handle(IdsKnown({0: 2, 1: 3}), 1.2)) == []
    assert kinds(agent.handle(ProcessFailedSeen(Failure(0, 6, "node-b", "lost")), 1.3)) == []  # another host


def test_a_failure_on_another_host_leaves_this_hosts_workers_running():
    agent = replacing()
    assert kinds(agent.handle(ProcessFailedSeen(Failure(0, 0, "node-b", "lost")), 1.0)) == []
    assert kinds(agent.handle(ReplaceSeen(Failure(0, 0, "node-b", "lost")), 1.1)) == []


def test_replacements_exhausted_end_the_agent_naming_each_failure():
    agent = replacing()
    agent.handle(WorkerExited(0, 1, 3), 1.0)
    failures = (Failure(0, 3, "node-a", "exit code 3"), Failure(0, 3, "node-a", "exit code 3"))
    actions = agent.handle(ReplaceAnswered(0, 1, JobView(0, failures, exhausted=True, max_restarts=1)), 1.1)
    assert actions[0] == Stop() and actions[-1] == Exit(core.EXIT_JOB_FAILED)
    assert sum("process 3 on node-a failed: exit code 3" in a.line for a in actions if isinstance(a, Say)) == 2


def test_a_worker_ended_by_fail_fast_restarts_the_job_as_without_replace():
    agent = replacing()
    assert kinds(agent.handle(WorkerExited(0, 0, 75), 1.0)) == [Stop]  # a program that did not opt in


def test_a_refused_replacement_restarts_the_job_as_without_replace():
    agent = replacing()
    agent.handle(WorkerExited(0, 1, 3), 1.0)
    actions = agent.handle(ReplaceAnswered(0, 1, JobView(0), refused="the coordinator refused"), 1.1)
    assert kinds(actions) == [Stop, AskNextAttempt]


def test_a_decided_replacement_starts_even_if_the_watch_missed_its_event():
    agent = replacing()
    agent.handle(WorkerExited(0, 1, 3), 1.0)
    agent.handle(ReplaceAnswered(0, 1, JobView(0, replacements=1)), 1.1)
    assert agent.handle(Tick(), 1.2) == []
    assert kinds(agent.handle(Tick(), 1.1 + core.CAUSE_WAIT_S)) == [StartWorker]


# The coordinator's decisions.

PROOF = proof_of("the secret of the agent on h1")
AGENT = JobAgent("agent-h1", "h1", "10.0.0.1", PROOF, 1)
"""The agent of process 1 (host h1 in ``published``)."""


def replace_call(pid: int = 1, request_id: str = "r1", agent_uid: str = AGENT.uid) -> NextAttempt:
    return NextAttempt(0, AttemptFailure(0, pid, "h1", "exit code 3"), None, request_id, agent_uid, replace=True)


def job(max_restarts: int = 2, n: int = 2) -> ClusterState:
    s = published(n=n)
    s.join_agent(AGENT, max_restarts)
    return s


def test_a_replacement_is_decided_once_fails_the_old_process_first_and_keeps_the_attempt():
    s = job()
    view, effects = s.next_attempt(replace_call(), PROOF)
    assert (view.attempt, view.replacements, view.exhausted) == (0, 1, False)
    failed = [e for e in effects if isinstance(e, Notify) and isinstance(e.event, ProcessFailed)]
    assert failed and effects.index(failed[0]) < next(i for i, e in enumerate(effects)
                                                      if isinstance(e, ProcessReplaced))
    entries = s.take_journal()
    assert [type(e) for e in entries][-2:] == [journal.Failed, journal.AttemptDecided]
    assert s.topology is not None  # the attempt goes on: nothing started afresh
    again, effects = s.next_attempt(replace_call(), PROOF)  # its retry
    assert (again, effects) == (view, [])
    replayed = published(n=2)
    replayed.join_agent(AGENT, 2)
    for entry in entries:
        replayed.replay(entry)
    assert replayed.attempts.view() == view  # a failover decides nothing anew


def test_replacements_count_against_the_restart_budget():
    s = job(max_restarts=1)
    assert s.next_attempt(replace_call(request_id="r1"), PROOF)[0].replacements == 1
    view, effects = s.next_attempt(replace_call(request_id="r2"), PROOF)
    assert view.exhausted and [type(e) for e in effects] == [AttemptsExhausted]
    s.take_journal()
    for n in range(3, 50):  # asked again and again once exhausted: nothing more is held, nothing journaled
        assert s.next_attempt(replace_call(request_id=f"r{n}"), PROOF) == (view, [])
    assert s.take_journal() == [] and len(s.attempts.view().failures) == 2


def test_an_agent_cannot_replace_another_hosts_process():
    s = job()
    with pytest.raises(PermissionDenied, match="an agent may replace only its own workers"):
        s.next_attempt(replace_call(pid=0), PROOF)
    with pytest.raises(PermissionDenied, match="is no agent of this job"):
        s.next_attempt(replace_call(agent_uid="intruder"), proof_of("intruder"))
    assert s.attempts.view() == replace(s.attempts.view(), replacements=0, failures=())


# Real agents and workers.

def two_replacing_agents(agents, address: str, *flags: str):
    return [agents("--nproc-per-host", "2", "--host-rank", str(h), "--num-hosts", "2", "--grace-seconds", "2",
                   "--recover", "replace", *flags, "--", sys.executable, str(RUN_WORKER), "loop",
                   env=loopback_env(address)) for h in range(2)]


def process_lines(agent, process_id: int) -> list[re.Match]:
    return [m for line in agent.out
            if (m := re.search(rf"^\[{process_id}\] started process {process_id} attempt (\d+) pid (\d+)", line))]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_killed_or_hung_worker_is_replaced_while_the_others_keep_their_pids(start_coordinator, agents, signum):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=4, log_level="WARNING")
    both = two_replacing_agents(agents, coordinator.address, "--max-restarts", "1")
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    pids = {pid: int(m.group(3)) for lines in first for pid, m in lines.items()}
    os.kill(pids[3], signum)
    again = poll_until(lambda: process_lines(both[1], 3), lambda ms: len(ms) == 2, timeout=WAIT_S,
                       what="process 3 started anew")
    assert again[1].group(1) == "0" and int(again[1].group(2)) != pids[3]  # the same attempt, a new process
    for pid in (0, 1, 2):
        assert [int(m.group(2)) for m in process_lines(both[pid // 2], pid)] == [pids[pid]]  # never restarted
        assert os.path.exists(f"/proc/{pids[pid]}")
        both[pid // 2].wait_line(rf"^\[{pid}\] job whole at generation 1: process 3 incarnation 1$")  # JobWhole
    err = "\n".join(both[1].err)
    assert "asking the coordinator to replace it" in err, both[1].output()
    if signum == signal.SIGSTOP:
        assert "killing its worker (local rank 1)" in err, both[1].output()
    assert all(a.process.poll() is None for a in both)


def test_replacements_exhausted_end_every_agent_naming_the_failure(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=4, log_level="WARNING")
    both = two_replacing_agents(agents, coordinator.address, "--max-restarts", "0")
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    os.kill(int(first[1][3].group(3)), signal.SIGKILL)
    for agent in both:
        assert agent.wait() == core.EXIT_JOB_FAILED, agent.output()
        err = "\n".join(agent.err)
        assert "the job's restarts are exhausted (0 allowed)" in err, agent.output()
        assert re.search(r"attempt 0: process 3 on \S+ failed: ", err), agent.output()


def test_the_leading_replica_killed_right_after_deciding_a_replacement_still_replaces_once(etcd, agents):
    with Replicas(etcd, num_processes=4) as replicas:
        both = two_replacing_agents(agents, replicas.addresses, "--max-restarts", "2")
        first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
                 for a in both]
        deciding = replicas.leader
        os.kill(int(first[1][3].group(3)), signal.SIGKILL)
        deciding.wait_for_log("process 3 is replaced by its agent", timeout=WAIT_S)  # logged once committed
        replicas.kill_leader()  # SIGKILL by pid; returns once the standby serves
        poll_until(lambda: process_lines(both[1], 3), lambda ms: len(ms) == 2, timeout=WAIT_S,
                   what="process 3 started anew")
        channel = grpc.insecure_channel(replicas.leader.address)
        with channel:
            state = next(JobAgentsStub(channel).WatchJob(pb.WatchJobRequest(host="x", agent_uid="onlooker"),
                                                         timeout=10)).state
        assert (state.attempt, state.replacements, state.exhausted) == (0, 1, False)  # decided once, replayed
        assert "is replaced by its agent" not in replicas.leader.log, replicas.leader.log  # its successor decided none
    for pid in (0, 1, 2):
        assert len(process_lines(both[pid // 2], pid)) == 1  # never restarted
    assert len(process_lines(both[1], 3)) == 2  # replaced once
    assert "attempt 1" not in "\n".join(both[0].err + both[1].err)


def test_a_replacement_that_cannot_start_ends_every_agent_naming_each_failure(start_coordinator, agents, tmp_path):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=4, log_level="WARNING")
    command = tmp_path / "worker.sh"  # the workers' command, which process 3 deletes before it fails
    command.write_text(f"#!/bin/sh\nexec {sys.executable} {RUN_WORKER} vanish\n")
    command.chmod(0o755)
    env = loopback_env(coordinator.address, RUN_WORKER_VANISH=str(command))
    both = [agents("--nproc-per-host", "2", "--host-rank", str(h), "--num-hosts", "2", "--grace-seconds", "2",
                   "--recover", "replace", "--max-restarts", "1", "--", str(command), env=env) for h in range(2)]
    for agent in both:
        assert agent.wait() == core.EXIT_JOB_FAILED, agent.output()
        err = "\n".join(agent.err)
        assert "the job's restarts are exhausted (1 allowed)" in err, agent.output()
        assert re.search(r"attempt 0: process 3 on \S+ failed: exit code 3", err), agent.output()
        assert re.search(r"attempt 0: process 3 on \S+ failed: could not start: \[Errno 2\]", err), agent.output()


def test_a_caller_who_is_no_agent_cannot_make_the_job_replace_a_process(start_coordinator, agents):
    coordinator = start_coordinator(num_processes=4, log_level="WARNING")
    both = two_replacing_agents(agents, coordinator.address, "--max-restarts", "3")
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    channel = grpc.insecure_channel(coordinator.address)
    with channel:
        stub = JobAgentsStub(channel)
        for agent_uid in ("intruder", ""):
            request = pb.NextAttemptRequest(ended_attempt=0, request_id=secrets.token_hex(8), agent_uid=agent_uid,
                                            replace=True, failure=pb.AttemptFailure(attempt=0, process_id=3,
                                                                                    host="x", reason="made up"))
            with pytest.raises(grpc.RpcError) as info:
                stub.NextAttempt(request, timeout=10, metadata=[(SECRET_METADATA, secrets.token_hex(16))])
            assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED, info.value
        state = next(stub.WatchJob(pb.WatchJobRequest(host="x", agent_uid="onlooker"), timeout=10)).state
        assert (state.attempt, state.replacements, list(state.failures)) == (0, 0, [])
    time.sleep(0.5)  # a replacement would have started within this on a loopback job
    for agent, lines in zip(both, first, strict=True):
        now = {pid: m.group(3) for pid, m in started_lines(agent, 0).items()}
        assert agent.process.poll() is None and now == {pid: m.group(3) for pid, m in lines.items()}, agent.output()
