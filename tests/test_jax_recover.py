"""JAX's own fault tolerance on ifrt (``jax_enable_recoverability``, ``live_devices``): any process may die, process 0
included, and the others go on; its replacement (``ifrt run --recover replace``) is in the next live set with a new
incarnation and is healed by a live peer. Real JAX processes (jaxlib 0.10: 0.4.30 has no ``GetAliveTasks``) running
examples/jax_fault_tolerance.py under a real agent and coordinator.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

from tests.run_agents import RunAgent, loopback_env
from tests.workers import ROOT

pytest.importorskip("jax")

EXAMPLE = ROOT / "examples" / "jax_fault_tolerance.py"
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


@pytest.mark.parametrize("victim", [0, 2])
def test_survivors_go_on_without_a_killed_process_and_take_its_replacement_back_healed(
        start_coordinator, agents, victim):
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
