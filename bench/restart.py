"""Restart after a failure: from a SIGKILL of one worker to every worker computing again (the first step of the new
attempt), 4 workers as 2 hosts of 2 on loopback, the same training loop (examples/train_checkpoint.py) four ways:

- ifrt-jax / ifrt-torch: two ``ifrt run --nproc-per-host 2 --host-rank H --num-hosts 2 --max-restarts 1``
  agents against an ``ifrt-coordinator`` that already serves (``--heartbeat-timeout 1``), ``--runtime jax|torch``;
- torchrun: two ``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
  --rdzv-id bench --max-restarts 1`` agents, ``--runtime torchrun`` (plain ``torch.distributed``), with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: by default (torch >= 2.5) the workers of every restart share one
  TCPStore held by the first agent, and the restarted workers' gloo read the previous round's addresses from it
  (connection refused until the restarts run out; pytorch/pytorch#135712); with it, each round's rank 0 worker
  holds a new store;
- ifrt-torch-replace: the same agents with ``--recover replace`` and ``--runtime torch-recover``: only process 3
  is started anew (same id); the survivors keep running, re-form their group in place (``ifrt.torch.recover``) and
  every process takes the most advanced state from a peer;
- ifrt-torch-spare: ifrt-torch-replace with ``--spare 1`` on each agent: process 3's replacement is the agent's
  warm spare (started, torch imported, waiting inside ``ifrt.torch.init_process_group``), handed the id at once; the
  process is killed once both spares wait;
- jax-alone: four processes of ``--runtime jax`` without an agent: no restart; the time until the three survivors
  have exited (ifrt's fail fast).

    .venv/bin/python bench/restart.py [--repeat 3] [--workers 4|8]
        [--ways ifrt-jax,ifrt-torch,ifrt-torch-replace,ifrt-torch-spare,torchrun,jax-alone]

``--workers 8``: 4 agents (hosts) of 2 workers (torchrun: 4 nodes; jax-alone: 8 processes), to show what the
survivors pay does not grow with the job.

Process 3 (on the second host) is killed once every process printed step 5. Every line of the agents and workers is
stamped when it arrives; the phases of a restart: detection (kill -> the agent's line naming the failure), stopping
(-> the agent asks for the next attempt; torchrun: every agent has stopped its workers and joins the next
rendezvous round), agreement (-> the new attempt starts in every agent; torchrun: the round is complete and every
agent starts its workers), discovery and runtime start (-> the last worker's start line; its imports apart, as the
worker measured them), first step (-> the last worker's first step). For ifrt-torch-replace: detection (-> the
agent's line naming the failure), decision (-> the agent starts the new worker), the newcomer's start (-> its start
line, its imports apart), the group re-formed (-> the last survivor's ``recovered`` line), first step (-> the last
worker's first step after it); ifrt-torch-spare the same, the decision ending at the agent's hand-off to its spare
and the newcomer's imports done before the kill (``imports_s`` 0: not paid). Prints one JSON object per run, then one
with the medians per way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.local import LocalCoordinator  # noqa: E402

TRAIN = ROOT / "examples" / "train_checkpoint.py"
BIN = Path(sys.executable).parent
WAYS = ("ifrt-jax", "ifrt-torch", "ifrt-torch-replace", "ifrt-torch-spare", "torchrun", "jax-alone")
REPLACING = ("ifrt-torch-replace", "ifrt-torch-spare")
VICTIM, KILL_AT, STEPS = 3, 5, 400
WORKERS = 4
"""The job's processes, 2 per host (``--workers``)."""
TIMEOUT = 120.0


