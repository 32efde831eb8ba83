"""``ifrt run``: the agent's decisions (pure), its workers (real processes), and whole jobs restarted in place against
a real coordinator: two hosts (network namespaces) of JAX workers, and agents on loopback with small workers (one
job with two coordinator replicas on a real etcd, whose leader is killed right after it decided a restart)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import JobAgentsStub
from ifrt.errors import EXIT_COORDINATOR_LOST
from ifrt.protocol import SECRET_METADATA
from ifrt.run import agent as core
from ifrt.run.agent import Agent
from ifrt.run.messages import (
    AskNextAttempt,
    Exit,
    Failure,
    JobUpdate,
    JobView,
    ProcessFailedSeen,
    Say,
    Start,
    Stop,
    Tick,
    WorkerExited,
)
from ifrt.run.workers import Worker, stop_all, worker_env
from ifrt.settings import resolve
from tests.helpers import BIN, poll_until, secret_file
from tests.netns import Hosts, skip_without_netns
from tests.replicas import Replicas
from tests.requirements import require
from tests.run_agents import (
    RUN_WORKER,
    WAIT_S,
    RunAgent,
    agents_started,
    kinds,
    loopback_env,
    own_hostname,
    started_lines,
)
from tests.tls import make_certs

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train_checkpoint.py"
HEARTBEAT_S = 1.0


# The decisions.

def started(nproc: int = 2, attempt: int = 0, ids: dict[int, int] | None = None) -> Agent:
    agent = Agent(nproc, "node-a", ids=dict(ids or {}))
    assert agent.handle(JobUpdate(JobView(attempt)), 0.0)[0] == Start(attempt)
    return agent


def test_a_worker_killed_stops_the_others_and_asks_for_the_next_attempt_naming_it():
    agent = started(ids={0: 2, 1: 3})
    actions = agent.handle(WorkerExited(0, 1, -signal.SIGKILL), 1.0)
    assert kinds(actions) == [Stop, AskNextAttempt]
    assert actions[-1] == AskNextAttempt(0, Failure(0, 3, "node-a", "killed by SIGKILL"))
    assert agent.handle(WorkerExited(0, 0, -signal.SIGTERM), 1.1) == []  # stopped by us: no news
    assert kinds(agent.handle(JobUpdate(JobView(1, (Failure(0, 3, "node-a", "killed by SIGKILL"),))), 2.0)) == [Start]


def test_a_worker_without_a_known_id_is_named_by_its_local_rank():
    actions = started().handle(WorkerExited(0, 1, 3), 1.0)
    assert actions[-1] == AskNextAttempt(0, Failure(0, core.UNKNOWN_PROCESS, "node-a", "local rank 1: exit code 3"))


def test_a_survivor_of_a_peer_failure_waits_for_the_coordinator_to_name_the_cause():
    agent = started()
    assert kinds(agent.handle(WorkerExited(0, 0, 75), 1.0)) == [Stop]
    cause = Failure(0, 5, "node-b", "lost its connection")
    assert agent.handle(ProcessFailedSeen(cause), 1.2)[-1] == AskNextAttempt(0, cause)
    assert agent.handle(ProcessFailedSeen(cause), 1.3) == []  # asked once


def test_a_survivor_reports_itself_when_no_cause_comes():
    agent = started(ids={0: 0, 1: 1})
    agent.handle(WorkerExited(0, 0, 75), 1.0)
    assert agent.handle(Tick(), 1.0 + core.CAUSE_WAIT_S / 2) == []
    actions = agent.handle(Tick(), 1.0 + core.CAUSE_WAIT_S)
    assert actions[-1] == AskNextAttempt(0, Failure(0, 0, "node-a", "exit code 75"))


def test_a_refused_report_waits_for_the_coordinators_own_and_asks_with_it():
    agent = started(ids={0: 0, 1: 1})
    assert kinds(agent.handle(WorkerExited(0, 1, 3), 1.0)) == [Stop, AskNextAttempt]
    said = agent.handle(core.AskRefused(0, "the coordinator refused this report: process 1 registered from ..."), 1.1)
    assert kinds(said) == [] and "waiting for the coordinator to declare the failure" in said[0].line
    declared = Failure(0, 1, "node-a", "lost its connection")
    assert agent.handle(ProcessFailedSeen(declared), 2.0)[-1] == AskNextAttempt(0, declared)


def test_a_new_attempt_decided_elsewhere_restarts_the_workers():
    agent = started()
    actions = agent.handle(JobUpdate(JobView(1)), 1.0)
    assert kinds(actions) == [Stop, Start] and actions[2] == Start(1)
    assert agent.handle(JobUpdate(JobView(1)), 1.1) == []  # the same attempt again (NextAttempt's answer)
    assert agent.handle(WorkerExited(0, 0, 3), 1.2) == []  # a worker of the ended attempt


def test_exhausted_restarts_end_the_agent_with_every_attempts_failure():
    agent = started()
    failures = (Failure(0, 1, "node-a", "exit code 3"), Failure(1, 1, "node-a", "exit code 3"))
    actions = agent.handle(JobUpdate(JobView(1, failures, exhausted=True)), 1.0)
    assert actions[0] == Stop() and actions[-1] == Exit(core.EXIT_JOB_FAILED)
    lines = [a.line for a in actions if isinstance(a, Say)]
    assert "attempt 0: process 1 on node-a failed: exit code 3" in lines
    assert "attempt 1: process 1 on node-a failed: exit code 3" in lines


def test_exhausted_restarts_count_the_failures_the_coordinator_no_longer_lists():
    failures = (Failure(40, 1, "node-a", "exit code 3"),)
    actions = started().handle(JobUpdate(JobView(40, failures, exhausted=True, max_restarts=40, earlier=40)), 1.0)
    lines = [a.line for a in actions if isinstance(a, Say)]
    assert lines[:3] == ["the job's restarts are exhausted (40 allowed); failures:",
                         "40 earlier attempts failed too (not listed)",
                         "attempt 40: process 1 on node-a failed: exit code 3"]


def test_the_agent_exits_0_once_every_worker_finished():
    agent = started()
    assert kinds(agent.handle(WorkerExited(0, 1, 0), 1.0)) == []
    assert agent.handle(WorkerExited(0, 0, 0), 1.0)[-1] == Exit(0)


def test_the_agents_status_after_a_signal_is_its_workers():
    agent = started()
    assert agent.handle(core.Interrupted(signal.SIGTERM), 1.0)[1:] == [Stop(signal.SIGTERM), Exit(None)]
    assert core.workers_status([0, -signal.SIGTERM]) == 128 + signal.SIGTERM
    assert core.workers_status([7, 0]) == 7
    assert core.workers_status([0, 0]) == 0


def test_workers_get_their_rank_the_attempt_and_ids_but_not_the_agents_launcher_variables():
    env = {"SLURM_JOB_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "PATH": "/bin",
           "IFRT_TOKEN": "secret"}
    settings = resolve("c1:8476,c2:8476", environ={})
    made = worker_env(env, settings, attempt=4, local_rank=1, nproc=2, host_rank=1, num_hosts=2,
                      token_file="/run/token", launcher_variables=("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID"))
    assert made == {"SLURM_NTASKS": "2", "PATH": "/bin", "IFRT_COORDINATOR": "c1:8476,c2:8476",
                    "IFRT_LOCAL_RANK": "1", "IFRT_LOCAL_WORLD_SIZE": "2", "IFRT_ATTEMPT": "4",
                    "IFRT_PROCESS_ID": "3", "IFRT_NUM_PROCESSES": "4", "IFRT_TOKEN_FILE": "/run/token"}
    assigned = worker_env({"IFRT_PROCESS_ID": "9"}, settings, attempt=0, local_rank=0, nproc=1, host_rank=None,
                          num_hosts=None, token_file=None)
    assert "IFRT_PROCESS_ID" not in assigned and "IFRT_NUM_PROCESSES" not in assigned


# The workers, real processes.

def sleeper(code: str) -> Worker:
    return Worker([sys.executable, "-c", f"import signal, time\n{code}\ntime.sleep(60)"], os.environ, attempt=0,
                  local_rank=0, label=None)


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period():
    worker = sleeper("signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True)")
    poll_until(lambda: os.path.exists(f"/proc/{worker.pid}") and _ignores_sigterm(worker.pid), what="SIG_IGN set")
    began = time.monotonic()
    assert stop_all([worker], grace_s=0.5) == [-signal.SIGKILL]
    assert 0.5 <= time.monotonic() - began < 10


def test_a_stopped_worker_is_killed_at_once_not_after_the_grace_period():
    worker = sleeper("")
    os.kill(worker.pid, signal.SIGSTOP)
    poll_until(worker.stopped, what="the worker stopped")
    began = time.monotonic()
    assert stop_all([worker], grace_s=30) == [-signal.SIGKILL]
    assert time.monotonic() - began < 10


def _ignores_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        ignored = next(line for line in f if line.startswith("SigIgn:")).split()[1]
    return bool(int(ignored, 16) & (1 << (signal.SIGTERM - 1)))


# Whole jobs against a real coordinator.

def two_agents(agents, address: str, scenario: str, *flags: str, env: dict[str, str] | None = None,
               hostnames: bool = False) -> list[RunAgent]:
    """Two agents on loopback as hosts 0 and 1 (explicit host ranks), two tests/run_worker.py workers each; with
    ``hostnames``, each with a host name of its own (``host-<rank>``: one agent per host, as an agent key binds)."""
    return [agents("--nproc-per-host", "2", "--host-rank", str(h), "--num-hosts", "2", "--grace-seconds", "2",
                   *flags, "--", sys.executable, str(RUN_WORKER), scenario, env=env or loopback_env(address),
                   wrapper=own_hostname(f"host-{h}") if hostnames else None)
            for h in range(2)]


def test_a_worker_failing_in_every_attempt_ends_every_agent_naming_it(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=4, log_level="WARNING")
    both = two_agents(agents, coordinator.address, "fail", "--max-restarts", "1")
    for agent in both:
        assert agent.wait() == core.EXIT_JOB_FAILED, agent.output()
    for agent in both:
        err = "\n".join(agent.err)
        assert "the job's restarts are exhausted" in err, agent.output()
        # process 1 (host 0, local rank 1) or 3 (host 1) failed first in each attempt; both named by id and reason
        assert re.search(r"attempt 0: process [13] on \S+ failed: exit code 3", err), agent.output()
        assert re.search(r"attempt 1: process [13] on \S+ failed: exit code 3", err), agent.output()


def test_prefixes_name_each_workers_process_and_sigterm_reaches_the_workers(start_coordinator, agents):
    coordinator = start_coordinator(num_processes=4, log_level="WARNING")
    both = two_agents(agents, coordinator.address, "loop")
    for host, agent in enumerate(both):
        lines = poll_until(lambda a=agent: started_lines(a, 0), lambda found: len(found) == 2, timeout=WAIT_S,
                           what="both workers started")
        assert sorted(lines) == [2 * host, 2 * host + 1]
        assert all(m.group(1) == m.group(2) for m in lines.values())  # "[3] started process 3 ..."
        # stderr is a pipe of its own: its line may arrive after the stdout lines
        poll_until(lambda a=agent: list(a.err), lambda err, h=host: any(
            re.fullmatch(rf"\[{2 * h}\] a line on stderr from local rank 0", line) for line in err), timeout=WAIT_S,
            what=f"local rank 0's stderr line behind its process id [{2 * host}]")
    both[0].process.send_signal(signal.SIGTERM)
    assert both[0].wait() == 7, both[0].output()  # the workers' own status: their SIGTERM handler exits 7
    assert sum("received SIGTERM" in line for line in both[0].out) == 2


def test_no_prefix_leaves_the_output_as_it_is(start_coordinator, agents):
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    agent = agents("--no-prefix", "--", sys.executable, str(RUN_WORKER), "finish",
                   env=loopback_env(coordinator.address))
    assert agent.wait() == 0, agent.output()
    assert agent.out[0].startswith("started process 0 attempt 0 pid ")
    assert "step 3" in agent.out


@pytest.mark.parametrize(("args", "message"), [
    ((), "no worker command given: expected `ifrt run [flags] -- COMMAND [ARGS...]`"),
    (("--", "no-such-program"), "the worker command 'no-such-program' is neither an executable file nor a program on "
                                "PATH: expected a program to run"),
    (("--nproc-per-host", "0", "--", sys.executable), "--nproc-per-host 0 is out of range: expected an integer >= 1"),
    (("--host-rank", "2", "--num-hosts", "2", "--", sys.executable),
     "--host-rank 2 is out of range: expected it below --num-hosts (2)"),
])
def test_bad_flags_or_a_missing_program_end_the_agent_at_once_naming_what_was_expected(free_port, args, message):
    # Nothing listens at the coordinator's address: an agent that got past its checks would wait for it.
    done = subprocess.run([str(BIN / "ifrt"), "run", *args], env=loopback_env(f"127.0.0.1:{free_port}"),
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == core.EXIT_USAGE and message in done.stderr, done.stderr


def test_an_unreachable_coordinator_ends_the_agent_after_the_failover_window_naming_it(agents, free_port):
    address = f"127.0.0.1:{free_port}"  # nothing listens there
    env = dict(loopback_env(address), IFRT_FAILOVER_WINDOW="2")
    began = time.monotonic()
    agent = agents("--", sys.executable, str(RUN_WORKER), "finish", env=env)
    assert agent.wait(timeout=WAIT_S) == EXIT_COORDINATOR_LOST, agent.output()
    assert time.monotonic() - began < 30, agent.output()  # the 2 s window and a backoff, not a hang
    err = "\n".join(agent.err)
    assert f"cannot reach the coordinator yet (coordinator {address}" in err, agent.output()
    assert f"no coordinator replica ({address}) answered for" in err and "(the failover window)" in err, err
    assert agent.out == [], agent.output()  # no worker was started


def test_a_stopped_worker_restarts_the_job_within_the_heartbeat_timeout(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=4, log_level="WARNING")
    both = two_agents(agents, coordinator.address, "loop", "--max-restarts", "1")
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    os.kill(int(first[1][3].group(3)), signal.SIGSTOP)
    stopped_at = time.monotonic()
    again = [poll_until(lambda a=a: started_lines(a, 1), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 1")
             for a in both]
    took = time.monotonic() - stopped_at
    assert took < HEARTBEAT_S + 20, took  # detection (the timeout) + stopping + a new discovery, loosely
    for before, after in zip(first, again, strict=True):
        assert sorted(before) == sorted(after)
        assert {m.group(4) for m in after.values()} == {m.group(4) for m in first[0].values()}  # same fingerprint
    assert "killed by SIGKILL" not in "\n".join(both[1].err)  # its own stop: not reported as the cause
    assert any("process 3" in line and "failed" in line for line in both[0].err), both[0].output()


def test_the_leading_replica_killed_right_after_deciding_a_restart_still_restarts_the_job_once(etcd, agents):
    with Replicas(etcd, num_processes=4) as replicas:
        both = two_agents(agents, replicas.addresses, "once", "--max-restarts", "2")
        first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
                 for a in both]
        deciding = replicas.leader
        os.kill(int(first[1][3].group(3)), signal.SIGKILL)
        deciding.wait_for_log("attempt 1 starts", timeout=WAIT_S)  # journaled: logged once committed
        replicas.kill_leader()  # SIGKILL by pid; returns once the standby serves
        for agent in both:
            assert agent.wait() == 0, agent.output()
        assert "attempt 0 of the job ended (process 3 on " in deciding.log, deciding.log
        assert "of the job ended" not in replicas.leader.log, replicas.leader.log  # its successor decided no more
    for before, agent in zip(first, both, strict=True):
        err = "\n".join(agent.err)
        assert sorted(started_lines(agent, 1)) == sorted(before), agent.output()  # every worker again, same ids
        assert started_lines(agent, 2) == {} and "attempt 2" not in err, agent.output()
        assert err.count("attempt 1 started with 2 workers") == 1, agent.output()
        assert "all 2 workers finished" in err, agent.output()


# Behind the token (and TLS), and who may end or restart the job.

TOKEN = "the cluster's token"


def secured(tmp_path: Path, certs: Path, tls: bool) -> tuple[tuple[str, ...], dict[str, str], Path]:
    """The coordinator's flags for a token (and TLS), the agents' extra environment, and the token file."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    key = secret_file(tmp_path / "agent-key")
    flags: tuple[str, ...] = ("--token-file", str(token_file), "--agent-key-file", str(key))
    env: dict[str, str] = {"IFRT_AGENT_KEY_FILE": str(key)}
    if tls:
        flags += ("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"))
        env["IFRT_TLS_CA"] = str(certs / "ca.pem")
    return flags, env, token_file


