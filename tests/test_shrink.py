"""A replace-mode job shrunk to its survivors (``coordinator.core.shrink``): with no replacement within the agents'
``--replace-timeout``, the coordinator started with ``--min-processes`` drops the failed processes, once (journaled),
and the survivors' torch group re-forms over fewer ranks. The decisions (pure), then a real job on loopback."""

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
from coordinator.core.effects import Republish
from coordinator.core.job_records import Agent as JobAgent
from coordinator.core.job_records import AttemptFailure, JobShrunk, NextAttempt
from coordinator.core.state import ClusterState
from ifrt.errors import InvalidArgument, PermissionDenied
from ifrt.protocol import proof_of
from ifrt.run.agent import Agent, Phase, Recover
from ifrt.run.messages import AskShrink, Failure, JobUpdate, JobView, ProcessFailedSeen, Say, ShrinkAnswered, Tick
from ifrt.topology import Topology
from tests.helpers import TIMEOUT, reg
from tests.requirements import require
from tests.run_agents import WAIT_S, loopback_env

TAKEOVER_WORKER = Path(__file__).with_name("takeover_worker.py")

# The coordinator's decisions: hosts ha (processes 0, 1), hb (2), hc (3), ids assigned.

A = JobAgent("agent-a", "ha", "10.0.0.1", proof_of("a"), 2)
B = JobAgent("agent-b", "hb", "10.0.0.2", proof_of("b"), 1)
C = JobAgent("agent-c", "hc", "10.0.0.3", proof_of("c"), 1)


def config(min_processes: int | None = 2) -> ClusterConfig:
    return ClusterConfig(num_processes=4, heartbeat_timeout_s=TIMEOUT, min_processes=min_processes or 1,
                         shrink=min_processes is not None)


def job(min_processes: int | None = 2) -> ClusterState:
    """A published job of 4 processes whose host hb (process 2) is lost: the coordinator declared it failed."""
    s = ClusterState(config(min_processes))
    for agent in (A, B, C):
        s.join_agent(agent, 1, recover="replace")
    workers = (("a0", "ha", "10.0.0.1", 0), ("a1", "ha", "10.0.0.1", 1), ("b0", "hb", "10.0.0.2", 0),
               ("c0", "hc", "10.0.0.3", 0))
    for uid, host, ip, rank in workers:
        s.register(reg(uid, host=host, ip=ip, rank=rank), 0.0)
    for uid, *_ in workers:
        s.current.attach(uid, 0.0)
    s.current.detach("b0", 0.0)
    s.tick(10 * TIMEOUT)
    assert set(s.attempts.declared) == {2} and s.topology is not None and s.topology.generation == 1
    return s


def shrink(ids: tuple[int, ...] = (2,), request_id: str = "r1", agent: JobAgent = A, attempt: int = 0) -> NextAttempt:
    return NextAttempt(attempt, AttemptFailure(attempt, ids[0] if ids else -1, "hb", "lost"), None, request_id,
                       agent.uid, shrink=ids)


def test_a_shrink_is_decided_once_publishes_the_survivors_generation_and_spends_no_restart():
    s = job()
    s.take_journal()
    answer, effects = s.shrink(shrink(), A.secret_hash)
    assert answer.refused == "" and answer.view.replacements == 0 and not answer.view.exhausted  # no budget spent
    assert [type(e) for e in effects] == [JobShrunk, Republish] and effects[0].process_ids == (2,)
    topology = effects[1].topology
    assert (topology.generation, [p.process_id for p in topology.processes], topology.num_processes) == \
        (2, [0, 1, 3], 3)
    entries = s.take_journal()
    assert entries == [journal.Shrunk(0, (2,), "r1")] and journal.decode(journal.encode(entries[0])) == entries[0]
    assert s.shrink(shrink(), A.secret_hash) == (answer, [])  # its retry
    again, effects = s.shrink(shrink(request_id="r2", agent=C), C.secret_hash)  # a second agent that gave up too
    assert (again.refused, effects, s.take_journal(), s.topology.generation) == ("", [], [], 2)
    assert s.attempts.declared == {} and s.lost_hosts(frozenset({B.uid})) == []  # nobody waits for, or takes, it
    replayed = ClusterState(config())
    source = job()
    for entry in [*source.take_journal(), *entries]:
        replayed.replay(entry)
    assert replayed.topology == s.topology and replayed.attempts.shrunk == {2}  # a failover shrinks nothing twice
    assert replayed.shrink(shrink(request_id="r3"), A.secret_hash)[1] == []


@pytest.mark.parametrize(("min_processes", "why"), [
    (None, "the coordinator runs without --min-processes: this job does not shrink"),
    (4, "only 3 processes would remain without processes 2, fewer than --min-processes 4"),
], ids=["not opted in", "too few would remain"])
def test_a_shrink_is_refused_without_min_processes_or_below_it_changing_nothing(min_processes, why):
    s = job(min_processes)
    s.take_journal()
    answer, effects = s.shrink(shrink(), A.secret_hash)
    assert answer.refused.startswith(why) and effects == [] and s.take_journal() == []
    assert s.topology.generation == 1 and set(s.attempts.declared) == {2}  # the agents restart the job as before


