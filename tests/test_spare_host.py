"""A lost host: a spare host (``ifrt run --spare-host``) takes over every process id of a host whose agent is gone
with its workers, decided once by the coordinator (journaled, within the restart budget, only to a spare host, only
for a lost host); without one, the survivors' agents wait, naming the host, up to ``--replace-timeout``, then the job
ends as without replace. The decisions (pure), then real agents in network namespaces as hosts."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from coordinator.core import journal
from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import Published
from coordinator.core.job_records import Agent as JobAgent
from coordinator.core.job_records import AttemptProcessFailed, AttemptsExhausted, HostTakenOver
from coordinator.core.state import ClusterState
from coordinator.local import LocalCoordinator
from ifrt.errors import ClusterMismatch, PermissionDenied, ResourceExhausted
from ifrt.protocol import proof_of
from ifrt.run import agent as core
from ifrt.run import waits
from ifrt.run.agent import Agent, Recover
from ifrt.run.messages import (
    AskNextAttempt,
    AskShrink,
    Exit,
    Failure,
    HostTakenOverSeen,
    Interrupted,
    JobUpdate,
    JobView,
    Kill,
    ProcessFailedSeen,
    Say,
    ShrinkAnswered,
    Start,
    StartIds,
    Stop,
    Tick,
)
from tests.helpers import TIMEOUT, reg
from tests.netns import Hosts, as_host, skip_without_hosts
from tests.requirements import require
from tests.run_agents import RUN_WORKER, WAIT_S, loopback_env

TAKEOVER_WORKER = Path(__file__).with_name("takeover_worker.py")
HEARTBEAT_S = 1.0

# The coordinator's decisions: hosts ha (processes 0, 1) and hb (2, 3), ids assigned; a spare host hc.

A = JobAgent("agent-a", "ha", "10.0.0.1", proof_of("a"), 2)
B = JobAgent("agent-b", "hb", "10.0.0.2", proof_of("b"), 2)
C = JobAgent("agent-c", "hc", "10.0.0.3", proof_of("c"), 2, spare=True)
D = JobAgent("agent-d", "hd", "10.0.0.4", proof_of("d"), 2, spare=True)


def job(max_restarts: int = 2, spares: tuple[JobAgent, ...] = (C,), explicit: bool = False) -> ClusterState:
    s = ClusterState(ClusterConfig(num_processes=4, heartbeat_timeout_s=TIMEOUT))
    for agent in (A, B, *spares):
        s.join_agent(agent, max_restarts, recover="replace")
    workers = (("a0", "ha", "10.0.0.1", 0), ("a1", "ha", "10.0.0.1", 1), ("b0", "hb", "10.0.0.2", 0),
               ("b1", "hb", "10.0.0.2", 1))
    for pid, (uid, host, ip, rank) in enumerate(workers):
        s.register(reg(uid, pid if explicit else None, host=host, ip=ip, rank=rank), 0.0)
    for uid, *_ in workers:
        s.current.attach(uid, 0.0)
    assert s.topology is not None and [p.hostname for p in s.topology.processes] == ["ha", "ha", "hb", "hb"]
    return s


def lose_host_b(s: ClusterState) -> None:
    """Host hb's workers lose their sessions and are declared failed."""
    for uid in ("b0", "b1"):
        s.current.detach(uid, 0.0)
    s.tick(10 * TIMEOUT)
    assert set(s.attempts.declared) == {2, 3}