@pytest.mark.parametrize("tls", [False, True], ids=["token", "token+tls"])
def test_a_job_behind_the_token_and_tls_restarts_in_place_and_finishes(start_coordinator, agents, tmp_path, certs,
                                                                      tls):
    flags, extra, token_file = secured(tmp_path, certs, tls)
    coordinator = start_coordinator(*flags, num_processes=4, log_level="WARNING")
    env = loopback_env(coordinator.address, **extra)
    both = two_agents(agents, coordinator.address, "once", "--max-restarts", "1", "--token-file", str(token_file),
                      env=env, hostnames=True)
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    os.kill(int(first[1][3].group(3)), signal.SIGKILL)  # WatchJob (unary-stream) and NextAttempt carry the token
    for agent in both:
        assert agent.wait() == 0, agent.output()
        assert sorted(started_lines(agent, 1)) == sorted(started_lines(agent, 0)), agent.output()
    assert "the call carries no token" not in "\n".join(both[0].err + both[1].err)


def job_stub(address: str) -> tuple[JobAgentsStub, grpc.Channel]:
    channel = grpc.insecure_channel(address)
    return JobAgentsStub(channel), channel


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


@pytest.fixture(scope="module")
def running_job() -> Iterator[tuple[LocalCoordinator, list[RunAgent]]]:
    """Two real agents of 2 looping workers each, in attempt 0: the job the attacks below are made on, one for the
    module (each attack is refused, and each test checks the job ran on untouched after it); stopped at the end."""
    # Without a token every caller is as a token holder: the job's authority is what stops it, not the token.
    with LocalCoordinator(num_processes=4, log_level="DEBUG") as coordinator:
        starting = agents_started()
        both = two_agents(next(starting), coordinator.address, "loop", "--max-restarts", "3")
        try:
            for a in both:
                poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
            yield coordinator, both
            both[0].process.send_signal(signal.SIGTERM)
            assert both[0].wait() == 7, both[0].output()
        finally:
            next(starting, None)  # stops every agent still running


