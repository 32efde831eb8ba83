"""The job of bench/failover_soak.py through real ``ifrt run`` agents (``--link agent``): one agent per host
(``--recover replace``, ``--worker-link agent``), each starting its host's bench/soak_worker.py workers, whose records
and commands are files (``soak_worker.py --control``); a worker killed and replaced in place by its agent; an agent
SIGKILLed (its workers must be gone within a second) and started again for its host, which takes its processes back.
Every process is signalled by its own pid."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from soak_processes import WORKER, Records, alive

IFRT = Path(sys.executable).parent / "ifrt"
OUTLIVE_S = 1.0
"""A worker still running this long after its agent's SIGKILL outlived it."""
PREFIX = re.compile(r"^\[(?:local )?\d+\] ")
"""What an agent puts before each line of a worker's output."""
GONE_WAIT_S = 5.0
"""How long the soak watches a killed agent's workers before it kills what is left of them itself."""


class FileWorker(Records):
    """One incarnation of a worker under an agent: the records file it writes, read as it grows (every 50 ms), and
    the commands file of its process id, which it reads from its own start on."""

    def __init__(self, control: Path, process_id: int, pid: int) -> None:
        super().__init__(process_id)
        self.pid = pid
        self.path = control / f"rec-{process_id}-{pid}.jsonl"
        self.commands = control / f"cmd-{process_id}.txt"
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._tail, daemon=True)
        self._reader.start()

    def _tail(self) -> None:
        offset, pending = 0, b""
        while True:
            closing = self._closed.is_set()
            with self.path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                try:
                    self.add(json.loads(line))
                except ValueError:  # a line cut short by a kill
                    continue
            if closing:
                return
            if not chunk:
                self._closed.wait(0.05)

    def running(self) -> bool:
        return alive(self.pid)

    def send(self, line: str) -> None:
        with self.commands.open("a") as f:
            f.write(line + "\n")

    def kill(self) -> None:
        """SIGKILL by its pid (it is its agent's child, not the soak's), and waits until it is gone."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        gone_within(self.pid, 30)

    def end(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for it to exit, then kills it; its records read to the end."""
        if not gone_within(self.pid, timeout):
            self.kill()
        self.close()

    def close(self) -> None:
        self._closed.set()
        self._reader.join(5)

    def describe(self) -> str:
        return self.path.read_text()[-2000:]