def test_a_lost_hosts_ids_go_to_a_spare_host_once_and_only_its_workers_take_them():
    s = job()
    lose_host_b(s)
    s.take_journal()
    effects = s.take_over_host(frozenset({B.uid}))
    assert [type(e) for e in effects] == [HostTakenOver]
    taken = effects[0]
    assert (taken.agent_uid, taken.host, taken.process_ids, taken.view.replacements) == (C.uid, "hc", (2, 3), 1)
    entries = s.take_journal()
    assert [type(e) for e in entries] == [journal.HostTakenOver]
    assert journal.decode(journal.encode(entries[0])) == entries[0]
    assert s.take_over_host(frozenset({B.uid})) == [] and s.take_journal() == []  # decided once
    listed = {a.uid: a for a in s.attempts.listed()}
    assert B.uid not in listed and listed[C.uid] == replace(C, spare=False, workers=2)  # an ordinary agent now
    with pytest.raises(PermissionDenied, match="handed to the spare host hc"):  # nobody else takes the ids
        s.register(reg("intruder", 2, host="ha", ip="10.0.0.1"), 1.0)
    with pytest.raises(ClusterMismatch, match="is not one of them"):  # nor the lost host's old claim
        s.register(reg("b0-again", host="hb", ip="10.0.0.2", rank=0), 1.0)
    s.register(reg("c0", 2, host="hc", ip="10.0.0.3", rank=0), 1.0)
    outcome, _ = s.register(reg("c1", 3, host="hc", ip="10.0.0.3", rank=1), 1.0)
    assert isinstance(outcome, Published) and outcome.process_id == 3
    assert [p.hostname for p in outcome.topology.processes] == ["ha", "ha", "hc", "hc"]
    assert outcome.topology.generation == 2
    replayed = ClusterState(ClusterConfig(num_processes=4, heartbeat_timeout_s=TIMEOUT))
    source = job()
    lose_host_b(source)
    everything = [*source.take_journal(), *entries]
    for entry in everything:
        replayed.replay(entry)
    assert replayed.attempts.view() == s.attempts.view() and replayed.attempts.declared == {}
    assert replayed.take_over_host(frozenset({B.uid})) == []  # a failover decides nothing twice


def test_a_lost_hosts_process_still_on_the_clock_is_failed_by_the_takeover_not_after_it():
    """b1's connection ended later than b0's: the host is lost (b0 declared failed, its agent gone) while b1 is still
    within its grace. Declared after the takeover, b1's failure would name id 3, which the spare host's new worker
    holds by then: its agent would kill that worker as failed and spend the budget on it."""
    s = job(max_restarts=1)
    s.current.detach("b0", 0.0)
    s.tick(10 * TIMEOUT)
    s.current.detach("b1", 10 * TIMEOUT)
    assert set(s.attempts.declared) == {2}
    s.take_journal()
    effects = s.take_over_host(frozenset({B.uid}))
    failed = [e.failure for e in effects if isinstance(e, AttemptProcessFailed)]
    assert [(f.process_id, f.host) for f in failed] == [(3, "hb")] and "spare host hc" in failed[0].reason
    assert isinstance(effects[-1], HostTakenOver) and s.attempts.declared == {}
    entries = s.take_journal()
    assert [type(e) for e in entries] == [journal.Failed, journal.HostTakenOver]  # as a replay hears them
    replayed, source = ClusterState(ClusterConfig(num_processes=4, heartbeat_timeout_s=TIMEOUT)), job(max_restarts=1)
    source.current.detach("b0", 0.0)
    source.tick(10 * TIMEOUT)
    for entry in [*source.take_journal(), *entries]:
        replayed.replay(entry)
    assert replayed.attempts.view() == s.attempts.view() and replayed.attempts.declared == {}
    later = s.tick(100 * TIMEOUT)
    assert not [e for e in later if isinstance(e, AttemptProcessFailed)] and s.attempts.declared == {}
    s.register(reg("c0", 2, host="hc", ip="10.0.0.3", rank=0), 100 * TIMEOUT)
    outcome, _ = s.register(reg("c1", 3, host="hc", ip="10.0.0.3", rank=1), 100 * TIMEOUT)
    assert isinstance(outcome, Published) and not s.attempts.view().exhausted


