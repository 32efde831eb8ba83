"""Go on first, grow after: where the coordinator runs ``--on-failure elastic``, a job of ``ifrt run --recover
replace`` agents and ``ifrt.torch.Healing`` workers goes on without a lost host at once (a new generation over the
survivors, their group re-formed, nobody waiting for a replacement), and takes its process back when its agent
starts again: the newcomer is healed from a survivor and joins at a step boundary, with no whole-job restart and no
restart budget spent (``--max-restarts 0``). A replica set that loses its last copy is StateLost, named. Real
coordinator, agents in network namespaces as hosts, gloo workers (tests/go_on_worker.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from coordinator.local import LocalCoordinator
from tests.netns import Hosts, as_host, skip_without_hosts
from tests.requirements import require
from tests.run_agents import WAIT_S, RunAgent, loopback_env

WORKER = Path(__file__).with_name("go_on_worker.py")
HEARTBEAT_S = 10.0  # the default: a lost host is failed after 5 s, a killed process after 1.25 s


@pytest.fixture(autouse=True)
def _needs_torch_and_hosts() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        require("torch", "pip install 'ifrt-topology[torch]' (scripts/test.sh installs a CPU build)")
    skip_without_hosts()


def records(agent: RunAgent) -> list[dict]:
    return [json.loads(m.group(1)) for line in list(agent.out) if (m := re.match(r"^\[\d+\] (\{.*\})$", line))]


def wait_record(agent: RunAgent, match, what: str, timeout: float = WAIT_S) -> dict:
    """The first record of ``agent``'s workers that ``match`` accepts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = next((r for r in records(agent) if match(r)), None)
        if found is not None:
            return found
        assert agent.process.poll() is None, f"the agent ended before {what}:\n{agent.output()}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout}s:\n{agent.output()}")


def kill_host(agent: RunAgent) -> None:
    """The host dies: its agent and its worker, SIGKILLed."""
    worker = wait_record(agent, lambda r: True, "a worker")["pid"]
    for pid in (agent.process.pid, worker):
        os.kill(pid, signal.SIGKILL)
    agent.process.wait()


def lose_host(survivor: RunAgent, victim: RunAgent) -> None:
    """Once the job stepped, ``victim``'s host dies and ``survivor`` steps on alone."""
    wait_record(survivor, lambda r: r["event"] == "step", "a step")
    kill_host(victim)
    wait_record(survivor, lambda r: r["event"] == "state" and r["world"] == 1, "the survivor alone")


class Job:
    """A coordinator on host 1 and one agent of one worker per host (``host-a``, ``host-b``...)."""

    def __init__(self, hosts: Hosts, agents, count: int, steps: int, restarts: int = 0, **env: str) -> None:
        self.hosts, self.agents, self.restarts = hosts, agents, restarts
        self.coordinator = LocalCoordinator("--heartbeat-timeout", str(HEARTBEAT_S), "--on-failure", "elastic",
                                            "--min-processes", "1", num_processes=count,
                                            bind=f"{hosts.address(1)}:8476", wrapper=hosts.command(1, []),
                                            log_level="WARNING")
        self.env = loopback_env(self.coordinator.address, OMP_NUM_THREADS="1", GO_ON_STEPS=str(steps),
                                GO_ON_WHOLE=str(count), **env)
        self.started = [self.start(h) for h in range(count)]

    def start(self, h: int, *flags: str, **env: str) -> RunAgent:
        """Host ``h``'s agent (again, where it was lost)."""
        return self.agents("--nproc-per-host", "1", "--recover", "replace", "--max-restarts", str(self.restarts),
                           "--grace-seconds", "1", *flags, "--", sys.executable, str(WORKER),
                           env={**self.env, **env}, wrapper=as_host(self.hosts, h + 1, f"host-{'abcd'[h]}"))


