"""``ifrt run --recover replace --spare N``: warm spares, started and imported, waiting inside ifrt until their agent
hands one a failed worker's process id; the coordinator refuses a replacement (a spare's or a cold one's) whose devices
differ from the process it replaces. The agent's decisions (pure), the coordinator's (pure), the spare's hand-off,
and real agents, spares and a coordinator on loopback."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys

import pytest

from coordinator.core.registration import Registration
from ifrt.errors import ClusterMismatch, InvalidArgument
from ifrt.run import agent as core
from ifrt.run.agent import Agent, Recover
from ifrt.run.messages import (
    AskReplace,
    Failure,
    JobUpdate,
    JobView,
    ReplaceAnswered,
    ReplaceSeen,
    Start,
    StartWorker,
    Tick,
    WorkerExited,
)
from ifrt.run.spares import (
    SPARE_DEATHS_MOST,
    SPARE_START_DELAY_S,
    HandOff,
    HandOffFailed,
    SpareExited,
    SparePool,
    StartSpare,
)
from ifrt.spare import HANDED, SPARE_ENV, await_hand_off, hand_off_line
from tests.helpers import BIN, lose_session, poll_until, published, reg
from tests.run_agents import RUN_WORKER, WAIT_S, kinds, loopback_env, started_lines

HEARTBEAT_S = 1.0


# The agent's decisions.

def replaced(agent: Agent, rank: int, now: float) -> list:
    """The actions of a decided replacement of local rank ``rank``'s worker (process 2 + rank)."""
    assert kinds(agent.handle(WorkerExited(0, rank, -9, agent.workers[rank].incarnation), now)) == [AskReplace]
    assert agent.handle(ReplaceAnswered(0, rank, JobView(0, replacements=1)), now) == []
    return agent.handle(ReplaceSeen(Failure(0, 2 + rank, "node-a", "killed by SIGKILL")), now)


def test_the_spares_start_after_the_workers_and_a_decided_replacement_goes_to_an_idle_one():
    agent = Agent(2, "node-a", ids={0: 2, 1: 3}, recover=Recover.REPLACE, spares=SparePool(1))
    assert kinds(agent.handle(JobUpdate(JobView(0)), 0.0)) == [Start, StartSpare]
    assert kinds(replaced(agent, 1, 1.0)) == [HandOff]
    assert agent.workers[1].incarnation == 1 and agent.spares.idle == []
    assert agent.handle(Tick(), 1.1) == []  # the next spare is due later, not while the recovery runs
    assert agent.handle(Tick(), 1.1 + SPARE_START_DELAY_S) == [StartSpare(1)]
    assert agent.spares.idle == [1]


def test_a_replacement_with_no_idle_spare_starts_cold():
    agent = Agent(2, "node-a", ids={0: 2, 1: 3}, recover=Recover.REPLACE, spares=SparePool(1))
    agent.handle(JobUpdate(JobView(0)), 0.0)
    assert replaced(agent, 1, 1.0)[-1] == HandOff(0, 0, 1, 1)
    assert replaced(agent, 0, 1.2)[-1] == StartWorker(0, 0, 1)  # the spare is used, the next not started yet


def test_a_spare_that_dies_idle_is_started_again_and_fails_nothing():
    agent = Agent(2, "node-a", ids={0: 2, 1: 3}, recover=Recover.REPLACE, spares=SparePool(1))
    agent.handle(JobUpdate(JobView(0)), 0.0)
    actions = agent.handle(SpareExited(0, -9), 1.0)
    assert kinds(actions) == [] and "spare 0 exited while idle (killed by SIGKILL)" in actions[0].line
    assert agent.phase is core.Phase.RUNNING and all(w.running for w in agent.workers.values())
    assert agent.handle(Tick(), 1.0 + SPARE_START_DELAY_S) == [StartSpare(1)]
    assert agent.handle(SpareExited(0, -9), 4.0) == []  # told twice: nothing more
    for n in range(1, SPARE_DEATHS_MOST + 1):  # a program that cannot wait as a spare: bounded, then cold starts
        agent.handle(SpareExited(n, 1), 10.0 * n)
        agent.handle(Tick(), 10.0 * n + SPARE_START_DELAY_S)
    assert agent.spares.idle == [] and agent.handle(Tick(), 1000.0) == []
    assert replaced(agent, 1, 1001.0)[-1] == StartWorker(0, 1, 1)


