"""``ifrt run`` agents as child processes for tests: their output kept line by line, their workers' start lines."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ifrt.run.messages import Action, Say
from tests.helpers import BIN

RUN_WORKER = Path(__file__).with_name("run_worker.py")
"""The worker program the ``ifrt run`` tests run (its scenarios: its docstring)."""


def kinds(actions: list[Action]) -> list[type]:
    """The kinds of an agent's actions, less what it says."""
    return [type(a) for a in actions if not isinstance(a, Say)]


WAIT_S = 60.0


class RunAgent:
    """``ifrt run`` in a child process; its output lines (stdout and stderr) are kept as they come."""

    def __init__(self, *args: str, env: dict[str, str], wrapper: list[str] | None = None) -> None:
        self.process = subprocess.Popen([*(wrapper or []), str(BIN / "ifrt"), "run", *args], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float = WAIT_S, start: int = 0) -> re.Match:
        """The first stdout line from index ``start`` on that matches ``pattern``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.out[start:]:
                if match := re.search(pattern, line):
                    return match
            if self.process.poll() is not None and all(not r.is_alive() for r in self._readers):
                break
            time.sleep(0.02)
        raise AssertionError(f"agent {self.process.pid} printed no line matching {pattern!r} within {timeout}s;\n"
                             f"{self.output()}")

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {self.process.pid} still runs {timeout}s later;\n{self.output()}") from None
        for reader in self._readers:
            reader.join(5)
        return self.process.returncode

    def output(self) -> str:
        return "stdout:\n" + "\n".join(self.out[-40:]) + "\nstderr:\n" + "\n".join(self.err[-40:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def own_hostname(name: str) -> list[str]:
    """A ``RunAgent`` wrapper that runs the agent (and its workers) in a UTS namespace of its own, named ``name``: two
    agents on this machine as two hosts, where the coordinator binds agents to hosts (one agent per host name)."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name]


def agents_started() -> Iterator[Callable[..., RunAgent]]:
    """For a test module's ``agents`` fixture: starts agents (RunAgent's arguments), each stopped afterwards."""
    started: list[RunAgent] = []

    def start(*args: str, **kwargs) -> RunAgent:
        started.append(RunAgent(*args, **kwargs))
        return started[-1]

    yield start
    for a in started:
        a.stop()


def loopback_env(address: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
    env.update(IFRT_COORDINATOR=address, IFRT_CPU_DEVICE_COUNT="1", IFRT_FAILOVER_WINDOW="10", **extra)
    return env


def started_lines(agent: RunAgent, attempt: int) -> dict[int, re.Match]:
    """Each local worker's ``started`` line of ``attempt``, by process id."""
    found = {}
    for line in agent.out:
        if (m := re.search(rf"^\[(\d+)\] started process (\d+) attempt {attempt} pid (\d+) fingerprint (\w+)",
                           line)):
            found[int(m.group(2))] = m
    return found
