"""Several "hosts" on one machine for tests: Linux network namespaces on a private bridge.

A switch namespace holds a bridge; each host namespace has eth0 = SUBNET.<i> on it and no default route,
so traffic only goes between the namespaces this helper made. Everything is removed on close; processes
started inside are stopped by their own pids. Needs root and iproute2 (``ip``); without them
``skip_without_netns`` fails the calling test under ``CI=true`` and skips it elsewhere (tests/requirements.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

from tests.requirements import require

SKIP_REASON = ("they need root and iproute2's `ip` (scripts/test.sh installs iproute2 as root, or run: "
               "apt-get install -y iproute2)")
CLOSE_TIMEOUT = 10.0  # seconds for the processes of a namespace to be gone after SIGKILL


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _pids(ns: str) -> list[int]:
    """Processes running inside namespace ``ns`` (none when it does not exist)."""
    listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
    return [int(pid) for pid in listed.split()]


def skip_without_netns() -> None:
    """Fails (under CI=true) or skips the calling test when namespaces cannot be made here: not root, no ``ip``,
    or no permission."""
    if os.geteuid() != 0:
        require("network namespaces", f"not running as root (uid {os.geteuid()}); {SKIP_REASON}")
    if shutil.which("ip") is None:
        require("network namespaces", f"no `ip` on PATH; {SKIP_REASON}")
    probe = f"itopo-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        stderr = getattr(e, "stderr", "") or ""
        require("network namespaces", f"`ip netns add` failed here ({e} {stderr.strip()}); {SKIP_REASON}")


def skip_without_iptables() -> None:
    """Fails (under CI=true) or skips the calling test when ``iptables`` is not installed."""
    if shutil.which("iptables") is None:
        require("iptables", "no `iptables` on PATH; scripts/test.sh installs it as root, or run: apt-get install -y "
                            "iptables")


class Hosts:
    """``count`` hosts h1..hN at ``subnet``.1..N; ``run`` starts a process inside one of them."""

    def __init__(self, count: int) -> None:
        tag = os.getpid() % 50000
        self.prefix = f"it{tag}"
        self.subnet = f"10.{77 + tag // 250 % 100}.{tag % 250}"
        self.switch = f"{self.prefix}-sw"
        self.names = [f"{self.prefix}-h{i}" for i in range(1, count + 1)]
        self.processes: list[subprocess.Popen] = []
        try:
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
        except BaseException:
            self.close()  # no half-made namespaces left behind
            raise

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

    def block_tcp_port(self, host: int, port: int) -> None:
        """A firewall on ``host`` drops every packet that comes in for its TCP ``port`` (no reset: senders time out).
        Its rules live in the host's own namespace and go with it. Needs iptables (``skip_without_iptables``)."""
        subprocess.run(self.command(host, ["iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"]),
                       check=True, capture_output=True, text=True, timeout=30)

    def close(self) -> None:
        """SIGKILLs the processes still inside (by pid), waits until they are gone, and deletes the namespaces."""
        namespaces = [*self.names, self.switch]
        for ns in namespaces:
            for pid in _pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while True:  # a SIGKILLed process leaves its namespace once the kernel has torn it down
            left = {ns: pids for ns in namespaces if (pids := _pids(ns))}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if left:
            raise RuntimeError(f"processes still inside namespaces {CLOSE_TIMEOUT}s after SIGKILL: {left}")

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def skip_without_hosts() -> None:
    """Network namespaces, and ``unshare`` (util-linux) for a hostname per host."""
    skip_without_netns()
    if shutil.which("unshare") is None:
        require("unshare", "util-linux's `unshare` gives each test host its own hostname: apt-get install -y "
                           "util-linux")


def as_host(hosts: Hosts, index: int, name: str) -> list[str]:
    """Runs a command inside host ``index`` with its own hostname ``name`` (a UTS namespace of its own)."""
    return hosts.command(index, ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name])
