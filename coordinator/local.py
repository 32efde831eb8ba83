"""``LocalCoordinator``: an ``ifrt-coordinator`` daemon in a child process, for demos, tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


class LocalCoordinator:
    """Starts the real daemon (its console script) on a free loopback port; stops it by its pid.

    >>> with LocalCoordinator(num_processes=4) as c:
    ...     os.environ["IFRT_COORDINATOR"] = c.address
    """

    def __init__(self, *args: str, num_processes: int, bind: str = "127.0.0.1:0", start_timeout: float = 20.0,
                 log_level: str = "INFO", wrapper: Sequence[str] = ()) -> None:
        """``wrapper`` prefixes the command (e.g. ``ip netns exec NS`` to run it on another test host)."""
        self._dir = tempfile.TemporaryDirectory(prefix="ifrt-coordinator-")
        ready = Path(self._dir.name, "address")
        self.log_path = Path(self._dir.name, "coordinator.log")
        command = [*wrapper, _console_script("ifrt-coordinator"), "--bind", bind, "--num-processes", str(num_processes),
                   "--ready-file", str(ready), "--log-level", log_level, *args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"ifrt-coordinator exited with {self.process.returncode} before serving:\n"
                                   f"{self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"ifrt-coordinator did not serve within {start_timeout}s:\n{self.log}")
            time.sleep(0.01)
        self.address = ready.read_text().strip()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log(self) -> str:
        """Everything the daemon logged so far."""
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30.0) -> None:
        """Waits until the daemon has logged ``text``; TimeoutError with the log if it does not."""
        deadline = time.monotonic() + timeout
        while text not in self.log:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ifrt-coordinator did not log {text!r} within {timeout}s:\n{self.log}")
            time.sleep(0.02)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Sends ``sig`` to the daemon's pid (SIGKILL if it outlives ``timeout``); returns its exit code."""
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> LocalCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _console_script(name: str) -> str:
    """The console script installed beside this interpreter (the venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name