class Lines:
    """A child's output lines (stdout and stderr), each with the wall-clock time it arrived."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        stdin=subprocess.DEVNULL)
        self.lines: list[tuple[float, str]] = []
        self.ended: float | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.lines.append((time.time(), line.rstrip("\n")))
        self.process.wait()
        self.ended = time.time()

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match] | None:
        for t, line in list(self.lines):
            if t >= after and (m := re.search(pattern, line)):
                return t, m
        return None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    return env


COLLECTIVE_TIMEOUT = 2.0
"""``--collective-timeout`` of the torch-recover loop (``--collective-timeout``)."""


def train(runtime: str, checkpoints: str) -> list[str]:
    timeout = ["--collective-timeout", str(COLLECTIVE_TIMEOUT)] if runtime == "torch-recover" else []
    return [str(TRAIN), "--runtime", runtime, "--checkpoint-dir", checkpoints, "--steps", str(STEPS),
            "--step-seconds", "0.05", *timeout]


def start(way: str, address: str, checkpoints: str) -> list[Lines]:
    env = base_env()
    if way.startswith("ifrt-"):
        env.update(IFRT_COORDINATOR=address)
        replace = way in REPLACING
        runtime = "torch-recover" if replace else way.removeprefix("ifrt-")
        flags = [*(["--recover", "replace"] if replace else []),
                 *(["--spare", "1"] if way == "ifrt-torch-spare" else [])]
        return [Lines([str(BIN / "ifrt"), "run", "--nproc-per-host", "2", "--host-rank", str(h), "--num-hosts",
                       str(WORKERS // 2), "--max-restarts", "1", "--grace-seconds", "2", *flags,
                       "--", sys.executable, *train(runtime, checkpoints)], env) for h in range(WORKERS // 2)]
    if way == "torchrun":  # as torchrun's docs start a 2-node job: the same command on every node
        env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO")  # INFO: its agents' phase lines
        return [Lines([str(BIN / "torchrun"), "--nnodes", str(WORKERS // 2), "--nproc-per-node", "2",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", address, "--rdzv-id", "bench",
                       "--max-restarts", "1", "--tee", "3",
                       *train("torchrun", checkpoints)], env)
                for _ in range(WORKERS // 2)]
    env.update(IFRT_COORDINATOR=address)
    return [Lines([sys.executable, *train("jax", checkpoints)], dict(env, IFRT_PROCESS_ID=str(p),
                                                                        IFRT_NUM_PROCESSES=str(WORKERS)))
            for p in range(WORKERS)]


# The agents' lines that end each phase, by way: (the failure seen, the workers stopped, the new attempt starts).
_IFRT_LINES = (r"ifrt run: .*failed", r"ifrt run: asking the coordinator", r"ifrt run: attempt 1 started")
PHASE_LINES = {"ifrt-jax": _IFRT_LINES, "ifrt-torch": _IFRT_LINES,
               "torchrun": (r"failed \(exitcode", r"Rendezvous'ing worker group", r"Starting worker group")}


def step_pattern(process: int | str, step: int | str, attempt: str) -> str:
    return rf"step {step} process {process} attempt {attempt} pid (\d+)"


def one_run(way: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ifrt-bench-restart-") as checkpoints, contextlib.ExitStack() as stack:
        if way == "torchrun":  # torchrun's c10d store listens in its first agent; no coordinator
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                address = f"127.0.0.1:{s.getsockname()[1]}"
            log = no_log  # no coordinator: its phases come from the agents' lines
        else:
            coordinator = stack.enter_context(LocalCoordinator(
                "--heartbeat-timeout", "1", num_processes=WORKERS, log_level="INFO" if way in REPLACING else "WARNING"))
            address, log = coordinator.address, lambda: coordinator.log
        children = start(way, address, checkpoints)
        try:
            return measure(way, children, log)
        except TimeoutError as e:  # reported as this run's result: the job did not recover
            return {"way": way, "error": str(e).splitlines()[0]}
        finally:
            for child in children:
                child.stop()


def find(children: list[Lines], pattern: str, after: float = 0.0) -> tuple[float, re.Match] | None:
    """The earliest line of any child matching ``pattern`` (arrived after ``after``)."""
    found = [f for c in children if (f := c.first(pattern, after)) is not None]
    return min(found, key=lambda f: f[0]) if found else None


def wait_for(probe, what: str, children: list[Lines]):
    deadline = time.monotonic() + TIMEOUT
    while (found := probe()) is None:
        if time.monotonic() > deadline:
            tail = "\n".join(line for c in children for _, line in c.lines[-15:])
            raise TimeoutError(f"{what} did not happen within {TIMEOUT}s:\n{tail}")
        time.sleep(0.01)
    return found


def no_log() -> str:
    return ""


def measure(way: str, children: list[Lines], log=no_log) -> dict:
    first_attempt = "0" if way != "jax-alone" else "-"
    for p in range(WORKERS):
        wait_for(lambda p=p: find(children, step_pattern(p, KILL_AT, first_attempt)),
                 f"process {p} at step {KILL_AT}", children)
    if way == "ifrt-torch-spare":
        wait_for(lambda: spares_waiting(children), "every agent's spare waiting", children)
    victim = find(children, step_pattern(VICTIM, KILL_AT, first_attempt))
    assert victim is not None
    killed = time.time()
    os.kill(int(victim[1].group(1)), signal.SIGKILL)
    if way == "jax-alone":
        wait_for(lambda: all(c.ended for i, c in enumerate(children) if i != VICTIM) or None,
                 "the survivors' exits", children)
        exited = max(c.ended for i, c in enumerate(children) if i != VICTIM) - killed
        return {"way": way, "survivors_exited_s": round(exited, 3),
                "exit_codes": [c.process.returncode for i, c in enumerate(children) if i != VICTIM]}
    if way in REPLACING:
        return measure_replace(way, children, killed, log)
    old = {find(children, step_pattern(p, KILL_AT, first_attempt))[1].group(1)  # type: ignore[index]
           for p in range(WORKERS)}
    later = r"\S+"  # torchrun's restart count differs between its agents: a new attempt is a new pid

    def new_run(pattern: str) -> tuple[float, re.Match] | None:
        found = [(t, m) for c in children for t, line in list(c.lines)
                 if t >= killed and (m := re.search(pattern, line)) and m.group("pid") not in old]
        return min(found, key=lambda f: f[0]) if found else None

    firsts = [wait_for(lambda p=p: new_run(rf"step \d+ process {p} attempt \S+ pid (?P<pid>\d+)"),
                       f"process {p}'s first step of the next attempt", children) for p in range(WORKERS)]
    computing = max(t for t, _ in firsts) - killed
    result: dict = {"way": way, "computing_again_s": round(computing, 3)}
    starts = [wait_for(lambda p=p: new_run(rf"started process {p} attempt {later} pid (?P<pid>\d+) imports ([\d.]+)s"),
                       f"process {p}'s start line", children) for p in range(WORKERS)]
    imports = max(float(m.group(2)) for _, m in starts)
    result["imports_s"] = round(imports, 3)
    result["without_imports_s"] = round(computing - imports, 3)
    if way in PHASE_LINES:
        failed, stopped, begins = PHASE_LINES[way]
        detected = wait_for(lambda: find(children, failed, killed), "detection", children)[0]
        if way == "torchrun":  # every agent has stopped its workers and joins the next rendezvous round
            asked = max(wait_for(lambda c=c: c.first(stopped, killed), "stopping", children)[0] for c in children)
        else:  # the first agent asks; the coordinator decides for all
            asked = wait_for(lambda: find(children, stopped, killed), "asking", children)[0]
        began = max(wait_for(lambda c=c: c.first(begins, killed), "the new attempt", children)[0] for c in children)
        started = max(t for t, _ in starts)
        result.update(detection_s=round(detected - killed, 3), stopping_s=round(asked - detected, 3),
                      agreement_s=round(began - asked, 3),
                      discovery_and_runtime_start_s=round(started - began - imports, 3),
                      first_step_s=round(killed + computing - started, 3))
    return result


def spares_waiting(children: list[Lines]) -> bool | None:
    """Whether every agent's spare waits for a process (blocked reading the hand-off on its stdin), None if not."""
    pids = [found[1].group(1) for c in children if (found := c.first(r"ifrt run: spare 0 started \(pid (\d+)\)"))]
    if len(pids) < len(children):
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/wchan") as f:
                if "pipe_read" not in f.read():
                    return None
        except OSError:
            return None
    return True