def test_a_hand_off_to_a_spare_that_exited_meanwhile_starts_the_replacement_cold():
    agent = Agent(2, "node-a", ids={0: 2, 1: 3}, recover=Recover.REPLACE, spares=SparePool(1))
    agent.handle(JobUpdate(JobView(0)), 0.0)
    assert replaced(agent, 1, 1.0)[-1] == HandOff(0, 0, 1, 1)
    actions = agent.handle(HandOffFailed(0, 0, 1, 1, "it exited with -9"), 1.1)
    assert actions[-1] == StartWorker(0, 1, 1) and "spare 0 could not take process 3" in actions[0].line
    assert agent.handle(SpareExited(0, -9), 1.2) == []  # its exit is no idle spare's


# The spare's wait.

def test_a_spare_waits_for_its_hand_off_then_takes_only_the_ranks_variables():
    env = {SPARE_ENV: "1", "IFRT_COORDINATOR": "127.0.0.1:1"}
    line = hand_off_line({"IFRT_LOCAL_RANK": "1", "IFRT_PROCESS_ID": "3", "IFRT_ATTEMPT": "0"})
    assert await_hand_off(env, io.StringIO(line.decode())) is True
    assert env == {"IFRT_COORDINATOR": "127.0.0.1:1", "IFRT_LOCAL_RANK": "1", "IFRT_PROCESS_ID": "3",
                   "IFRT_ATTEMPT": "0"}
    assert await_hand_off(env, io.StringIO("")) is False  # no spare (any more): nothing to wait for
    with pytest.raises(InvalidArgument, match="sets IFRT_COORDINATOR: expected only IFRT_LOCAL_RANK"):
        await_hand_off({SPARE_ENV: "1"}, io.StringIO('{"IFRT_COORDINATOR": "evil:1"}\n'))
    with pytest.raises(InvalidArgument, match="not JSON"):
        await_hand_off({SPARE_ENV: "1"}, io.StringIO("{3\n"))
    with pytest.raises(SystemExit) as released:  # its agent closed stdin: not needed, it ends quietly
        await_hand_off({SPARE_ENV: "1"}, io.StringIO(""))
    assert released.value.code == 0
    assert set(HANDED) == {"IFRT_LOCAL_RANK", "IFRT_PROCESS_ID", "IFRT_TRANSFER_BIND", "IFRT_ATTEMPT"}


# The coordinator's decisions.

def test_a_decided_replacement_with_other_devices_is_refused_naming_both_and_changing_nothing():
    from coordinator.core.job_records import Agent as JobAgent
    from coordinator.core.job_records import AttemptFailure, NextAttempt
    from ifrt.protocol import proof_of

    proof = proof_of("the secret of the agent on h1")
    s = published(n=2)
    s.join_agent(JobAgent("agent-h1", "h1", "10.0.0.1", proof, 1), 2)
    s.next_attempt(NextAttempt(0, AttemptFailure(0, 1, "h1", "killed by SIGKILL"), None, "r1", "agent-h1",
                               replace=True), proof)
    s.take_journal()
    odd: Registration = reg("spare", 1, host="h1", devices=3)
    with pytest.raises(ClusterMismatch) as refused:
        s.register(odd, 1.0)
    assert "3 devices: 3 x 'cpu'/'cpu', expected 2 devices: 2 x 'cpu'/'cpu'" in str(refused.value)
    assert s.take_journal() == [] and s.attempts.replacing == {1}  # nothing changed
    outcome, _ = s.register(reg("cold", 1, host="h1", devices=2), 1.1)  # the right devices: taken over
    assert s.attempts.replacing == set() and s.current.admission.member_of(1).registration.client_uid == "cold"
    assert outcome is not None


