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
import sys
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


def test_survivors_go_on_without_process_0_and_take_its_replacement_back_healed(start_coordinator, agents):
    victim = 0  # the process JAX's own service lives in; the test below kills others too
    coordinator = start_coordinator("--max-restarts", "2", num_processes=PROCESSES, log_level="WARNING")
    agent = agents("--nproc-per-host", str(PROCESSES), "--recover", "replace", "--max-restarts", "2", "--",
                   sys.executable, str(EXAMPLE),
                   env=loopback_env(coordinator.address, STEPS=str(STEPS), INTERVAL="0.1", OMP_NUM_THREADS="1"))
    pids = wait_for(agent, "every process's start", lambda rows: (
        found if len(found := {r["started"]: r["pid"] for _, r in rows if "started" in r}) == PROCESSES else None))
    wait_for(agent, "step 5 in every process", lambda rows: {p for p, r in rows if r.get("step", -1) >= 5} ==
             set(range(PROCESSES)))
    killed_at = len(records(agent))
    os.kill(pids[victim], signal.SIGKILL)

    survivors = sorted(set(range(PROCESSES)) - {victim})
    went_on = wait_for(agent, f"a step of the survivors without process {victim}", lambda rows: [
        (p, r) for p, r in steps_after(rows, killed_at) if r["live"] == survivors])
    assert {p for p, _ in went_on} <= set(survivors)

    def whole_again(rows):
        by_step: dict[int, dict[int, dict]] = {}
        for p, r in steps_after(rows, killed_at):
            if r["live"] == list(range(PROCESSES)):
                by_step.setdefault(r["step"], {})[p] = r
        return next((found for _, found in sorted(by_step.items()) if len(found) == PROCESSES), None)

    whole = wait_for(agent, f"a step of all {PROCESSES} processes with process {victim}'s replacement", whole_again)
    assert len({r["weights"] for r in whole.values()}) == 1, whole  # healed: the survivors' weights, bit for bit
    assert whole[victim]["step"] > went_on[0][1]["step"], "the replacement took the survivors' step count"

    assert agent.wait(120) == 0, agent.output()
    last = {p: r for p, r in records(agent) if "step" in r}
    assert {r["step"] for r in last.values()} == {STEPS - 1}, last
    assert len({r["weights"] for r in last.values()}) == 1, last
    assert "exited with 75" not in "\n".join(agent.err + agent.out)  # no survivor ended


def test_live_sets_under_kills_of_any_process_keep_jaxs_semantics(start_coordinator, agents):
    """Processes killed at random moments (process 0 among them), each replaced: every live_devices answer has a
    moment at which exactly its members were in the call and every other process could be dead (bench/live_sets)."""
    rng = random.Random(53)
    coordinator = start_coordinator("--max-restarts", "8", num_processes=PROCESSES, log_level="WARNING")
    end_at = time.monotonic() + 35
    agent = agents("--nproc-per-host", str(PROCESSES), "--recover", "replace", "--max-restarts", "8", "--",
                   sys.executable, str(LIVE_SET_WORKER),
                   env=loopback_env(coordinator.address, END_AT=str(end_at), OMP_NUM_THREADS="1"))
    killed: set[int] = set()
    for victim in (0, rng.randrange(PROCESSES), 0, rng.randrange(1, PROCESSES)):
        time.sleep(rng.uniform(2.0, 4.0))
        pid = wait_for(agent, f"process {victim} started", lambda rows, victim=victim: next(
            (r["pid"] for p, r in reversed(rows) if r.get("process") == victim), None))
        wait_for(agent, f"an answer in process {victim}'s pid {pid}", lambda rows, pid=pid, victim=victim: any(
            "answer" in r and p == victim for p, r in rows[[r.get("pid") for _, r in rows].index(pid):]))
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
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
    assert verdict.checked > 50 and verdict.violations == [], verdict.violations[:5]
    assert any(c.answer and len(c.answer) < PROCESSES for life in lives for c in life.calls)  # went on without one
