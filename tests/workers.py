"""A job's process as a real child process: a worker script whose JSON lines the test reads and waits on."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKER = Path(__file__).with_name("live_worker.py")
COORDINATION_WORKER = Path(__file__).with_name("coordination_worker.py")
"""A worker of key-values, barriers, live sets and the preemption sync point (usage in its docstring)."""
JAX_WORKER = Path(__file__).with_name("jax_worker.py")
ROOT = Path(__file__).resolve().parents[1]


class Worker:
    """A worker script (tests/live_worker.py by default) in its own process; its JSON lines arrive on ``lines``,
    and every line ``expect`` has read is kept in ``seen``."""

    def __init__(self, address: str, process_id: int | None, num_processes: int, *args: str, devices: int = 2,
                 transfer_port: int | None = 0, wrapper: list[str] | tuple[str, ...] = (), script: Path = WORKER,
                 env: dict[str, str] | None = None):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        full_env.update(IFRT_COORDINATOR=address, IFRT_NUM_PROCESSES=str(num_processes),
                        IFRT_CPU_DEVICE_COUNT=str(devices), **(env or {}))
        if process_id is not None:
            full_env["IFRT_PROCESS_ID"] = str(process_id)
        if transfer_port is not None:
            full_env["IFRT_TRANSFER_BIND"] = f"127.0.0.1:{transfer_port}"
        self.process = subprocess.Popen([*wrapper, sys.executable, str(script), *args], env=full_env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.lines.put(json.loads(line))

    def expect(self, key: str, timeout: float = 30, **match) -> dict:
        """The next line that has ``key`` (and the ``match`` values), skipping others."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            self.seen.append(line)
            if key in line and all(line.get(k) == v for k, v in match.items()):
                return line
        raise AssertionError(f"worker {self.process.pid} printed no {key} {match} within {timeout}s; "
                             f"it printed {self.seen[-5:]}")

    def tell(self, line: str) -> None:
        """Sends ``line`` to the worker's standard input (e.g. "arrive" with --barrier-when-told)."""
        self.process.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.process.stdin.flush()  # type: ignore[union-attr]

    def kill9(self) -> float:
        """Kills the worker by pid with SIGKILL; returns when (monotonic clock) it was gone."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        return time.monotonic()

    def stop(self) -> None:
        """Closes the worker's standard input (it exits), killing it by pid if it does not within 10 s."""
        if self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_jax_workers(address: str, count: int, scenario: str, devices: int = 2,
                      extra_env: dict[int, dict[str, str]] | None = None,
                      python: str = sys.executable, worker: Path = JAX_WORKER) -> list[subprocess.Popen]:
    """``count`` JAX processes of ``devices`` CPU devices each, with assigned ids (no IFRT_PROCESS_ID); ``worker``
    is the script they run with ``scenario`` as its arguments (split on spaces)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
    # XLA_FLAGS as well as JAX_NUM_CPU_DEVICES: JAX before 0.4.3x reads only the flag
    base.update(IFRT_COORDINATOR=address, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", OMP_NUM_THREADS="1",
                OPENBLAS_NUM_THREADS="1")
    if python != sys.executable:
        base["PYTHONPATH"] = str(ROOT)
    workers = []
    for rank in range(count):
        env = dict(base, IFRT_LOCAL_RANK=str(rank), **(extra_env or {}).get(rank, {}))
        workers.append(subprocess.Popen([python, str(worker), *scenario.split()], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    return workers
