"""The ifrt side of bench/healing.py: one trial of ``ifrt.torch.Replica`` healing a process after a SIGKILL.

A coordinator and two ``ifrt run --recover replace --spare 1`` agents on loopback, one process each
(bench/healing_ifrt_worker.py, the project's .venv). Once both have committed ``WARM`` steps with equal digests,
process 1 is armed and SIGKILLs itself at the chosen moment of its next step; its agent hands its process to the
warm spare. Measured as the torchft side is: from the kill until both processes have reported the first step after
the kill that both report with equal digests (``recovered_s``), whether the survivor was lost, and what runs and
listens beside the job (the coordinator, the agents and their spares). Every process is started here and stopped
here, by pid, also after a failure. ``--one-agent``: the default layout instead, one agent for both processes
(``ifrt run --nproc-per-host 2 --recover replace --spare 1``; way ``ifrt-1agent`` of bench/healing.py).

    .venv/bin/python bench/healing_ifrt.py [--state-mb 10] [--moment before] [--one-agent]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import healing_model  # noqa: E402
from bench.healing_model import AFTER, RECOVER_TIMEOUT, START_TIMEOUT, WARM, secs, warm  # noqa: E402
from bench.proc_sockets import children_of, listening, rss_mb  # noqa: E402
from coordinator.local import LocalCoordinator  # noqa: E402

WORKER = ROOT / "bench" / "healing_ifrt_worker.py"
RECORD = re.compile(r"^\[(\d+)\] (\{.*\})$")


class Agent:
    """``ifrt run`` for one host: its workers' JSON lines, each stamped on arrival and with the process id it came
    from (``process``). ``args``: the ``ifrt run`` arguments (default: host ``host`` of 2, one process, one spare)."""

    def __init__(self, host: int, env: dict[str, str], restarts: int = 4, args: list[str] | None = None) -> None:
        self.started = time.time()
        args = args or ["--nproc-per-host", "1", "--host-rank", str(host), "--num-hosts", "2", "--recover", "replace",
                        "--spare", "1"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ifrt.cli", "run", *args, "--max-restarts", str(restarts), "--grace-seconds", "2",
             "--", sys.executable, str(WORKER)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.records: list[dict] = []
        self.err: list[str] = []
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(line.rstrip() for line in self.process.stderr),
                         daemon=True).start()

    def _out(self) -> None:
        for line in self.process.stdout:
            if m := RECORD.match(line.rstrip("\n")):
                with contextlib.suppress(ValueError):
                    self.records.append({**json.loads(m.group(2)), "arrived": time.time(),
                                         "process": int(m.group(1))})

    def steps(self, after: float, pid: int | None = None) -> dict[int, dict]:
        """Committed steps reported at or after ``after`` (by the worker ``pid`` if given), by step."""
        return {r["step"]: r for r in list(self.records) if "step" in r and "event" not in r and r["t"] >= after
                and (pid is None or r["pid"] == pid)}

    def event(self, name: str) -> dict | None:
        return next(iter(self.events(name)), None)

    def events(self, name: str) -> list[dict]:
        return [r for r in list(self.records) if r.get("event") == name]

    def stop(self) -> None:
        """SIGTERM (the agent stops its workers and spares), then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Part(Agent):
    """The records of one process of an agent that runs several (``--nproc-per-host 2``), read as an Agent's."""

    def __init__(self, agent: Agent, process_id: int) -> None:  # no process of its own: the agent's
        self.agent, self.process_id, self.process, self.err = agent, process_id, agent.process, agent.err

    @property
    def records(self) -> list[dict]:  # type: ignore[override]
        return [r for r in list(self.agent.records) if r["process"] == self.process_id]


def wait_for(probe, what: str, agents: list[Agent], timeout: float):
    """``probe()`` once it is not None; TimeoutError naming ``what`` after ``timeout`` or once an agent exited."""
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        if any(a.process.poll() is not None for a in agents) or time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s or an agent exited: "
                               f"{' || '.join(' | '.join(a.err[-4:]) for a in agents)[-1500:]}")
        time.sleep(0.005)
    return found