@contextlib.contextmanager
def a_running_job(running_job):
    """The module's running job, with a raw JobAgents stub for the attacker; on exit, checks that the job ran on
    untouched (no agent exited, no restart, nothing exhausted)."""
    coordinator, both = running_job
    job, channel = job_stub(coordinator.address)
    with channel:
        yield coordinator, job
        state = next(job.WatchJob(pb.WatchJobRequest(host="elsewhere", agent_uid="onlooker"), timeout=10)).state
        assert (state.attempt, state.exhausted, list(state.failures), state.max_restarts) == (0, False, [], 3)
    time.sleep(1.0)  # on main both agents had exited 1 within 0.6 s of an attack
    for agent in both:
        assert agent.process.poll() is None, agent.output()
        assert "attempt 1" not in "\n".join(agent.err) and "exhausted" not in "\n".join(agent.err), agent.output()


def attack_next_attempt(job: JobAgentsStub, max_restarts: int | None, agent_uid: str = "") -> grpc.RpcError:
    """NextAttempt(ended_attempt=0) naming process 1 from a caller with a secret of its own; the refusal."""
    who = {"agent_uid": agent_uid} if agent_uid else {}
    request = pb.NextAttemptRequest(ended_attempt=0, max_restarts=max_restarts, request_id=secrets.token_hex(8),
                                    failure=pb.AttemptFailure(attempt=0, process_id=1, host="elsewhere",
                                                              reason="made up"), **who)
    return refused(lambda: job.NextAttempt(request, timeout=10, metadata=[(SECRET_METADATA, secrets.token_hex(16))]))