def logged_at(log: str, pattern: str, since: float) -> float | None:
    """When the coordinator logged its first line matching ``pattern`` at or after ``since`` (its local time, to
    the millisecond: ``2026-11-26 13:15:41,873 INFO ...``)."""
    for line in log.splitlines():
        stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", line)
        if stamp and re.search(pattern, line):
            at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1000
            if at >= since - 0.001:
                return at
    return None


def measure_replace(way: str, children: list[Lines], killed: float, log) -> dict:
    """``--recover replace`` (with a warm spare for ifrt-torch-spare): the phases from the kill until every worker
    computes again, the survivors in the same processes."""
    def after(pattern: str, since: float, what: str) -> tuple[float, re.Match]:
        return wait_for(lambda: find(children, pattern, since), what, children)

    spare = way == "ifrt-torch-spare"
    detected = after(r"ifrt run: worker \d+ \(process 3\) failed", killed, "detection")[0]
    decision = r"ifrt run: handing process 3 \S+ rank \d+\) to spare" if spare else \
        r"ifrt run: starting a new worker for process 3"
    decided = after(decision, killed, "the decision")[0]
    registered = wait_for(lambda: logged_at(log(), r"process 3 \(.*\) restarted \(incarnation", killed),
                          "the newcomer's registration", children)
    started, newcomer = after(r"started process 3 attempt \S+ pid (\d+) imports ([\d.]+)s", killed, "the newcomer")
    imports = 0.0 if spare else float(newcomer.group(2))  # a spare imported before the kill
    survivors = [p for p in range(WORKERS) if p != VICTIM]
    recovered = {p: after(rf"recovered process {p} ", killed, f"process {p}'s recovery")[0] for p in survivors}
    firsts = [after(rf"step \d+ process {p} attempt \S+ pid ", recovered.get(p, started),
                    f"process {p}'s first step")[0] for p in range(WORKERS)]
    computing = max(firsts) - killed
    reformed = max(recovered.values())
    return {"way": way, "computing_again_s": round(computing, 3), "imports_s": round(imports, 3),
            "without_imports_s": round(computing - imports, 3), "detection_s": round(detected - killed, 3),
            "decision_s": round(decided - detected, 3),
            "newcomer_registered_s": round(registered - decided - imports, 3),
            "newcomer_start_s": round(started - decided - imports, 3),
            "reformed_s": round(reformed - killed, 3), "first_step_s": round(killed + computing - reformed, 3)}


def main() -> int:
    global WORKERS, COLLECTIVE_TIMEOUT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--workers", type=int, choices=(4, 8), default=WORKERS,
                   help="the job's processes, 2 per host (default %(default)s)")
    p.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT, metavar="SECONDS",
                   help="how long a survivor's collective waits for its peers under --recover replace (default "
                        "%(default)s): with gloo it bounds when a survivor not connected to the dead process returns")
    args = p.parse_args()
    WORKERS, COLLECTIVE_TIMEOUT = args.workers, args.collective_timeout
    ways = [w for w in args.ways.split(",") if w]
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    for _ in range(args.repeat):
        for way in ways:
            result = one_run(way)
            runs[way].append(result)
            print(json.dumps(result), flush=True)
    medians = {}
    for way, results in runs.items():
        done = [r for r in results if "error" not in r]
        medians[way] = {key: round(statistics.median(r[key] for r in done), 3) for key in (done or [{}])[0]
                        if isinstance(done[0][key], float)}
        medians[way]["failed_runs"] = len(results) - len(done)
    print(json.dumps({"medians": medians, "repeat": args.repeat, "workers": WORKERS,
                      "collective_timeout": COLLECTIVE_TIMEOUT, "cpus": os.cpu_count()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