def servers_of(coordinator_pid: int, agents: list[Agent]) -> dict:
    """What runs and listens beside the job: the coordinator, the agents and their idle spares (the workers are the
    job; an agent's children but its worker are spares)."""
    beside = [coordinator_pid, *(a.process.pid for a in agents)]
    workers = {r["pid"] for a in agents for r in a.records if "pid" in r}
    spares = [c for a in agents for c in children_of(a.process.pid) if c not in workers]
    roles = {"coordinator": [f"{h}:{p}" for h, p in listening(coordinator_pid)],
             "agents": [f"{h}:{p}" for a in agents for h, p in listening(a.process.pid)]}
    return {"listening": sum(len(v) for v in roles.values()), "by_role": roles,
            "processes": len(beside) + len(spares),
            "process_names": ["ifrt-coordinator", f"ifrt run agent x{len(agents)}", f"warm spare x{len(spares)}"],
            "rss_mb": rss_mb(coordinator_pid), "agents_rss_mb": [rss_mb(a.process.pid) for a in agents],
            "spares_rss_mb": [rss_mb(s) for s in spares]}


def run_trial(state_mb: int, moment: str, round: int, one_agent: bool = False) -> healing_model.TrialResult:
    """One trial (see the module's doc); ``one_agent``: the default layout instead, one agent ``ifrt run
    --nproc-per-host 2 --recover replace --spare 1`` for both processes (way ``ifrt-1agent``)."""
    lines = len([line for line in WORKER.read_text().splitlines() if line.rstrip().endswith("# [ifrt]")])
    result = healing_model.trial_result("ifrt-1agent" if one_agent else "ifrt", state_mb, moment, round, lines=lines)
    tmp = Path(tempfile.mkdtemp(prefix="healing-ifrt-"))
    kill_file = tmp / "kill"
    agents: list[Agent] = []
    try:
        with LocalCoordinator(num_processes=2, log_level="WARNING") as coordinator:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "BENCH_", "MASTER_"))}
            env.update(IFRT_COORDINATOR=coordinator.address, IFRT_CPU_DEVICE_COUNT="1", BENCH_STATE_MB=str(state_mb),
                       BENCH_KILL_MOMENT=moment, BENCH_KILL_FILE=str(kill_file), BENCH_MAX_SECONDS="400",
                       OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            if one_agent:
                agents = [Agent(0, env, args=["--nproc-per-host", "2", "--recover", "replace", "--spare", "1"])]
                survivor, host = Part(agents[0], 0), Part(agents[0], 1)
            else:
                agents = [Agent(h, env) for h in range(2)]
                survivor, host = agents
            wait_for(lambda: warm(survivor.steps(0), host.steps(0)), f"{WARM} equal steps on both", agents,
                     START_TIMEOUT)
            victim = host.steps(0)[max(host.steps(0))]["pid"]
            kill_file.touch()
            t_kill = wait_for(lambda: host.event("killed"), "the victim's kill", agents, RECOVER_TIMEOUT)["t"]

            try:
                step, result["recovered_s"], result["equal"], result["first_step"] = wait_for(
                    lambda: _recovered(survivor, host, t_kill, victim), "both processes on an equal step after the "
                    "kill", agents, RECOVER_TIMEOUT)
            except TimeoutError as e:
                result["error"], step = str(e), None
            if step is not None:
                result["step"] = step
                with contextlib.suppress(TimeoutError):
                    wait_for(lambda: len([s for s in survivor.steps(t_kill) if s > step]) >= AFTER or None,
                             "steps after recovery", agents, 30)
            joined = [r for r in host.records if r.get("event") == "joined" and r["pid"] != victim]
            if joined:
                result["replacement_joined_s"] = secs(joined[0]["t"] - t_kill)
                if healed := joined[0]["healed"]:  # the transfer alone: the exchange, then the tensors
                    result["heal_mb"], result["heal_s"] = secs(healed["bytes"] / 1e6), secs(healed["seconds"])
                    result["heal_gb_s"] = secs(healed["bytes"] / 1e9 / max(healed["seconds"], 1e-9))
            stepped = survivor.steps(t_kill)
            result["survivor_lost"] = survivor.process.poll() is not None or not stepped or (
                step is not None and not any(s > step for s in stepped))
            result["servers"] = servers_of(coordinator.process.pid, agents)
    except TimeoutError as e:
        result["error"] = str(e)
    finally:
        for agent in agents:
            agent.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _recovered(survivor: Agent, host: Agent, t_kill: float, victim: int) -> tuple[int, float, bool, int] | None:
    """The first step after the kill that the survivor and the victim's replacement report with equal digests,
    the seconds from the kill until both had, whether the first step both reported was equal, and that step."""
    a = survivor.steps(t_kill)
    b = {s: r for s, r in host.steps(t_kill).items() if r["pid"] != victim}
    common = sorted(set(a) & set(b))
    step = next((s for s in common if a[s]["digest"] == b[s]["digest"]), None)
    if step is None:
        return None
    return step, secs(max(a[step]["t"], b[step]["t"]) - t_kill), a[common[0]]["digest"] == b[common[0]]["digest"], \
        common[0]


def run_soak(state_mb: int, recoveries: int, pause_s: float = 4.0) -> dict:
    """``recoveries`` SIGKILLs of process 1 (before a step) in one job, each once the last recovery is done and the
    agent had ``pause_s`` to start a new spare: each recovery's time, and the surviving process's threads,
    descriptors and memory after each."""
    tmp = Path(tempfile.mkdtemp(prefix="healing-soak-"))
    kill_file = tmp / "kill"
    agents: list[Agent] = []
    times: list[float] = []
    try:
        with LocalCoordinator(num_processes=2, log_level="WARNING") as coordinator:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "BENCH_", "MASTER_"))}
            env.update(IFRT_COORDINATOR=coordinator.address, IFRT_CPU_DEVICE_COUNT="1", BENCH_STATE_MB=str(state_mb),
                       BENCH_KILL_MOMENT="before", BENCH_KILL_FILE=str(kill_file), BENCH_MAX_SECONDS="900",
                       OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
            agents = [Agent(h, env, restarts=recoveries + 1) for h in range(2)]
            survivor, host = agents
            wait_for(lambda: warm(survivor.steps(0), host.steps(0)), f"{WARM} equal steps on both", agents,
                     START_TIMEOUT)
            for n in range(1, recoveries + 1):
                time.sleep(pause_s)
                kill_file.touch()
                killed = wait_for(lambda n=n: host.events("killed")[n - 1:n] or None, f"kill {n}", agents,
                                  RECOVER_TIMEOUT)[0]
                times.append(wait_for(lambda k=killed: _recovered(survivor, host, k["t"], k["pid"]),
                                      f"recovery {n}", agents, RECOVER_TIMEOUT)[1])
            wait_for(lambda: survivor.events("recovered")[recoveries - 1:] or None, "the last usage", agents, 10)
    finally:
        for agent in agents:
            agent.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    used = [{k: r[k] for k in ("recoveries", "threads", "fds", "rss_mb")} for r in survivor.events("recovered")]
    return {"soak": recoveries, "state_mb": state_mb, "recovered_s": times, "survivor": used,
            "median_s": sorted(times)[len(times) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mb", type=int, default=10,
                        help="state in MB (parameters + momentum, float32; default %(default)s)")
    parser.add_argument("--moment", default="before", choices=healing_model.MOMENTS,
                        help="where in its step process 1 dies (default %(default)s)")
    parser.add_argument("--round", type=int, default=0, help="the trial's number, for its record (default 0)")
    parser.add_argument("--recoveries", type=int, default=0, metavar="N",
                        help="instead of one trial: N kills of process 1 in one job, the survivor's threads, "
                             "descriptors and memory after each recovery (default: one trial)")
    parser.add_argument("--one-agent", action="store_true",
                        help="one agent --nproc-per-host 2 for both processes (default: one agent per process)")
    args = parser.parse_args()
    if args.recoveries:
        print(json.dumps(run_soak(args.state_mb, args.recoveries)), flush=True)
    else:
        print(json.dumps(run_trial(args.state_mb, args.moment, args.round, args.one_agent)), flush=True)


if __name__ == "__main__":
    main()