def test_in_a_job_that_names_its_ids_the_spare_hosts_workers_name_them_in_later_attempts_too():
    s = job(explicit=True)
    lose_host_b(s)
    [taken] = s.take_over_host(frozenset({B.uid}))
    assert (taken.process_ids, taken.explicit_ids) == ((2, 3), True)
    with pytest.raises(PermissionDenied, match="handed to the spare host hc"):  # not even from the lost host
        s.register(reg("b0-again", 2, host="hb", ip="10.0.0.2"), 1.0)
    s.register(reg("c0", 2, host="hc", ip="10.0.0.3", rank=0), 1.0)


def test_nothing_is_taken_over_but_a_lost_host_and_only_by_a_spare_host():
    s = job()
    assert s.take_over_host(frozenset({B.uid})) == []  # its agent gone, but no process of it failed
    lose_host_b(s)
    assert s.take_over_host(frozenset()) == []  # its processes failed, but its agent watches: it replaces them
    assert s.take_over_host(frozenset({B.uid, C.uid})) == []  # the spare host is gone too
    assert [h.process_ids for h in s.lost_hosts(frozenset({B.uid}))] == [(2, 3)]  # what the log names while waiting
    alone = job(spares=())
    lose_host_b(alone)
    assert alone.take_over_host(frozenset({B.uid})) == [] and alone.take_journal()[-1].__class__ is journal.Failed
    small = job(spares=(replace(C, workers=1),))  # cannot run both of hb's ids
    lose_host_b(small)
    assert small.take_over_host(frozenset({B.uid})) == []


def test_a_lost_hosts_agent_that_comes_back_takes_its_place_and_ends_the_wait():
    s = job(spares=())
    lose_host_b(s)
    again = replace(B, uid="agent-b-again", secret_hash=proof_of("b again"))
    effects = s.join_agent(again, 2, frozenset({B.uid}), recover="replace")
    assert [(type(e), e.agent_uid, e.host, e.process_ids) for e in effects] == [(HostTakenOver, again.uid, "hb", ())]
    assert s.lost_hosts(frozenset({B.uid})) == []  # nobody waits for hb any more: its workers take their ids back


def test_a_second_spare_host_stays_spare():
    s = job(spares=(C, D))
    lose_host_b(s)
    assert s.take_over_host(frozenset({B.uid}))[0].agent_uid == C.uid
    assert {a.uid: a.spare for a in s.attempts.listed()} == {A.uid: False, C.uid: False, D.uid: True}


def test_a_takeover_counts_against_the_restart_budget():
    s = job(max_restarts=0)
    lose_host_b(s)
    effects = s.take_over_host(frozenset({B.uid}))
    assert [type(e) for e in effects] == [AttemptsExhausted] and effects[0].view.exhausted
    assert "spare host hc" in effects[0].view.failures[-1].reason
    with pytest.raises(ClusterMismatch, match="this cluster assigns process ids"):  # nothing was handed over
        s.register(reg("c0", 2, host="hc", ip="10.0.0.3"), 1.0)


def test_spare_hosts_count_against_no_process_but_against_max_agents():
    s = job(spares=())
    s.join_agent(C, 2, recover="replace")  # the job's 4 processes are covered by ha and hb already
    few = ClusterState(ClusterConfig(num_processes=4, heartbeat_timeout_s=TIMEOUT,
                                     limits=replace(ClusterConfig(num_processes=4).limits, agents=1)))
    few.join_agent(C, 2, recover="replace")
    with pytest.raises(ResourceExhausted, match="1 spare hosts watch the job: expected at most 1"):
        few.join_agent(D, 2, recover="replace")
    few.join_agent(D, 2, frozenset({C.uid}), recover="replace")  # in the place of a spare host that is gone
    assert [a.uid for a in few.attempts.listed()] == [D.uid]


def test_an_agent_with_another_recover_mode_than_the_jobs_is_refused_naming_both():
    s = ClusterState(ClusterConfig(num_processes=4, heartbeat_timeout_s=TIMEOUT))
    s.join_agent(A, 2, recover="replace")
    with pytest.raises(ClusterMismatch, match=r"--recover restart, but the job's agents run with --recover replace "
                                              r"\(stated by the agent on 'ha'\)"):
        s.join_agent(B, 2, recover="restart")
    assert [a.uid for a in s.attempts.listed()] == [A.uid]
    s.join_agent(B, 2, recover="replace")