def gone_within(pid: int, timeout: float) -> bool:
    """Whether ``pid`` stopped running within ``timeout`` seconds (polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's), from /proc."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return sorted(set(found))


class HostAgent:
    """``ifrt run`` for one host of the job, a child of the soak; its output and its workers' go to ``log``. The
    agents share this machine's hostname and address and are told apart by their host rank, as bench/agents_real.py
    runs them, or with ``--own-hostnames`` each has a hostname of its own (``soak-host-H``), as separate hosts do."""

    def __init__(self, host: int, args: argparse.Namespace, control: Path, env: dict[str, str], log: Path) -> None:
        self.host = host
        command = [str(IFRT), "run", "--nproc-per-host", str(args.workers_per_host), "--host-rank", str(host),
                   "--num-hosts", str(args.hosts), "--recover", "replace", "--max-restarts", str(args.max_restarts),
                   "--replace-timeout", "900", "--grace-seconds", "1", "--worker-link", "agent",
                   "--", sys.executable, str(WORKER), "--control", str(control), "--threads", str(args.threads),
                   "--keys", str(args.keys), "--seed", str(args.seed), "--op-timeout", str(args.op_timeout)]
        if args.own_hostnames:  # a UTS namespace of its own, as tests/test_spare_host.py gives its hosts
            command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"soak-host-{host}", *command]
        with log.open("ab") as out:  # unshare and sh exec in turn: the pid is the agent's
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT)
        self.pid = self.process.pid

    def kill(self) -> dict[str, Any]:
        """SIGKILLs the agent by its pid and watches its workers (its children a moment before) until each is gone:
        how long each took, and how many outlived it past ``OUTLIVE_S`` (those still running after ``GONE_WAIT_S``
        are killed here, by pid, so that the job can go on)."""
        workers = children(self.pid)
        began = time.monotonic()
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait()
        gone: dict[int, float | None] = dict.fromkeys(workers)
        while any(v is None for v in gone.values()) and time.monotonic() < began + GONE_WAIT_S:
            for pid in [p for p, v in gone.items() if v is None]:
                if not alive(pid):
                    gone[pid] = time.monotonic() - began
            time.sleep(0.005)
        for pid in [p for p, v in gone.items() if v is None]:
            os.kill(pid, signal.SIGKILL)
        seconds = [v for v in gone.values() if v is not None]
        return {"host": self.host, "agent_pid": self.pid, "workers": len(workers), "killed_at": round(began, 3),
                "gone_s_max": round(max(seconds), 3) if seconds else None,
                "outlived_s": sum(v is None or v > OUTLIVE_S for v in gone.values())}

    def stop(self, timeout: float) -> None:
        """SIGTERM (passed on to its workers), then SIGKILL after ``timeout`` seconds; its workers end with it."""
        workers = children(self.pid)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in workers:
            if not gone_within(pid, 2.0):
                os.kill(pid, signal.SIGKILL)


class AgentJob:
    """``--hosts`` agents of ``--workers-per-host`` workers each, process ids ``host * W + local rank``; the current
    incarnation of each process id, and every incarnation there was."""

    def __init__(self, args: argparse.Namespace, address: str, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.control = tmp / "control"
        self.control.mkdir(exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
        self.env.update(IFRT_COORDINATOR=address, IFRT_CPU_DEVICE_COUNT="1", OMP_NUM_THREADS="1")
        self.agents: dict[int, HostAgent] = {}
        self.retired: list[HostAgent] = []
        self.workers: dict[int, FileWorker] = {}
        self.incarnations: list[FileWorker] = []
        self.agent_starts = 0

    @property
    def processes(self) -> int:
        return self.args.hosts * self.args.workers_per_host

    def host_of(self, process_id: int) -> int:
        return process_id // self.args.workers_per_host

    def ids_of(self, host: int) -> list[int]:
        w = self.args.workers_per_host
        return list(range(host * w, (host + 1) * w))

    def start_agent(self, host: int) -> HostAgent:
        self.agent_starts += 1
        agent = HostAgent(host, self.args, self.control, self.env,
                          self.tmp / f"agent-{host}.{self.agent_starts}.log")
        if host in self.agents:
            self.retired.append(self.agents[host])
        self.agents[host] = agent
        return agent

    def start(self) -> None:
        for host in range(self.args.hosts):
            self.start_agent(host)
        for p in range(self.processes):
            if self.replacement(p, 180) is None:
                raise RuntimeError(f"process {p} did not discover within 180 s: see {self.tmp}/agent-*.log")

    def replacement(self, process_id: int, timeout: float) -> FileWorker | None:
        """The next incarnation of ``process_id`` its agent starts, once it holds the topology (None: none did within
        ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        known = {w.pid for w in self.incarnations if w.process_id == process_id}
        while time.monotonic() < deadline:
            pids = {int(f.stem.rsplit("-", 1)[1]) for f in self.control.glob(f"rec-{process_id}-*.jsonl")} - known
            if pids:
                worker = FileWorker(self.control, process_id, min(pids))
                self.workers[process_id] = worker
                self.incarnations.append(worker)
                return worker if worker.wait(lambda r: "ready" in r, deadline - time.monotonic()) else None
            time.sleep(0.05)
        return None

    def started_per_process(self) -> dict[int, int]:
        """How many worker processes were started for each process id (every records file)."""
        counts = dict.fromkeys(range(self.processes), 0)
        for f in self.control.glob("rec-*.jsonl"):
            counts[int(f.stem.split("-")[1])] += 1
        return counts

    def ops_files(self) -> list[Path]:
        return sorted(self.control.glob("ops-*.jsonl"))

    def stop(self, timeout: float) -> None:
        """Asks every worker to stop (it finishes its calls), then stops the agents, each by its pid."""
        for w in self.workers.values():
            w.send("stop")
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            w.wait(lambda r: "stopped" in r, max(0.1, deadline - time.monotonic()))
        for agent in [*self.agents.values(), *self.retired]:
            agent.stop(15)
        for w in self.incarnations:
            w.end(0.1)


def exceptions(paths: list[Path]) -> dict[str, int]:
    """The exceptions that the logs at ``paths`` show a traceback of (each traceback's closing line, ``TypeError:
    ...``), counted. An agent's log interleaves its own lines with its workers' (each behind ``[<process id>] ``):
    each stream's traceback is followed on its own."""
    found: dict[str, int] = {}
    for path in paths:
        open_: dict[str, int] = {}  # stream (its prefix) -> the indentation of its traceback's first line
        for line in path.read_text(errors="replace").splitlines():
            stream, body = split_prefix(line)
            if "Traceback (most recent call last):" in body:
                open_[stream] = len(body) - len(body.lstrip())
                continue
            if stream not in open_ or not body.strip():
                continue
            if len(body) - len(body.lstrip()) > open_[stream] or body.lstrip().startswith(("File ", "^", "~")):
                continue
            closing = body.strip()[:300]
            if not closing.startswith(("The above exception", "During handling")):
                found[closing] = found.get(closing, 0) + 1
            del open_[stream]
    return found


def split_prefix(line: str) -> tuple[str, str]:
    """A log line's stream (the ``[<process id>] `` or ``[local <rank>] `` its agent put before a worker's line; ""
    for the agent's own) and the rest."""
    match = PREFIX.match(line)
    return (match.group(0), line[match.end():]) if match else ("", line)
