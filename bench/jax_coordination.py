"""JAX's coordination served by ifrt's stand-in in every process (``ifrt.jax.initialize(coordination="ifrt")``) side by
side with XLA's own service inside process 0 (``coordination="jax"``), the two ways alternating in one run. Every job
is 4 (or N) JAX CPU processes of ``--devices`` devices (gloo), each running bench/jax_coordination_worker.py: a jitted
sum over all processes' devices per step, one line per step.

    .venv/bin/python bench/jax_coordination.py [--only kill0,failover,restart,startup] [--rounds 10] [--repeat 5]
        [--failover-rounds 2] [--restart-rounds 5] [--devices 1] [--heartbeat-timeouts 1,10]

- ``kill0``: a 4-process job against an ``ifrt-coordinator`` (each of ``--heartbeat-timeouts`` in turn: the coordinator
  declares a killed process failed after its reconnect grace, an eighth of it), process 0 SIGKILLed once
  every process printed step 3; for each survivor the time from the kill until it exited, its exit code, and its
  stderr: ifrt's words (``ifrt: JAX job failed: process 0 ...``) or JAX's C++ abort (SIGABRT, ``Check failure``,
  ``Terminating process``). ``--rounds`` rounds of each way.
- ``failover``: one etcd member (Debian's etcd) and two coordinator replicas (leader TTL 2 s, heartbeat timeout
  3 s); a 4-process job of ``FAILOVER_STEPS`` steps 0.1 s apart; the leader SIGKILLed once every process printed
  step ``FAILOVER_KILL_AT``. Whether every process computed all its steps and exited 0, and the longest gap between
  two steps of a process after the kill (and before it, for scale). Two kinds of job: the computation alone (JAX
  calls its coordination service only for heartbeats and its error poll, which the stand-in answers in-process),
  and with a barrier of JAX's client after every step (``--barrier``: each step is a call through JAX's coordination
  service, i.e. through ifrt's coordinator in the ifrt way). ``--failover-rounds`` rounds of each kind and way (in
  the jax way JAX's service is in process 0 and never talks to ifrt's replicas: run to show that it is unaffected).
- ``restart``: one ``ifrt run --nproc-per-host 4 --max-restarts 1`` agent against an ``ifrt-coordinator``
  (``--heartbeat-timeout 1``); process 0 SIGKILLed once every worker printed step 5 of attempt 0; time until every
  worker of attempt 1 computed its first step, with the attempt-0 survivors' words. ``--restart-rounds`` rounds.
- ``startup``: N = 2 and 4 processes from ``Popen`` to their first cross-process computation (imports included),
  against a coordinator that already serves; ``--repeat`` runs of each way per N; medians.

Prints a JSON object with the machine first, then one per measurement as it is taken and one summary per
measurement kind.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.local import LocalCoordinator  # noqa: E402
from ifrt.errors import JobFailed  # noqa: E402

WORKER = ROOT / "bench" / "jax_coordination_worker.py"
BIN = Path(sys.executable).parent
WAYS = ("ifrt", "jax")
MEASURES = ("kill0", "failover", "restart", "startup")
NUM = 4
START_TIMEOUT = 120.0
"""The longest a job may take to reach the step where it is disturbed, or to recover."""
END_TIMEOUT = 30.0
"""The longest a survivor of kill0 may take to end before it is killed and counted as hung."""
WITHIN_S = 1.0
"""kill0: a round is clean when every survivor ended within this long, in ifrt's words, with JobFailed's code."""
KILL0_AT = 3
FAILOVER_STEPS, FAILOVER_STEP_S, FAILOVER_KILL_AT = 100, 0.1, 30
RESTART_KILL_AT = 5
IFRT_WORDS = re.compile(r"^ifrt: JAX job failed: process 0 ", re.M)
JAX_ABORT_WORDS = ("Terminating process", "Check failure", "SIGABRT")


class Child:
    """A child process whose stdout and stderr lines are each stamped (``time.time()``) when they arrive."""

    def __init__(self, command: list[str], env: dict[str, str], *, merge: bool = False) -> None:
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True)
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.ended: float | None = None
        self._readers = [threading.Thread(target=self._read, args=(self.process.stdout, self.out), daemon=True)]
        if not merge:
            self._readers.append(threading.Thread(target=self._read, args=(self.process.stderr, self.err),
                                                  daemon=True))
        for reader in self._readers:
            reader.start()
        threading.Thread(target=self._wait, daemon=True).start()

    @staticmethod
    def _read(stream, into: list[tuple[float, str]]) -> None:
        for line in stream:
            into.append((time.time(), line.rstrip("\n")))

    def _wait(self) -> None:
        self.process.wait()
        self.ended = time.time()
        for reader in self._readers:
            reader.join(5)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def stderr(self) -> str:
        return "\n".join(line for _, line in list(self.err))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match] | None:
        for t, line in list(self.out):
            if t >= after and (m := re.search(pattern, line)):
                return t, m
        return None

    def stop(self, sig: signal.Signals = signal.SIGKILL, grace: float = 20.0) -> None:
        """Sends ``sig`` to this child's pid (then SIGKILL after ``grace``), and waits for it."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, sig)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def base_env(address: str, devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_", "BENCH_"))}
    env.update(IFRT_COORDINATOR=address, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def start_job(address: str, way: str, devices: int, n: int, *args: str) -> list[Child]:
    """``n`` workers with ids 0..n-1 given (IFRT_PROCESS_ID), one way."""
    env = dict(base_env(address, devices), IFRT_NUM_PROCESSES=str(n))
    return [Child([sys.executable, str(WORKER), "--way", way, *args], dict(env, IFRT_PROCESS_ID=str(p)))
            for p in range(n)]


def wait_for(probe, what: str, children: list[Child], timeout: float = START_TIMEOUT):
    """``probe()`` once it is not None; TimeoutError with the children's last lines after ``timeout``, or once a
    child exited before it held."""
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        exited = [c for c in children if c.returncode is not None]
        if time.monotonic() > deadline or exited:
            why = (f"pid {exited[0].pid} exited {exited[0].returncode} first" if exited else
                   f"not within {timeout:g}s")
            time.sleep(0.3)  # the rest of its output
            tail = " | ".join(line for c in children for _, line in (c.out[-3:] + c.err[-6:]))
            raise TimeoutError(f"{what}: {why}: {tail[-1500:]}")
        time.sleep(0.01)
    return found


def step_seen(child: Child, step: int, attempt: str = r"\S+", process: str = r"\d+") -> tuple[float, re.Match] | None:
    return child.first(rf"step {step} process {process} attempt {attempt} pid (\d+)")


def all_at_step(children: list[Child], step: int) -> bool | None:
    return all(step_seen(c, step) for c in children) or None


# kill0.
def kill0_round(way: str, devices: int, heartbeat: str) -> dict:
    """Process 0 SIGKILLed mid-loop, the coordinator at ``--heartbeat-timeout heartbeat``; how each survivor ended."""
    with LocalCoordinator("--heartbeat-timeout", heartbeat, num_processes=NUM, log_level="WARNING") as coordinator:
        job = start_job(coordinator.address, way, devices, NUM, "--steps", "0", "--max-seconds", "90")
        try:
            wait_for(lambda: all_at_step(job, KILL0_AT), f"every process at step {KILL0_AT}", job)
            killed = time.time()
            os.kill(job[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + END_TIMEOUT
            while any(c.ended is None for c in job[1:]) and time.monotonic() < deadline:
                time.sleep(0.005)
            hung = [c.pid for c in job[1:] if c.ended is None]
            for c in job[1:]:
                c.stop()
            time.sleep(0.2)  # the readers' last lines
            survivors = [survivor(p, c, killed, hung) for p, c in enumerate(job) if p > 0]
        except TimeoutError as e:
            return {"measure": "kill0", "way": way, "heartbeat_timeout_s": heartbeat, "error": str(e)}
        finally:
            for c in job:
                c.stop()
    ok = all(s["end_s"] <= WITHIN_S and s["ifrt_words"] and not s["sigabrt"] and s["exit_code"] == JobFailed.exit_code
             for s in survivors)
    return {"measure": "kill0", "way": way, "heartbeat_timeout_s": heartbeat, "survivors": survivors,
            "last_end_s": max(s["end_s"] for s in survivors), "clean": ok}


def survivor(process: int, child: Child, killed: float, hung: list[int]) -> dict:
    """How one survivor of kill0 ended: when, its exit code, and whose words its stderr has."""
    err = child.stderr()
    lines = err.splitlines()
    said = next((line for line in lines if IFRT_WORDS.match(line)), None)
    jax_said = next((line[line.index("Terminating process"):] for line in lines if "Terminating process" in line),
                    None)
    return {"process": process, "end_s": round((child.ended or time.time()) - killed, 3),
            "exit_code": child.returncode, "hung": child.pid in hung, "ifrt_words": said is not None,
            "sigabrt": child.returncode == -signal.SIGABRT, "jax_abort_words": any(w in err for w in JAX_ABORT_WORDS),
            "words": (said or jax_said or (lines[-1] if lines else ""))[:160]}


def kill0_summary(results: list[dict]) -> Iterator[dict]:
    for heartbeat, way in sorted({(r["heartbeat_timeout_s"], r["way"]) for r in results}):
        mine = [r for r in results if r["way"] == way and r["heartbeat_timeout_s"] == heartbeat]
        done = [r for r in mine if "error" not in r]
        ends = [s["end_s"] for r in done for s in r["survivors"]]
        codes: dict[str, int] = {}
        for r in done:
            for s in r["survivors"]:
                codes[str(s["exit_code"])] = codes.get(str(s["exit_code"]), 0) + 1
        yield {"measure": "kill0_summary", "way": way, "heartbeat_timeout_s": heartbeat, "rounds": len(mine),
               "failed_rounds": len(mine) - len(done),
               "survivors": len(ends),
               "end_s_max": max(ends) if ends else None,
               "end_s_median": round(statistics.median(ends), 3) if ends else None,
               "last_end_s_median": round(statistics.median(r["last_end_s"] for r in done), 3) if done else None,
               "clean_rounds": sum(r["clean"] for r in done),
               "clean_fraction": round(sum(r["clean"] for r in done) / len(mine), 3),
               "survivors_in_ifrt_words": sum(s["ifrt_words"] for r in done for s in r["survivors"]),
               "survivors_sigabrt": sum(s["sigabrt"] for r in done for s in r["survivors"]),
               "survivors_jax_abort_words": sum(s["jax_abort_words"] for r in done for s in r["survivors"]),
               "exit_codes": codes}


# failover.
def failover_round(etcd, way: str, barrier: bool, devices: int) -> dict:
    """The leader replica SIGKILLed mid-job: did every process go on to its last step? ``barrier``: every step also
    calls JAX's coordination service (a barrier of JAX's client)."""
    from tests.replicas import Replicas

    with Replicas(etcd, num_processes=NUM, cluster_id=f"bench-{uuid.uuid4().hex[:8]}", heartbeat="3") as replicas:
        job = start_job(replicas.addresses, way, devices, NUM, "--steps", str(FAILOVER_STEPS), "--step-seconds",
                        str(FAILOVER_STEP_S), *(["--barrier"] if barrier else []))
        try:
            wait_for(lambda: all_at_step(job, FAILOVER_KILL_AT), f"every process at step {FAILOVER_KILL_AT}", job)
            killed = time.time()
            replicas.kill_leader()  # returns once the standby serves
            serving = time.time()
            deadline = time.monotonic() + START_TIMEOUT
            while any(c.ended is None for c in job) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
        except TimeoutError as e:
            return {"measure": "failover", "way": way, "barrier": barrier, "error": str(e)}
        finally:
            for c in job:
                c.stop()
    processes = []
    for p, c in enumerate(job):
        stamps = [(int(m.group(1)), float(m.group(2))) for _, line in c.out
                  if (m := re.match(r"step (\d+) process \d+ attempt \S+ pid \d+ value \S+ t ([\d.]+)", line))]
        gaps_after = [b - a for (_, a), (_, b) in itertools.pairwise(stamps) if b > killed]
        gaps_before = [b - a for (_, a), (_, b) in itertools.pairwise(stamps) if b <= killed]
        err = c.stderr()
        processes.append({"process": p, "exit_code": c.returncode, "last_step": stamps[-1][0] if stamps else 0,
                          "max_gap_after_kill_s": round(max(gaps_after, default=0.0), 3),
                          "max_gap_before_kill_s": round(max(gaps_before, default=0.0), 3),
                          "restored_s": next((round(t - killed, 3) for t, line in c.err if t >= killed
                                              and "session with coordinator" in line and "restored" in line), None),
                          "failure_words": next((line[:200] for line in err.splitlines() if "job failed" in line
                                                 or any(w in line for w in JAX_ABORT_WORDS)), None)})
    finished = all(p["exit_code"] == 0 and p["last_step"] == FAILOVER_STEPS for p in processes)
    return {"measure": "failover", "way": way, "barrier": barrier, "steps": FAILOVER_STEPS,
            "killed_at_step": FAILOVER_KILL_AT,
            "standby_serving_s": round(serving - killed, 3), "all_finished": finished,
            "sessions_restored_s": max((p["restored_s"] for p in processes if p["restored_s"] is not None),
                                       default=None),
            "max_gap_after_kill_s": max(p["max_gap_after_kill_s"] for p in processes),
            "max_gap_before_kill_s": max(p["max_gap_before_kill_s"] for p in processes), "processes": processes}


def failover_summary(results: list[dict]) -> Iterator[dict]:
    for barrier, way in itertools.product((False, True), WAYS):
        mine = [r for r in results if r["way"] == way and r["barrier"] == barrier]
        if not mine:
            continue
        done = [r for r in mine if "error" not in r]
        yield {"measure": "failover_summary", "way": way, "barrier": barrier, "rounds": len(mine),
               "all_finished_rounds": sum(r["all_finished"] for r in done),
               "max_gap_after_kill_s": [r["max_gap_after_kill_s"] for r in done],
               "max_gap_before_kill_s": [r["max_gap_before_kill_s"] for r in done],
               "standby_serving_s": [r["standby_serving_s"] for r in done],
               "sessions_restored_s": [r["sessions_restored_s"] for r in done]}


# restart.
def restart_round(way: str, devices: int) -> dict:
    """Process 0 SIGKILLed under ``ifrt run``: time until every worker of the next attempt computes."""
    with LocalCoordinator("--heartbeat-timeout", "1", num_processes=NUM, log_level="WARNING") as coordinator:
        env = base_env(coordinator.address, devices)
        agent = Child([str(BIN / "ifrt"), "run", "--nproc-per-host", str(NUM), "--max-restarts", "1",
                       "--grace-seconds", "2", "--", sys.executable, str(WORKER), "--way", way, "--steps", "0",
                       "--max-seconds", "120"], env, merge=True)
        try:
            for p in range(NUM):
                wait_for(lambda p=p: step_seen(agent, RESTART_KILL_AT, "0", str(p)),
                         f"process {p} at step {RESTART_KILL_AT}", [agent])
            victim = step_seen(agent, RESTART_KILL_AT, "0", "0")
            assert victim is not None
            killed = time.time()
            os.kill(int(victim[1].group(1)), signal.SIGKILL)
            firsts = [wait_for(lambda p=p: agent.first(rf"step \d+ process {p} attempt 1 pid ", killed),
                               f"process {p}'s first step of attempt 1", [agent])[0] for p in range(NUM)]
            starts = [wait_for(lambda p=p: agent.first(rf"started process {p} way \S+ attempt 1 pid \d+ imports "
                                                       r"([\d.]+)s start ([\d.]+)s", killed),
                               f"process {p}'s start line", [agent]) for p in range(NUM)]
            detected = wait_for(lambda: agent.first(r"ifrt run: .*failed", killed), "the agent's failure line",
                                [agent])[0]
            began = wait_for(lambda: agent.first(r"ifrt run: attempt 1 started", killed), "attempt 1", [agent])[0]
        except TimeoutError as e:
            return {"measure": "restart", "way": way, "error": str(e)}
        finally:
            agent.stop(signal.SIGTERM)
    between = [line for t, line in agent.out if killed <= t <= began]
    computing = max(firsts) - killed
    imports = max(float(m.group(1)) for _, m in starts)
    return {"measure": "restart", "way": way, "computing_again_s": round(computing, 3),
            "detection_s": round(detected - killed, 3), "new_attempt_s": round(began - killed, 3),
            "imports_s": round(imports, 3), "runtime_start_s": round(max(float(m.group(2)) for _, m in starts), 3),
            "all_started_s": round(max(t for t, _ in starts) - killed, 3),
            "first_step_s": round(max(firsts) - max(t for t, _ in starts), 3),
            "without_imports_s": round(computing - imports, 3),
            "attempt0_ifrt_words": said(between, r"ifrt: JAX job failed: process 0 "),
            "attempt0_jax_abort": said(between, "Terminating process"),
            "agent_failure_line": next((line[:200] for t, line in agent.out if t >= killed
                                        and re.search(r"ifrt run: .*failed", line)), None)}


def said(lines: list[str], pattern: str) -> list[int]:
    """The processes whose lines (as ``ifrt run`` prefixes them: ``[<process id>] ``) match ``pattern``."""
    return sorted({int(m.group(1)) for line in lines if re.search(pattern, line)
                   and (m := re.match(r"\[(\d+)\] ", line))})


def restart_summary(results: list[dict]) -> Iterator[dict]:
    for way in WAYS:
        mine = [r for r in results if r["way"] == way]
        if not mine:
            continue
        done = [r for r in mine if "error" not in r]
        summary: dict = {"measure": "restart_summary", "way": way, "rounds": len(mine),
                         "failed_rounds": len(mine) - len(done)}
        for key in ("computing_again_s", "detection_s", "new_attempt_s", "imports_s", "runtime_start_s",
                    "all_started_s", "first_step_s", "without_imports_s"):
            values = [r[key] for r in done]
            summary[f"{key}_median"] = round(statistics.median(values), 3) if values else None
        summary["computing_again_s"] = [r["computing_again_s"] for r in done]
        summary["attempt0_jax_abort_rounds"] = sum(bool(r["attempt0_jax_abort"]) for r in done)
        yield summary


# startup.
def startup_run(way: str, n: int, devices: int) -> dict:
    """``n`` fresh processes, from Popen to their first cross-process computation."""
    with LocalCoordinator(num_processes=n, log_level="WARNING") as coordinator:
        env = dict(base_env(coordinator.address, devices), IFRT_NUM_PROCESSES=str(n))
        job = []
        for p in range(n):
            job.append(Child([sys.executable, str(WORKER), "--way", way, "--startup"],
                             dict(env, IFRT_PROCESS_ID=str(p), BENCH_SPAWNED_AT=repr(time.time()))))
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while any(c.ended is None for c in job) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)
            bad = [c for c in job if c.returncode != 0]
            if bad:
                return {"measure": "startup", "way": way, "processes": n,
                        "error": f"pid {bad[0].pid} exited {bad[0].returncode}: {bad[0].stderr()[-1500:]}"}
            timings = [json.loads(c.out[-1][1]) for c in job]
        finally:
            for c in job:
                c.stop()
    return {"measure": "startup", "way": way, "processes": n, "devices_per_process": devices,
            "job_ready_s": round(max(t["to_first_computation_s"] for t in timings), 3),
            **{key: round(statistics.mean(t[key] for t in timings), 3)
               for key in ("interpreter_s", "import_s", "initialize_s", "first_computation_s")}}


def startup_summary(results: list[dict]) -> Iterator[dict]:
    for n in sorted({r["processes"] for r in results}):
        medians = {}
        for way in WAYS:
            done = [r for r in results if r["processes"] == n and r["way"] == way and "error" not in r]
            if done:
                medians[way] = {key: round(statistics.median(r[key] for r in done), 3)
                                for key in ("job_ready_s", "interpreter_s", "import_s", "initialize_s",
                                            "first_computation_s")}
                medians[way]["runs"] = len(done)
        ifrt = [r for r in results if r["processes"] == n and r["way"] == "ifrt"]
        jax = [r for r in results if r["processes"] == n and r["way"] == "jax"]
        paired = [i["job_ready_s"] - j["job_ready_s"] for i, j in zip(ifrt, jax, strict=False)
                  if "error" not in i and "error" not in j]
        yield {"measure": "startup_summary", "processes": n, "medians": medians,
               "ifrt_minus_jax_job_ready_s": round(statistics.median(paired), 3) if paired else None}


def machine() -> dict:
    import jax
    import jaxlib

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    from tests.etcd_cluster import etcd_binary

    binary = etcd_binary()
    etcd = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.split("\n")[0] \
        if binary else None
    return {"measure": "machine", "cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "etcd": etcd, "load_average": os.getloadavg()}


def emit(result: dict) -> dict:
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(MEASURES), help="measurements to run (default %(default)s)")
    p.add_argument("--rounds", type=int, default=10, help="kill0 rounds per way (default %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="startup runs per way and N (default %(default)s)")
    p.add_argument("--failover-rounds", type=int, default=2,
                   help="failover rounds per kind and way (default %(default)s)")
    p.add_argument("--restart-rounds", type=int, default=5, help="restart rounds per way (default %(default)s)")
    p.add_argument("--heartbeat-timeouts", default="1,10",
                   help="kill0: the coordinator's --heartbeat-timeout, each in turn (its reconnect grace, an eighth "
                        "of it, is when it declares a killed process failed; 10 is its default) (default %(default)s)")
    p.add_argument("--devices", type=int, default=1, help="CPU devices per process (default %(default)s)")
    p.add_argument("--ways", default=",".join(WAYS), help="ways to run (default %(default)s)")
    args = p.parse_args()
    only = [m for m in args.only.split(",") if m]
    unknown = set(only) - set(MEASURES)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; expected some of {','.join(MEASURES)}")
    ways = [w for w in args.ways.split(",") if w]
    emit(machine())
    began = time.monotonic()
    if "kill0" in only:
        results = [emit(kill0_round(way, args.devices, heartbeat)) for heartbeat in args.heartbeat_timeouts.split(",")
                   for _ in range(args.rounds) for way in ways]
        for summary in kill0_summary(results):
            emit(summary)
    if "failover" in only:
        from tests.etcd_cluster import EtcdCluster

        with tempfile.TemporaryDirectory(prefix="ifrt-bench-etcd-") as tmp, \
                EtcdCluster.start(1, tmp_path=Path(tmp)) as etcd:
            results = [emit(failover_round(etcd, way, barrier, args.devices)) for _ in range(args.failover_rounds)
                       for barrier in (False, True) for way in ways]
        for summary in failover_summary(results):
            emit(summary)
    if "restart" in only:
        results = [emit(restart_round(way, args.devices)) for _ in range(args.restart_rounds) for way in ways]
        for summary in restart_summary(results):
            emit(summary)
    if "startup" in only:
        results = [emit(startup_run(way, n, args.devices)) for n in (2, 4) for _ in range(args.repeat)
                   for way in ways]
        for summary in startup_summary(results):
            emit(summary)
    emit({"measure": "done", "wall_s": round(time.monotonic() - began, 1), "load_average": os.getloadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