# The agent's decisions.

def test_a_spare_host_runs_nothing_until_a_lost_hosts_ids_are_handed_to_it():
    agent = Agent(2, "hc", recover=Recover.REPLACE, spare=True)
    assert [type(a) for a in agent.handle(JobUpdate(JobView(0)), 0.0)] == [Say]
    lost = Failure(0, 2, "hb", "host hb lost")
    assert agent.handle(ProcessFailedSeen(lost), 0.1) == []
    assert agent.handle(HostTakenOverSeen(lost, "hd", (2, 3), mine=False), 0.2) == []  # another spare host's
    actions = agent.handle(HostTakenOverSeen(lost, "hc", (2, 3), mine=True), 0.3)
    assert actions[-1] == StartIds(0, {0: 2, 1: 3}) and agent.ids == {0: 2, 1: 3} and not agent.spare
    idle = Agent(2, "hc", recover=Recover.REPLACE, spare=True)
    idle.handle(JobUpdate(JobView(0)), 0.0)
    assert idle.handle(Interrupted(signal.SIGTERM), 1.0)[-1] == Exit(128 + signal.SIGTERM)


@pytest.mark.parametrize("explicit", [True, False], ids=["named ids", "assigned ids"])
def test_a_spare_host_that_took_over_keeps_its_ids_in_a_new_attempt_where_the_job_names_them(explicit):
    agent = Agent(3, "hc", recover=Recover.REPLACE, spare=True)
    agent.handle(JobUpdate(JobView(0)), 0.0)
    agent.handle(HostTakenOverSeen(Failure(0, 2, "hb", "lost"), "hc", (2, 3), mine=True, explicit=explicit), 0.1)
    actions = agent.handle(JobUpdate(JobView(1, (Failure(0, 0, "ha", "exit code 3"),))), 1.0)
    assert Start(1) in actions and agent.nproc == 2  # the whole job restarts: as many workers as it took over
    assert (agent.named_ids, agent.ids) == (({0: 2, 1: 3},) * 2 if explicit else ({}, {}))


def survivor() -> Agent:
    agent = Agent(2, "ha", ids={0: 0, 1: 1}, recover=Recover.REPLACE, replace_timeout=5.0)
    assert [type(a) for a in agent.handle(JobUpdate(JobView(0)), 0.0) if not isinstance(a, Say)] == [Start]
    return agent


def test_a_survivor_names_the_host_it_waits_for_then_ends_the_job_as_without_replace():
    agent = survivor()
    lost = Failure(0, 2, "hb", "lost its connection")
    agent.handle(ProcessFailedSeen(lost), 1.0)
    agent.handle(ProcessFailedSeen(replace(lost, process_id=3)), 1.1)
    assert agent.handle(Tick(), 1.5) == []
    said = agent.handle(Tick(), 1.0 + waits.WAIT_SAID_S)
    assert [a.line for a in said if isinstance(a, Say)] == [
        "waiting for host hb (processes 2, 3): its replacement, a spare host (ifrt run --spare-host) or its agent's "
        "return, for 3s more (--replace-timeout)"]
    actions = agent.handle(Tick(), 6.0)
    assert [a for a in actions if not isinstance(a, Say)] == [AskShrink(0, lost, (2, 3))]  # first: go on without
    assert "waited 5s for host hb (processes 2, 3)" in actions[0].line
    actions = agent.handle(ShrinkAnswered(0, JobView(0), "the coordinator runs without --min-processes"), 6.1)
    assert [type(a) for a in actions if not isinstance(a, Say)] == [Stop, AskNextAttempt]  # refused: as today
    assert actions[-1] == AskNextAttempt(0, lost) and "without --min-processes" in actions[0].line