def test_a_caller_who_is_no_agent_cannot_end_the_job_for_good(running_job):
    with a_running_job(running_job) as (_, job):
        ending = attack_next_attempt(job, 0)  # on main: both agents stopped their workers and exited 1
        assert ending.code() is grpc.StatusCode.PERMISSION_DENIED, ending
        assert "is no agent of this job" in ending.details()
        joining = refused(lambda: next(job.WatchJob(pb.WatchJobRequest(
            host="elsewhere", agent_uid="intruder", workers=1, max_restarts=0), timeout=10,
            metadata=[(SECRET_METADATA, "intruder")])))
        assert joining.code() is grpc.StatusCode.FAILED_PRECONDITION, joining  # nor become one of its agents
        assert "this agent expects --max-restarts 0, but the job's restart budget is 3" in joining.details()


def test_a_caller_who_is_no_agent_cannot_restart_the_job_at_will(running_job):
    with a_running_job(running_job) as (_, job):
        for _ in range(20):  # on main: 20 restarts, each wiping every registration, key and barrier
            assert attack_next_attempt(job, 10**6).code() is grpc.StatusCode.PERMISSION_DENIED
        joining = refused(lambda: next(job.WatchJob(pb.WatchJobRequest(
            host="elsewhere", agent_uid="intruder", workers=1), timeout=10,
            metadata=[(SECRET_METADATA, "intruder")])))
        assert joining.code() is grpc.StatusCode.FAILED_PRECONDITION, joining  # the job's agents cover its 4
        assert "would exceed the job's 4 processes: it is no agent of this job" in joining.details()