def test_a_lost_host_is_gone_on_without_at_once_and_its_agent_started_again_rejoins_healed(agents):
    with Hosts(3) as hosts:
        job = Job(hosts, agents, 3, steps=60)
        a, b, c = job.started
        try:
            for agent in (a, b, c):
                wait_record(agent, lambda r: r["event"] == "step", "a step")
            kill_host(c)
            went_on = [wait_record(agent, lambda r: r["event"] == "state" and r["world"] == 2,
                                   "the survivors' group without the lost host") for agent in (a, b)]
            time.sleep(1.0)  # the survivors step on meanwhile: no replacement is coming
            back = job.start(2)
            joined = wait_record(back, lambda r: r["event"] == "state", "the newcomer's state")
            grown = [wait_record(agent, lambda r: r["event"] == "state" and r["recoveries"] == 2,
                                 "the survivors' group with the newcomer") for agent in (a, b)]
            for agent in (a, b, back):
                assert agent.wait(WAIT_S) == 0, agent.output()
        finally:
            job.coordinator.close()
    first = {r["process_id"]: r for agent in (a, b) for r in records(agent)[:1]}
    assert [r["world"] for r in went_on] == [2, 2] and went_on[0]["digest"] == went_on[1]["digest"], went_on
    assert [r["pid"] for r in went_on] == [first[0]["pid"], first[1]["pid"]], (first, went_on)  # kept in place
    assert went_on[0]["step"] > 0 and joined["step"] > went_on[0]["step"] + 5, (went_on, joined)  # it stepped on
    assert joined["process_id"] == 2 and joined["healed_from"] in (0, 1) and joined["world"] == 3, joined
    assert {r["step"] for r in grown} == {joined["step"]}, (grown, joined)
    assert {r["digest"] for r in grown} == {joined["digest"]}, (grown, joined)  # parameters and momentum
    done = [r for agent in (a, b, back) for r in records(agent) if r["event"] == "done"]
    assert len(done) == 3 and len({(r["digest"], r["step"]) for r in done}) == 1 and done[0]["step"] >= 60, done
    said = "\n".join(a.err)
    assert "the job goes on without it" in said and "waiting for host" not in said, a.output()


def test_a_replica_set_that_loses_its_last_copy_is_state_lost_naming_it(agents):
    with Hosts(2) as hosts:
        job = Job(hosts, agents, 2, steps=400, GO_ON_SETS="[[0], [1]]")
        a, b = job.started
        try:
            for agent in (a, b):
                wait_record(agent, lambda r: r["event"] == "step", "a step")
            kill_host(b)
            assert a.wait(WAIT_S) != 0, a.output()
        finally:
            job.coordinator.close()
    said = "\n".join(a.err)
    assert "StateLost: replica set [1] has no live process: the job went on without it" in said, a.output()
    assert not [r for r in records(a) if r["event"] == "state" and r["world"] == 1], a.output()


def test_a_newcomer_killed_while_it_joins_leaves_the_survivors_stepping_and_its_replacement_joins(agents, tmp_path):
    with Hosts(2) as hosts:
        job = Job(hosts, agents, 2, steps=60, restarts=1)
        a, b = job.started
        try:
            lose_host(a, b)
            back = job.start(1, GO_ON_DIE_JOINING=str(tmp_path / "died"))
            joined = wait_record(back, lambda r: r["event"] == "state", "the replacement's state")
            for agent in (a, back):
                assert agent.wait(WAIT_S) == 0, agent.output()
        finally:
            job.coordinator.close()
    assert (tmp_path / "died").exists()  # the first newcomer died in its group, before its healing
    survivor = [r for r in records(a) if r["event"] in ("state", "done")]
    assert len({r["pid"] for r in survivor}) == 1, survivor  # never restarted
    steps = [r["step"] for r in records(a) if r["event"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] >= 60, steps  # none applied twice, none lost
    assert joined["healed_from"] == 0 and joined["world"] == 2 and joined["step"] > 0, joined
    done = [r for agent in (a, back) for r in records(agent) if r["event"] == "done"]
    assert len(done) == 2 and done[0]["digest"] == done[1]["digest"], done
    assert "starting a new worker for process 1" in "\n".join(back.err), back.output()


def test_a_spare_host_started_later_takes_the_lost_hosts_place_healed(agents):
    with Hosts(3) as hosts:
        job = Job(hosts, agents, 2, steps=60, restarts=1)
        a, b = job.started
        try:
            lose_host(a, b)
            spare = job.start(2, "--spare-host")
            joined = wait_record(spare, lambda r: r["event"] == "state", "the spare host's process")
            for agent in (a, spare):
                assert agent.wait(WAIT_S) == 0, agent.output()
        finally:
            job.coordinator.close()
    assert joined["process_id"] == 1 and joined["healed_from"] == 0 and joined["world"] == 2, joined
    done = [r for agent in (a, spare) for r in records(agent) if r["event"] == "done"]
    assert len(done) == 2 and done[0]["digest"] == done[1]["digest"] and done[0]["step"] == done[1]["step"], done
    assert "taking over processes 1 of the lost host host-b" in "\n".join(spare.err), spare.output()