@pytest.mark.parametrize("ids", [(2,), ()], ids=["taken over", "its agent back"])
def test_a_survivor_stops_waiting_once_the_host_is_taken_over_or_its_agent_is_back(ids):
    agent = survivor()
    lost = Failure(0, 2, "hb", "lost its connection")
    agent.handle(ProcessFailedSeen(lost), 1.0)
    agent.handle(HostTakenOverSeen(lost, "hc" if ids else "hb", ids, mine=False), 2.0)
    assert agent.handle(Tick(), 10.0) == []


def test_a_survivor_waits_for_nothing_the_job_went_on_without_and_its_own_hung_worker_is_still_replaced():
    agent = survivor()
    lost = Failure(0, 2, "hb", "lost its connection")
    said = agent.handle(ProcessFailedSeen(lost, went_on=True), 1.0)
    assert [type(a) for a in said] == [Say] and "the job goes on without it" in said[0].line
    assert agent.handle(Tick(), 1.0 + waits.WAIT_SAID_S) == [] and agent.handle(Tick(), 60.0) == []  # no AskShrink
    hung = agent.handle(ProcessFailedSeen(Failure(0, 1, "ha", "hung"), went_on=True), 61.0)
    assert Kill(1) in hung  # this host's own: killed, so that its agent replaces it


# Real agents on loopback.

def test_an_agent_started_with_another_recover_mode_is_refused_naming_both(start_coordinator, agents):
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    env = loopback_env(coordinator.address)
    first = agents("--recover", "replace", "--", sys.executable, str(RUN_WORKER), "loop", env=env)
    first.wait_line(r"started process 0 attempt 0")
    other = agents("--recover", "restart", "--", sys.executable, str(RUN_WORKER), "loop", env=env)
    assert other.wait() == core.EXIT_USAGE, other.output()
    assert re.search(r"this agent runs with --recover restart, but the job's agents run with --recover replace "
                     r"\(stated by the agent on '[^']+'\)", "\n".join(other.err)), other.output()
    assert other.out == [] and first.process.poll() is None, other.output()  # nothing started, nothing changed


def test_a_spare_host_without_replace_mode_is_refused_by_its_own_flags(agents):
    spare = agents("--spare-host", "--", sys.executable, str(RUN_WORKER), "loop", env=loopback_env("127.0.0.1:1"))
    assert spare.wait() == core.EXIT_USAGE
    assert "--spare-host needs --recover replace" in "\n".join(spare.err), spare.output()


# Real agents, workers and a coordinator, in network namespaces as hosts.

def start_job(hosts: Hosts, agents, *flags: str, spare: bool, nproc: int = 2,
              worker: tuple[str, ...] = (str(RUN_WORKER), "host")) -> tuple[LocalCoordinator, list]:
    coordinator = LocalCoordinator("--heartbeat-timeout", str(HEARTBEAT_S), num_processes=2 * nproc,
                                   bind=f"{hosts.address(1)}:8476", wrapper=hosts.command(1, []), log_level="WARNING")
    env = loopback_env(coordinator.address, OMP_NUM_THREADS="1")
    command = ("--nproc-per-host", str(nproc), "--recover", "replace", "--grace-seconds", "1", *flags, "--",
               sys.executable, *worker)
    started = [agents(*command, env=env, wrapper=as_host(hosts, h, f"host-{name}")) for h, name in ((1, "a"), (2, "b"))]
    if spare:
        started.append(agents("--spare-host", *command, env=env, wrapper=as_host(hosts, 3, "host-c")))
    return coordinator, started


def worker_pids(agent) -> list[int]:
    agent.wait_line(r"started process \d+ attempt 0 pid \d+")
    agent.wait_line(r"started process \d+ attempt 0 pid \d+", start=1 + next(
        i for i, line in enumerate(agent.out) if re.search(r"started process", line)))
    return [int(m.group(1)) for line in agent.out if (m := re.search(r"started process \d+ attempt 0 pid (\d+)", line))]