def test_a_caller_cannot_act_for_an_agent_of_the_job(running_job):
    with a_running_job(running_job) as (coordinator, job):
        real_uid = re.search(r"the agent '?(\w+)'? on ", coordinator.log).group(1)  # what an attacker may learn
        acting = attack_next_attempt(job, None, agent_uid=real_uid)  # on main: attempt 1 started
        assert acting.code() is grpc.StatusCode.PERMISSION_DENIED, acting
        assert "does not carry its secret" in acting.details()


def test_an_exhausted_job_stays_exhausted_for_that_job_only(start_coordinator, agents):
    coordinator = start_coordinator(num_processes=4, log_level="WARNING")
    for agent in two_agents(agents, coordinator.address, "fail"):  # no restart allowed: the first failure ends it
        assert agent.wait() == core.EXIT_JOB_FAILED, agent.output()
    began = time.monotonic()
    again = two_agents(agents, coordinator.address, "finish")  # the next run of the job, on the same journal
    for agent in again:
        assert agent.wait() == 0, agent.output()
        assert sorted(started_lines(agent, 1)) in ([0, 1], [2, 3]), agent.output()
    assert time.monotonic() - began > 0.6
    assert "a new run of the job starts as attempt 1 (the last run's restarts were exhausted" in coordinator.log