def test_a_plain_restart_with_other_devices_is_not_checked():
    s = published(n=2)
    lose_session(s, 1)
    s.register(reg("restarted", 1, host="h1", devices=3), 5.0)  # no replacement decided: a new generation, as today
    assert s.current.admission.member_of(1).registration.client_uid == "restarted"
    assert s.topology is not None and s.topology.generation == 2 and len(s.topology.devices) == 5


# Real agents, spares and workers.

def agents_with_spares(agents, address: str, scenario: str, *flags: str):
    return [agents("--nproc-per-host", "2", "--host-rank", str(h), "--num-hosts", "2", "--grace-seconds", "2",
                   "--recover", "replace", "--spare", "1", *flags, "--", sys.executable, str(RUN_WORKER), scenario,
                   env=loopback_env(address)) for h in range(2)]


def spare_pid(agent, serial: int) -> int:
    match = poll_until(lambda: [m for line in agent.err if (m := re.search(rf"spare {serial} started \(pid (\d+)\)",
                                                                            line))],
                       bool, timeout=WAIT_S, what=f"spare {serial} started")
    return int(match[0].group(1))


def test_a_killed_worker_is_replaced_by_the_warm_spare_with_no_start(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=4, log_level="WARNING")
    both = agents_with_spares(agents, coordinator.address, "loop", "--max-restarts", "1")
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    spare = spare_pid(both[1], 0)  # started (and its program imported) before the kill
    os.kill(int(first[1][3].group(3)), signal.SIGKILL)
    again = poll_until(lambda: [m for line in both[1].out
                                if (m := re.search(r"^\[3\] started process 3 attempt 0 pid (\d+)", line))],
                       lambda ms: len(ms) == 2, timeout=WAIT_S, what="process 3 started anew")
    assert int(again[1].group(1)) == spare, both[1].output()  # the spare's process took the id: no start, no import
    for pid in (0, 1, 2):  # the survivors were never restarted
        lines = [line for line in both[pid // 2].out if line.startswith(f"[{pid}] started process {pid} ")]
        assert len(lines) == 1 and f" pid {first[pid // 2][pid].group(3)} " in lines[0], both[pid // 2].output()
    err = "\n".join(both[1].err)
    assert "handing process 3 (local rank 1) to spare 0" in err, both[1].output()
    following = spare_pid(both[1], 1)  # the next spare, started after the hand-off
    assert following != spare and all(a.process.poll() is None for a in both)
    failures = [sum("failed" in line for line in a.err) for a in both]
    os.kill(following, signal.SIGKILL)  # a spare that dies idle is started again, and fails nothing
    poll_until(lambda: [line for line in both[1].err if "spare 1 exited while idle (killed by SIGKILL); another "
                        "starts in" in line], bool, timeout=WAIT_S, what="the idle spare's death noticed")
    assert all(a.process.poll() is None for a in both)
    assert [sum("failed" in line for line in a.err) for a in both] == failures, both[1].output()


def test_a_spare_with_other_devices_is_refused_naming_both_and_the_replacement_counts_as_failed(start_coordinator,
                                                                                               agents):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=4, log_level="WARNING")
    both = agents_with_spares(agents, coordinator.address, "odd-spare", "--max-restarts", "1")
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    spare_pid(both[1], 0)
    idle = spare_pid(both[0], 0)  # never used
    os.kill(int(first[1][3].group(3)), signal.SIGKILL)
    for agent in both:
        assert agent.wait() == core.EXIT_JOB_FAILED, agent.output()
    assert not os.path.exists(f"/proc/{idle}")  # stopped (and reaped) with the workers
    err = "\n".join(both[1].err)
    assert re.search(r"the replacement of process 3 from .* has other devices than the process it replaces: "
                     r"2 devices: 2 x 'cpu'/'cpu', expected 1 device: 1 x 'cpu'/'cpu'", err), both[1].output()
    assert "the job's restarts are exhausted (1 allowed)" in err, both[1].output()


def test_spare_without_recover_replace_is_a_usage_error():
    result = subprocess.run([str(BIN / "ifrt"), "run", "--spare", "1", "--", sys.executable, "-c", "pass"],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if not k.startswith("IFRT_")})
    assert result.returncode == core.EXIT_USAGE
    assert "--spare 1 needs --recover replace" in result.stderr