def test_a_spare_host_takes_over_a_killed_hosts_ids_and_the_job_completes(agents):
    skip_without_hosts()
    with Hosts(3) as hosts:
        coordinator, (a, b, c) = start_job(hosts, agents, "--max-restarts", "1", spare=True)
        try:
            victims = worker_pids(b)
            worker_pids(a)
            for pid in (b.process.pid, *victims):  # the host dies: its agent and its workers
                os.kill(pid, signal.SIGKILL)
            for agent in (a, c):
                assert agent.wait(timeout=WAIT_S) == 0, agent.output()
        finally:
            coordinator.close()
    b_ids = sorted(int(m.group(1)) for line in b.out if (m := re.search(r"started process (\d+) attempt 0", line)))
    c_ids = sorted(int(m.group(1)) for line in c.out if (m := re.search(r"started process (\d+) attempt 0", line)))
    assert c_ids == b_ids and len(b_ids) == 2, c.output()  # every id of the lost host, on the spare host
    for agent in (a, c):
        shown = {int(m.group(1)): m.group(2) for line in agent.out
                 if (m := re.search(r"generation 2 process (\d+) on (\S+)", line))}
        assert {shown[pid] for pid in b_ids} == {"host-c"} and len(shown) == 4, agent.output()
    err = "\n".join(c.err)
    assert f"taking over processes {', '.join(map(str, b_ids))} of the lost host host-b" in err, c.output()
    assert "spare host host-c" in "\n".join(a.err), a.output()


def test_without_a_spare_host_the_agents_name_the_lost_host_then_the_job_ends_as_today(agents):
    skip_without_hosts()
    with Hosts(2) as hosts:
        coordinator, (a, b) = start_job(hosts, agents, "--max-restarts", "0", "--replace-timeout", "3", spare=False)
        try:
            victims = worker_pids(b)
            worker_pids(a)
            for pid in (b.process.pid, *victims):
                os.kill(pid, signal.SIGKILL)
            assert a.wait(timeout=WAIT_S) == core.EXIT_JOB_FAILED, a.output()
            log = coordinator.log
        finally:
            coordinator.close()
    err = "\n".join(a.err)
    assert re.search(r"waiting for host host-b \(processes \d+, \d+\)", err), a.output()
    assert re.search(r"waited 3s for host host-b", err), a.output()
    assert "the coordinator did not shrink the job: the coordinator runs without --min-processes" in err, a.output()
    assert "the job's restarts are exhausted (0 allowed)" in err, a.output()
    assert re.search(r"waiting for host 'host-b' \(\S+, processes \d+, \d+\)", log), log


def test_the_survivors_torch_group_re_forms_in_place_with_the_spare_hosts_process(agents):
    if importlib.util.find_spec("torch") is None:
        require("torch", "pip install 'ifrt-topology[torch]' (scripts/test.sh installs a CPU build)")
    skip_without_hosts()
    with Hosts(3) as hosts:
        coordinator, (a, b, c) = start_job(hosts, agents, "--max-restarts", "1", spare=True, nproc=1,
                                           worker=(str(TAKEOVER_WORKER),))
        try:
            survivor = a.wait_line(r"joined process 0 pid (\d+) step 0 generation 1 hosts host-a,host-b")
            victim = b.wait_line(r"joined process 1 pid (\d+) step 0")
            for pid in (b.process.pid, int(victim.group(1))):
                os.kill(pid, signal.SIGKILL)
            for agent in (a, c):
                assert agent.wait(timeout=WAIT_S) == 0, agent.output()
        finally:
            coordinator.close()
    pid = survivor.group(1)  # the survivor kept its process: recovered in place onto the new generation
    assert a.wait_line(rf"recovered process 0 pid {pid} step \d+ generation 2 hosts host-a,host-c", timeout=1)
    assert a.wait_line(rf"done process 0 pid {pid} step 40", timeout=1)
    assert c.wait_line(r"joined process 1 pid \d+ step [1-9]\d* generation 2 hosts host-a,host-c", timeout=1)
    assert c.wait_line(r"done process 1 pid \d+ step 40", timeout=1)