def test_an_agent_that_states_another_budget_than_the_jobs_is_refused_naming_both(start_coordinator, agents):
    coordinator = start_coordinator("--max-restarts", "1", num_processes=1, log_level="WARNING")
    env = loopback_env(coordinator.address)
    other = agents("--max-restarts", "5", "--", sys.executable, str(RUN_WORKER), "finish", env=env)
    assert other.wait() == core.EXIT_USAGE, other.output()
    assert ("this agent expects --max-restarts 5, but the job's restart budget is 1 (the coordinator's "
            "--max-restarts)") in "\n".join(other.err), other.output()
    assert other.out == [], other.output()  # no worker was started
    taking = agents("--", sys.executable, str(RUN_WORKER), "finish", env=env)
    assert taking.wait() == 0, taking.output()


def jax_env(address: str) -> dict[str, str]:
    env = loopback_env(address)
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return env


@contextlib.contextmanager
def own_hostname_addresses(hosts: Hosts, count: int = 2):
    """In each test host, this machine's hostname (and ``host-<i>``, its own name where it has one: ``own_hostname``)
    resolves to the host's own address, as on separate machines (JAX's gloo listens where the hostname resolves): ``ip
    netns exec`` puts /etc/netns/<namespace>/hosts over /etc/hosts."""
    made = [Path("/etc/netns", name) for name in hosts.names[:count]]
    try:
        for i, directory in enumerate(made, start=1):
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text(f"127.0.0.1 localhost\n{hosts.address(i)} {socket.gethostname()} "
                                             f"host-{i}\n")
        yield
    finally:
        for directory in made:
            shutil.rmtree(directory, ignore_errors=True)


