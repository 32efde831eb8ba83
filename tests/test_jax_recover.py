"""JAX's own fault tolerance on ifrt (``jax_enable_recoverability``, ``live_devices``): any process may die, process 0
included, and the others go on; its replacement (``ifrt run --recover replace``) is in the next live set with a new
incarnation and is healed by a live peer. Real JAX processes (jaxlib 0.10: 0.4.30 has no ``GetAliveTasks``) running
examples/jax_fault_tolerance.py under a real agent and coordinator.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from bench.live_sets import Call, Life, check
from tests.run_agents import RunAgent, loopback_env
from tests.workers import ROOT

pytest.importorskip("jax")

EXAMPLE = ROOT / "examples" / "jax_fault_tolerance.py"
LIVE_SET_WORKER = ROOT / "tests" / "live_set_worker.py"
PROCESSES, STEPS = 3, 40


def records(agent: RunAgent, start: int = 0) -> list[tuple[int, dict]]:
    """The example's JSON lines from stdout line ``start`` on, each with the process that printed it (the agent's
    prefix is the local rank, which is the process id with one agent)."""
    return [(int(m.group(1)), json.loads(m.group(2))) for line in agent.out[start:]
            if (m := re.match(r"^\[(\d+)\] (\{.*\})$", line))]


def wait_for(agent: RunAgent, what: str, found, timeout: float = 90.0):
    """``found(records)`` once it is truthy; AssertionError naming ``what`` and the output otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := found(records(agent)):
            return result
        assert agent.process.poll() is None, f"the agent ended before {what}:\n{agent.output()}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout:.0f} s:\n{agent.output()}")


def steps_after(rows: list[tuple[int, dict]], since: int) -> list[tuple[int, dict]]:
    return [(p, r) for p, r in rows[since:] if "step" in r]


