"""The processes of bench/failover_soak.py as it holds them: a process of the job (bench/soak_worker.py) with the JSON
records it wrote, a coordinator replica on a fixed port (killed, stopped and started again there, by its pid), and
which replica leads."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.local import LocalCoordinator

WORKER = Path(__file__).resolve().parent / "soak_worker.py"
SERVICE = "ifrt.topology.v1.Coordinator"
LAST_WORDS_S = 0.5
"""How long a wait goes on after its process ended: the records it wrote last are still being read."""
HEALTH_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 200)]


class Records:
    """The JSON records one process of the job wrote, kept in ``records`` as they come, and waits on them."""

    def __init__(self, process_id: int) -> None:
        self.process_id = process_id
        self.records: list[dict[str, Any]] = []
        self._changed = threading.Condition()

    def add(self, record: dict[str, Any]) -> None:
        with self._changed:
            self.records.append(record)
            self._changed.notify_all()

    def wait(self, found: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        """The first record ``found`` accepts, waiting up to ``timeout`` seconds; None if none came."""
        hits = self.wait_all(found, 1, timeout)
        return hits[0] if hits else None

    def send(self, line: str) -> None:
        raise NotImplementedError

    def ask(self, command: str, key: str, timeout: float) -> dict[str, Any] | None:
        """Sends ``command`` and returns the next record holding ``key`` (None if none came within ``timeout``)."""
        with self._changed:
            before = sum(key in r for r in self.records)
        self.send(command)
        answers = self.wait_all(lambda r: key in r, before + 1, timeout)
        return answers[before] if len(answers) > before else None

    def wait_all(self, found: Callable[[dict[str, Any]], bool], count: int, timeout: float) -> list[dict[str, Any]]:
        """The records ``found`` accepts, once there are ``count`` of them or ``timeout`` seconds passed (or the
        process ended: what it wrote last still counts)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(hits := [r for r in self.records if found(r)]) < count and time.monotonic() < deadline:
                if not self.running():
                    deadline = min(deadline, time.monotonic() + LAST_WORDS_S)
                self._changed.wait(max(0.0, min(deadline - time.monotonic(), 0.25)))
            return hits

    def running(self) -> bool:
        return True

    def events(self) -> list[dict[str, Any]]:
        with self._changed:
            return [r for r in self.records if "event" in r]


class Worker(Records):
    """One bench/soak_worker.py process the soak starts itself (direct sessions); its stdout's JSON lines are its
    records, its stdin takes the commands."""

    def __init__(self, address: str, process_id: int, n: int, ops: Path, name: str, args: argparse.Namespace) -> None:
        super().__init__(process_id)
        command = [sys.executable, str(WORKER), "--address", address, "--process-id", str(process_id),
                   "--num-processes", str(n), "--ops", str(ops), "--name", name, "--threads", str(args.threads),
                   "--keys", str(args.keys), "--seed", str(args.seed), "--op-timeout", str(args.op_timeout)]
        self.stderr = ops.with_suffix(".stderr")
        with self.stderr.open("ab") as err:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                            text=True, bufsize=1)
        self.pid = self.process.pid
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.add(json.loads(line))

    def send(self, line: str) -> None:
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL by its pid, and waits for it."""
        self.process.kill()
        self.process.wait()

    def end(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for it to exit, then kills it."""
        try:
            self.process.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.kill()

    def describe(self) -> str:
        return self.stderr.read_text()[-3000:]


class DirectJob:
    """``--processes`` bench/soak_worker.py processes the soak starts itself, each on its own direct session; the
    current incarnation of each process id, and every incarnation there was."""

    def __init__(self, args: argparse.Namespace, address: str, tmp: Path) -> None:
        self.args, self.address, self.tmp = args, address, tmp
        self.workers: dict[int, Worker] = {}
        self.incarnations: list[Worker] = []

    @property
    def processes(self) -> int:
        return self.args.processes

    def launch(self, process_id: int) -> Worker:
        name = f"{process_id}.{len(self.incarnations) + 1}"
        worker = Worker(self.address, process_id, self.processes, self.tmp / f"ops-{name}.jsonl", name, self.args)
        self.workers[process_id] = worker
        self.incarnations.append(worker)
        return worker

    def start(self) -> None:
        for p in range(self.processes):
            self.launch(p)
        for w in list(self.workers.values()):
            if w.wait(lambda r: "ready" in r, 120) is None:
                raise RuntimeError(f"process {w.process_id} did not discover within 120 s: {w.describe()}")

    def replacement(self, process_id: int, timeout: float) -> Worker | None:
        """Starts ``process_id`` again; the new process once it holds the topology (None: not within ``timeout``)."""
        worker = self.launch(process_id)
        return worker if worker.wait(lambda r: "ready" in r, timeout) else None

    def started_per_process(self) -> dict[int, int]:
        return {p: sum(w.process_id == p for w in self.incarnations) for p in range(self.processes)}

    def ops_files(self) -> list[Path]:
        return sorted(self.tmp.glob("ops-*.jsonl"))

    def stop(self, timeout: float) -> None:
        """Asks every process to stop (it finishes its calls), then waits for each, killing the late ones."""
        for w in self.workers.values():
            w.send("stop")
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            if w.wait(lambda r: "stopped" in r, max(0.1, deadline - time.monotonic())) is None:
                w.kill()
            w.end(5)


class Replica:
    """A coordinator replica on a fixed port: killed, stopped and started again there, always by its own pid."""

    def __init__(self, port: int, flags: tuple[str, ...], n: int, logs: Path) -> None:
        self.address, self.flags, self.n, self.logs = f"127.0.0.1:{port}", flags, n, logs
        self.coordinator: LocalCoordinator | None = None
        self.starts = 0
        self.health = health_pb2_grpc.HealthStub(grpc.insecure_channel(self.address, options=HEALTH_OPTIONS))

    def start(self) -> None:
        self.coordinator = LocalCoordinator(*self.flags, num_processes=self.n, bind=self.address, log_level="WARNING")
        self.starts += 1

    def signal(self, sig: signal.Signals) -> None:
        assert self.coordinator is not None
        os.kill(self.coordinator.pid, sig)

    def serving(self, timeout: float = 0.3) -> bool:
        """Whether it leads now (its health service says SERVING)."""
        try:
            answer = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
        except grpc.RpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        """Stops it (SIGCONT first, in case it is stopped) and keeps its log."""
        if self.coordinator is not None:
            if self.coordinator.process.poll() is None:
                self.signal(signal.SIGCONT)
            self.coordinator.stop(signal.SIGKILL)
            with self.logs.open("a") as log:
                log.write(self.coordinator.log)
            self.coordinator.close()
            self.coordinator = None


def leader(replicas: list[Replica], skip: Replica | None, timeout: float) -> tuple[Replica | None, float]:
    """The replica other than ``skip`` that serves, and when it was seen serving; (None, now) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        for r in replicas:
            if r is not skip and r.coordinator is not None and r.serving():
                return r, time.monotonic()
        if time.monotonic() >= deadline:
            return None, time.monotonic()
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is no zombie (a zombie has exited and holds nothing but its pid until its
    parent, or init for an orphan, reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")