STEPS = 12
KILLED_AT = 5


def test_a_killed_jax_worker_restarts_the_whole_job_in_place_from_checkpoints(tmp_path, agents):
    if importlib.util.find_spec("jax") is None:
        require("jax", "pip install 'ifrt-topology[jax]' (scripts/test.sh installs it)")
    skip_without_netns()
    with Hosts(2) as hosts, own_hostname_addresses(hosts):
        (tmp_path / "certs").mkdir()
        certs = make_certs(tmp_path / "certs", ips=(hosts.address(1),))  # behind the token and TLS, as in a cluster
        flags, extra, token_file = secured(tmp_path / "certs", certs, tls=True)
        coordinator = LocalCoordinator("--heartbeat-timeout", str(HEARTBEAT_S), *flags, num_processes=4,
                                       bind=f"{hosts.address(1)}:8476", wrapper=hosts.command(1, []),
                                       log_level="WARNING")
        try:
            env = {**jax_env(coordinator.address), **extra}
            both = [agents("--nproc-per-host", "2", "--max-restarts", "2", "--grace-seconds", "2",
                           "--token-file", str(token_file), "--",
                           sys.executable, str(TRAIN), "--runtime", "jax", "--checkpoint-dir", str(tmp_path),
                           "--steps", str(STEPS), "--step-seconds", "0.2", env=env,
                           wrapper=hosts.command(h, own_hostname(f"host-{h}")))  # one agent per host name
                    for h in (1, 2)]
            victim = both[1].wait_line(rf"^\[(\d+)\] step {KILLED_AT} process (\d+) attempt 0 pid (\d+)")
            os.kill(int(victim.group(3)), signal.SIGKILL)
            for agent in both:
                assert agent.wait(timeout=120) == 0, agent.output()
        finally:
            coordinator.close()
    runs = {attempt: {} for attempt in (0, 1)}
    for agent in both:
        for line in agent.out:
            m = re.search(r"step (\d+) process (\d+) attempt (\d+) pid \d+ fingerprint (\w+)", line)
            if m:
                runs[int(m.group(3))].setdefault(int(m.group(2)), []).append((int(m.group(1)), m.group(4)))
    assert sorted(runs[0]) == sorted(runs[1]) == [0, 1, 2, 3]  # every process again, with the same ids
    assert len({fp for steps in (*runs[0].values(), *runs[1].values()) for _, fp in steps}) == 1
    for process_id, steps in runs[1].items():
        first = steps[0][0]
        assert KILLED_AT <= first <= KILLED_AT + 3, (process_id, steps)  # resumed from its checkpoint, not step 1
        assert steps[-1][0] == STEPS
    victim_id = int(victim.group(2))
    err = "\n".join(both[1].err)
    # Named by its agent, by id: as its own worker's exit ("worker 1 (process 3) failed: ..."), or as the failure the
    # coordinator reported ("attempt 0: process 3 on host-2 failed: ..."), when its other worker's fail-fast exit (a
    # failure elsewhere) reached the agent first
    assert re.search(rf"process {victim_id}(\)| on \S+) failed: killed by SIGKILL", err), err