class Example:
    """examples/jax_fault_tolerance.py as process ``process_id`` of the job, started directly (no agent); its JSON
    lines (gloo prints other lines on stdout too) are kept as they come."""

    def __init__(self, address: str, process_id: int) -> None:
        env = loopback_env(address, IFRT_PROCESS_ID=str(process_id), IFRT_NUM_PROCESSES=str(PROCESSES),
                           STEPS=str(STEPS), INTERVAL="0.1", OMP_NUM_THREADS="1")
        self.process = subprocess.Popen([sys.executable, str(EXAMPLE)], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        self.rows: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                self.rows.append(json.loads(line))

    def step(self, timeout: float = 90.0, **match) -> dict:
        """The first step line with the ``match`` values."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((r for r in list(self.rows) if "step" in r and all(r[k] == v for k, v in match.items())),
                         None)
            if found is not None:
                return found
            assert self.process.poll() is None, f"process {self.process.pid} ended: {self.rows[-5:]}"
            time.sleep(0.05)
        raise AssertionError(f"process {self.process.pid}: no step {match} within {timeout:.0f} s: {self.rows[-5:]}")


@pytest.fixture
def examples():
    started: list[Example] = []

    def start(address: str, process_id: int) -> Example:
        started.append(Example(address, process_id))
        return started[-1]

    yield start
    for example in started:
        if example.process.poll() is None:
            example.process.kill()
            example.process.wait()


def test_survivors_go_on_without_process_0_and_take_it_back_healed_when_it_starts_again(start_coordinator, examples):
    """No agent: the coordinator learns of the death from the lost connection, and nothing replaces process 0 until
    the test starts it again, so the survivors must go on without it first."""
    coordinator = start_coordinator("--heartbeat-timeout", "2", num_processes=PROCESSES, log_level="WARNING")
    job = [examples(coordinator.address, p) for p in range(PROCESSES)]
    for example in job:
        example.step(step=5)
    job[0].process.kill()
    survivors = list(range(1, PROCESSES))
    went_on = [example.step(live=survivors)["step"] for example in job[1:]]

    job[0] = examples(coordinator.address, 0)
    back = [job[0].step(live=list(range(PROCESSES)))]
    back += [example.step(step=back[0]["step"]) for example in job[1:]]
    assert back[0]["step"] > max(went_on), "the process started again took the survivors' step count"
    assert len({r["weights"] for r in back}) == 1, back  # healed: the survivors' weights, bit for bit

    for example in job:
        assert example.process.wait(90) == 0
    last = [[r for r in example.rows if "step" in r][-1] for example in job]
    assert {r["step"] for r in last} == {STEPS - 1} and len({r["weights"] for r in last}) == 1, last


def test_live_sets_under_kills_of_any_process_keep_jaxs_semantics(start_coordinator, agents, tmp_path):
    """Processes killed at random moments (process 0 among them), each replaced: every live_devices answer has a
    moment at which exactly its members were in the call and every other process could be dead (bench/live_sets)."""
    rng = random.Random(53)
    coordinator = start_coordinator("--max-restarts", "8", num_processes=PROCESSES, log_level="WARNING")
    stop = tmp_path / "stop"
    agent = agents("--nproc-per-host", str(PROCESSES), "--recover", "replace", "--max-restarts", "8", "--",
                   sys.executable, str(LIVE_SET_WORKER),
                   env=loopback_env(coordinator.address, STOP_FILE=str(stop), OMP_NUM_THREADS="1"))

    def answered_after(rows, pid: int, process: int, members: int = 1) -> bool:
        """Whether ``pid`` (of ``process``) has an answer of ``members`` processes or more."""
        since = next((i for i, (_, r) in enumerate(rows) if r.get("pid") == pid), None)
        return since is not None and any("answer" in r and p == process and len(r["answer"]) >= members
                                         for p, r in rows[since:])

    killed: set[int] = set()
    for victim in (0, rng.randrange(PROCESSES), 0, rng.randrange(1, PROCESSES)):
        time.sleep(rng.uniform(1.0, 3.0))
        pid = wait_for(agent, f"process {victim} started", lambda rows, victim=victim: next(
            (r["pid"] for p, r in reversed(rows) if r.get("process") == victim and r["pid"] not in killed), None))
        wait_for(agent, f"an answer in process {victim} (pid {pid})", lambda rows, pid=pid, victim=victim:
                 answered_after(rows, pid, victim))
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    last = wait_for(agent, f"process {victim}'s replacement", lambda rows: next(
        (r["pid"] for p, r in reversed(rows) if r.get("process") == victim and r["pid"] not in killed), None))
    wait_for(agent, "a live set of every process again", lambda rows: answered_after(rows, last, victim, PROCESSES))
    stop.touch()
    assert agent.wait(120) == 0, agent.output()

    lives: list[Life] = []
    calls: dict[int, list[Call]] = {}
    for process, row in records(agent):
        if "born" in row:
            index = sum(1 for life in lives if life.process == process)
            lives.append(Life(process, index, row["born"], died=True))  # killed, or ended with the job
            calls[len(lives) - 1] = []
        elif "calling" in row or "call" in row:
            mine = calls[max(i for i, life in enumerate(lives) if life.process == process)]
            if "calling" in row:
                mine.append(Call(row["calling"]))  # until it returns: a call its process died in
            else:
                mine[-1] = Call(*row["call"], tuple(map(tuple, row["answer"])))
    lives = [Life(life.process, life.incarnation, life.born, tuple(calls[i]), life.died)
             for i, life in enumerate(lives)]
    assert len(lives) == PROCESSES + len(killed)
    for life in lives:  # an incarnation's own entry in its answers: ifrt's incarnation, one more per replacement
        assert all(dict(c.answer)[life.process] == life.incarnation for c in life.calls if c.answer), life
    verdict = check(lives)
    assert verdict.violations == [], verdict.violations[:5]
    answers = [c.answer for life in lives for c in life.calls if c.answer]
    assert len(answers) == verdict.checked
    assert any(len(a) == PROCESSES and max(i for _, i in a) > 0 for a in answers), answers  # took replacements back
