"""Several "hosts" on one machine for tests: Linux network namespaces on a private bridge.

A switch namespace holds a bridge; each host namespace has eth0 = SUBNET.<i> on it and no default route,
so traffic only goes between the namespaces this helper made. Everything is removed on close; processes
started inside are stopped by their own pids. Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

import pytest

SKIP_REASON = "network namespaces need root and iproute2 (scripts/test.sh installs iproute2)"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def skip_without_netns() -> None:
    """Skips the calling test when namespaces cannot be made here (not root, no ``ip``, no permission)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip(SKIP_REASON)
    probe = f"itopo-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"{SKIP_REASON}: {e}")


class Hosts:
    """``count`` hosts h1..hN at ``subnet``.1..N; ``run`` starts a process inside one of them."""

    def __init__(self, count: int) -> None:
        tag = os.getpid() % 50000
        self.prefix = f"it{tag}"
        self.subnet = f"10.{77 + tag // 250 % 100}.{tag % 250}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-h{i}" for i in range(1, count + 1)]
        self.processes: list[subprocess.Popen] = []
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names, start=1):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host`` (1-based)."""
        return ["ip", "netns", "exec", self.names[host - 1], *argv]

    def partition(self, host: int) -> None:
        """Cuts the host off: its switch port goes down, so its connections see silence, not a reset."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def heal(self, host: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{host}", "up")

    def close(self) -> None:
        for ns in [*self.names, self.switch]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in map(int, pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