def test_only_the_jobs_agents_may_shrink_and_only_processes_the_coordinator_declared_failed():
    s = job()
    s.take_journal()
    with pytest.raises(PermissionDenied, match="is no agent of this job"):
        s.shrink(replace(shrink(), agent_uid="intruder"), proof_of("intruder"))
    with pytest.raises(PermissionDenied, match="does not carry its secret"):
        s.shrink(shrink(), proof_of("not a's"))
    with pytest.raises(PermissionDenied, match="process 1 is not a failure the coordinator declared"):
        s.shrink(shrink((2, 1)), A.secret_hash)  # a live process
    for ids in ((2, 2), (7,), (-1,)):
        with pytest.raises(InvalidArgument, match="expected distinct process ids of the job"):
            s.shrink(shrink(ids), A.secret_hash)
    with pytest.raises(InvalidArgument, match="ahead of the job's current attempt"):
        s.shrink(shrink(attempt=1), A.secret_hash)
    assert s.take_journal() == [] and s.topology.generation == 1 and set(s.attempts.declared) == {2}
    s.next_attempt(NextAttempt(0, AttemptFailure(0, 2, "hb", "lost"), request_id="restart", agent_uid=A.uid),
                   A.secret_hash)  # replaced, or the job restarted: nothing left to shrink
    s.take_journal()
    assert s.shrink(shrink(), A.secret_hash)[1] == [] and s.take_journal() == []


# The agent's decisions.

def test_a_survivor_that_gave_up_waiting_asks_to_shrink_and_its_workers_go_on_once_the_job_shrank():
    agent = Agent(2, "ha", ids={0: 0, 1: 1}, recover=Recover.REPLACE, replace_timeout=2.0)
    agent.handle(JobUpdate(JobView(0)), 0.0)
    lost = Failure(0, 2, "hb", "lost its connection")
    agent.handle(ProcessFailedSeen(lost), 1.0)
    actions = agent.handle(Tick(), 3.0)
    assert [a for a in actions if not isinstance(a, Say)] == [AskShrink(0, lost, (2,))]
    actions = agent.handle(ShrinkAnswered(0, JobView(0)), 3.1)
    assert [type(a) for a in actions] == [Say] and "shrank to its survivors" in actions[0].line  # nothing stops
    assert agent.phase is Phase.RUNNING and agent.handle(Tick(), 30.0) == []  # and nothing is asked again


# The program's ranks after a shrink.

def test_torch_ranks_follow_the_survivors_generation():
    if importlib.util.find_spec("torch") is None:
        require("torch", "pip install 'ifrt-topology[torch]' (scripts/test.sh installs a CPU build)")
    import ifrt.torch

    s = job()
    _, effects = s.shrink(shrink((2,)), A.secret_hash)
    from ifrt import wire

    survivors = Topology(wire.encode(effects[-1].topology), 3)
    assert ifrt.torch.ranks(survivors) == {0: 0, 1: 1, 3: 2} and ifrt.torch.rank(survivors) == 2
    mesh = survivors.mesh((3,), ("dp",), devices=[p.process_id << 17 for p in survivors.processes])
    assert ifrt.torch.mesh_ranks(mesh) == [0, 1, 2]  # process 3 is rank 2 of 3


# A real job on loopback: three agents of one torch worker each; process 0's host dies, nothing replaces it.

def test_the_survivors_torch_group_re_forms_over_two_ranks_once_process_0s_host_is_lost(start_coordinator, agents):
    if importlib.util.find_spec("torch") is None:
        require("torch", "pip install 'ifrt-topology[torch]' (scripts/test.sh installs a CPU build)")
    coordinator = start_coordinator("--heartbeat-timeout", "1", "--min-processes", "2", num_processes=3,
                                     log_level="WARNING")
    env = loopback_env(coordinator.address, OMP_NUM_THREADS="1")
    hosts = [agents("--host-rank", str(h), "--num-hosts", "3", "--recover", "replace", "--replace-timeout", "2",
                    "--max-restarts", "0", "--grace-seconds", "1", "--", sys.executable, str(TAKEOVER_WORKER),
                    env=env) for h in range(3)]
    joined = [a.wait_line(rf"joined process {h} pid (\d+) step 0 generation 1 hosts \S+ rank {h} of 3")
              for h, a in enumerate(hosts)]
    for pid in (hosts[0].process.pid, int(joined[0].group(1))):  # process 0's host dies: its agent and its worker
        os.kill(pid, signal.SIGKILL)
    for h in (1, 2):
        assert hosts[h].wait(timeout=WAIT_S) == 0, hosts[h].output()  # no restart: the budget of 0 is intact
        pid = joined[h].group(1)  # each survivor kept its process, its rank renumbered by process id
        assert hosts[h].wait_line(rf"recovered process {h} pid {pid} step \d+ generation 2 hosts \S+,\S+ "
                                  rf"rank {h - 1} of 2$", timeout=1)
        assert hosts[h].wait_line(rf"done process {h} pid {pid} step 40", timeout=1)
    err = "\n".join(hosts[1].err + hosts[2].err)
    assert "asking the coordinator to go on without processes 0" in err, hosts[1].output()
    assert "the job shrank to its survivors" in err, hosts[1].output()
    assert re.search(r"the job shrinks to its survivors: processes 0 dropped", coordinator.log), coordinator.log
