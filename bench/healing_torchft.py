"""The torchft side of bench/healing.py: one trial of torchft 0.2.0 healing a replica group after a SIGKILL.

A Lighthouse (``torchft_lighthouse``, README settings: ``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms
10000``, bound to loopback; ``--heartbeat_timeout_ms`` left at its default 5000 for way ``torchft`` or 1000 for
``torchft-1s``), two replica groups of 1 process (bench/healing_torchft_worker.py in .venv-torchft). Once both
have committed ``WARM`` steps with equal digests, replica 1 is armed and SIGKILLs itself at the chosen moment of its
next step; its replacement starts as soon as the driver sees it die. Measured: from the kill until every replica has
reported the first step after the kill that both report with equal digests (``recovered_s``), whether the survivor
was lost, and what listens beside the job (the Lighthouse; per group its store, manager server and HTTP checkpoint
server) with the Lighthouse's RSS. Every process is started here and killed here, by pid, also after a failure.

    .venv/bin/python bench/healing_torchft.py [--state-mb 10] [--moment before] [--heartbeat-ms 1000]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import healing_model  # noqa: E402
from bench.healing_model import AFTER, RECOVER_TIMEOUT, START_TIMEOUT, WARM, secs, warm  # noqa: E402
from bench.proc_sockets import children_of, listening, rss_mb  # noqa: E402

VENV = ROOT / ".venv-torchft"
PYTHON, LIGHTHOUSE = VENV / "bin" / "python", VENV / "bin" / "torchft_lighthouse"
WORKER = ROOT / "bench" / "healing_torchft_worker.py"
SETUP_HINT = f"the torchft environment {VENV} is missing: run once  bash bench/healing_setup.sh"


def available() -> str | None:
    """None when the torchft environment is there, else how to build it."""
    return None if PYTHON.exists() and LIGHTHOUSE.exists() else SETUP_HINT


class Child:
    """A child process: its stdout JSON lines each stamped on arrival, its stderr's last lines (but INFO logs) kept."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.started = time.time()
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.records: list[dict] = []
        self.err: collections.deque[str] = collections.deque(maxlen=40)
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._err, daemon=True).start()

    def _out(self) -> None:
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                record["arrived"] = time.time()
                self.records.append(record)

    def _err(self) -> None:
        for line in self.process.stderr:
            if " [INFO] " not in line:  # torchft's per-step log lines
                self.err.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def steps(self, after: float = 0.0) -> dict[int, dict]:
        """Committed steps reported at or after ``after`` (worker time), by step."""
        return {r["step"]: r for r in list(self.records) if "step" in r and r["t"] >= after}

    def event(self, name: str) -> dict | None:
        return next((r for r in list(self.records) if r.get("event") == name), None)

    def tail(self, n: int = 6) -> str:
        return " | ".join(list(self.err)[-n:])

    def stop(self) -> None:
        """SIGKILL to this child's pid, and wait for it."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers_of(lighthouse: Child, groups: list[Child]) -> dict:
    """What listens beside the job, by role: the Lighthouse's sockets; per group the store, manager server and HTTP
    checkpoint server (named from the ports its ``servers`` line gave); anything else a group listens on is
    ``pg`` (gloo's own listener: the job's collectives, not beside it)."""
    roles: dict[str, list[str]] = collections.defaultdict(list)
    for address, port in listening(lighthouse.pid):
        roles["lighthouse"].append(f"{address}:{port}")
    for group in groups:
        ports = {}
        if info := group.event("servers"):
            ports = {info["store"]: "store", urlparse(info["manager"]).port: "manager",
                     urlparse(info["checkpoint"]).port: "checkpoint"}
        for address, port in listening(group.pid):
            roles[ports.get(port, "pg")].append(f"{address}:{port}")
    beside = {role: sorted(addresses) for role, addresses in roles.items() if role != "pg"}
    return {"listening": sum(len(a) for a in beside.values()), "by_role": beside, "job_pg": sorted(roles["pg"]),
            "processes": 1 + sum(len(children_of(g.pid)) for g in groups), "process_names": ["torchft_lighthouse"],
            "rss_mb": rss_mb(lighthouse.pid), "group_rss_mb": [rss_mb(g.pid) for g in groups]}


def wait_until(probe, what: str, children: list[Child], timeout: float):
    """``probe()`` once it is not None; TimeoutError naming ``what`` after ``timeout`` or once a child exited."""
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        gone = [c for c in children if not c.alive()]
        if gone or time.monotonic() > deadline:
            why = f"pid {gone[0].pid} exited {gone[0].process.returncode}" if gone else f"not within {timeout:g}s"
            raise TimeoutError(f"{what}: {why}: {' || '.join(c.tail(3) for c in children)[-1200:]}")
        time.sleep(0.005)
    return found


def run_trial(state_mb: int, moment: str, round: int, heartbeat_ms: int | None = None) -> healing_model.TrialResult:
    """One trial (see the module's doc); ``heartbeat_ms`` None: the Lighthouse's default heartbeat timeout."""
    way = "torchft" if heartbeat_ms is None else f"torchft-{heartbeat_ms / 1000:g}s"
    lines = len([line for line in WORKER.read_text().splitlines() if line.rstrip().endswith("# [ft]")])
    result = healing_model.trial_result(way, state_mb, moment, round, lines=lines,
                                        heartbeat_timeout_ms=heartbeat_ms or 5000)
    if missing := available():
        result["error"] = missing
        return result
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="healing-torchft-"))
    kill_file = tmp / "kill"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFT_", "BENCH_", "MASTER_", "PYTHON"))}
    env.update(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", TORCHFT_USE_OTEL="false", BENCH_STATE_MB=str(state_mb),
               BENCH_MAX_SECONDS="400", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    command = [str(LIGHTHOUSE), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1", "--join_timeout_ms", "10000",
               "--quorum_tick_ms", "100"] + (["--heartbeat_timeout_ms", str(heartbeat_ms)] if heartbeat_ms else [])
    children: list[Child] = []

    def group(replica: int, **extra: str) -> Child:
        child = Child([str(PYTHON), str(WORKER)], dict(env, BENCH_REPLICA=str(replica), **extra))
        children.append(child)
        return child

    try:
        lighthouse = Child(command, env)
        children.append(lighthouse)
        survivor = group(0)
        victim = group(1, BENCH_KILL_MOMENT=moment, BENCH_KILL_FILE=str(kill_file))
        wait_until(lambda: warm(survivor.steps(), victim.steps()), f"{WARM} equal steps on both", children,
                   START_TIMEOUT)
        replacement: list[Child] = []

        def replace() -> None:  # the replacement starts as soon as the victim is seen dead
            victim.process.wait()
            replacement.append(group(1))

        threading.Thread(target=replace, daemon=True).start()
        kill_file.touch()
        killed = wait_until(lambda: victim.event("killed") or (None if victim.alive() else {}),
                            "the victim's kill", [lighthouse, survivor], RECOVER_TIMEOUT)
        if not killed:
            raise RuntimeError(f"the victim exited {victim.process.returncode} before its kill: {victim.tail()}")
        t_kill = killed["t"]
        wait_until(lambda: replacement or None, "the replacement's start", [lighthouse], 10)
        new = replacement[0]
        result["replacement_start_s"] = secs(new.started - t_kill)

        def recovered() -> int | None:
            a, b = survivor.steps(t_kill), new.steps(t_kill)
            common = sorted(set(a) & set(b))
            if result["equal"] is None and common:
                result["equal"] = a[common[0]]["digest"] == b[common[0]]["digest"]
                result["first_step"] = common[0]
            return next((s for s in common if a[s]["digest"] == b[s]["digest"]), None)

        try:
            step = wait_until(recovered, "both replicas on an equal step after the kill", [lighthouse, survivor, new],
                              RECOVER_TIMEOUT)
        except TimeoutError as e:
            result["error"] = str(e)
            step = None
        a, b = survivor.steps(t_kill), new.steps(t_kill)
        if step is not None:
            result["recovered_s"] = secs(max(a[step]["t"], b[step]["t"]) - t_kill)
            result["step"] = step
            with contextlib.suppress(TimeoutError):  # the survivor keeps stepping with its new peer
                wait_until(lambda: len([s for s in survivor.steps(t_kill) if s > step]) >= AFTER or None,
                           "steps after recovery", [lighthouse, survivor, new], 30)
        stepped = survivor.steps(t_kill)
        result["survivor_first_step_s"] = (secs(min(r["t"] for r in stepped.values()) - t_kill)
                                           if stepped else None)
        result["survivor_lost"] = not survivor.alive() or not stepped or (
            step is not None and not any(s > step for s in stepped))
        if not survivor.alive():
            result["survivor_exit"] = survivor.process.returncode
            result["survivor_words"] = " | ".join(line.strip() for line in survivor.err if any(
                word in line for word in ("Error", "error", "closed", "assert")))[-1500:]
        if survivor.alive() and new.alive():
            result["servers"] = servers_of(lighthouse, [survivor, new])
    except (TimeoutError, RuntimeError) as e:
        result["error"] = str(e)
    finally:
        for child in children:
            child.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mb", type=int, default=10)
    parser.add_argument("--moment", default="before", choices=healing_model.MOMENTS)
    parser.add_argument("--heartbeat-ms", type=int, default=None)
    parser.add_argument("--round", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(run_trial(args.state_mb, args.moment, args.round, args.heartbeat_ms)), flush=True)


if __name__ == "__main__":
    main()
