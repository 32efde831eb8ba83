"""Cut one process's links on loopback, in the root namespace: the process runs in a cgroup of its own, and iptables
drops what it sends (``-m cgroup --path``, matched on the sending socket's cgroup v2) or what goes to a port.

Usage::

    group = Cgroup("leader")
    coordinator = LocalCoordinator(..., wrapper=group.wrapper)      # every socket it opens belongs to the group
    with dropping(group.drop_to_ports([etcd_port])):                  # its packets to etcd are dropped: silence
        ...
    coordinator.close(); group.remove()

The match needs the process to be in the group when it opens its sockets (a listening socket's connections belong
to the listener's group), hence ``wrapper``. It matches what a process sends, not what it receives (on loopback the
receiving socket is not known to the INPUT chain): to cut a link both ways, drop each side's sending. Every rule
carries a comment naming this test process and is removed when the ``dropping`` block ends.
Needs root, iptables with the cgroup match and a cgroup v2 hierarchy (``skip_without_cuts``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.etcd_cluster import EtcdCluster, _Member
from tests.requirements import require

SKIP_REASON = "they need root, iptables (apt-get install -y iptables) and a cgroup v2 hierarchy"


def cgroup2_root() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (the unified one of a hybrid layout), or None."""
    with contextlib.suppress(OSError), open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "cgroup2":
                return Path(fields[1])
    return None


def skip_without_cuts() -> None:
    """Fails (under CI=true) or skips the calling test when links cannot be cut here."""
    if os.geteuid() != 0:
        require("iptables cuts", f"not running as root (uid {os.geteuid()}); {SKIP_REASON}")
    if shutil.which("iptables") is None:
        require("iptables cuts", f"no `iptables` on PATH; {SKIP_REASON}")
    root = cgroup2_root()
    if root is None or not os.access(root, os.W_OK):
        require("iptables cuts", f"no writable cgroup v2 hierarchy ({root}); {SKIP_REASON}")


class Cgroup:
    """A cgroup v2 group of this test's own; ``wrapper`` starts a command inside it (same pid, through exec)."""

    def __init__(self, name: str) -> None:
        root = cgroup2_root()
        assert root is not None, "no cgroup v2 hierarchy: call skip_without_cuts() first"
        self.name = f"itopo-{os.getpid()}-{name}"  # the path iptables matches, relative to the hierarchy's root
        self.path = root / self.name
        self.path.mkdir(exist_ok=True)

    @property
    def wrapper(self) -> list[str]:
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"]

    def drop_from(self, *match: str) -> list[str]:
        """A rule dropping what this group's processes send that also matches ``match`` (iptables words)."""
        return ["OUTPUT", "-m", "cgroup", "--path", self.name, *match, "-j", "DROP"]

    def drop_to_ports(self, ports: Sequence[int]) -> list[str]:
        """A rule dropping every TCP packet this group's processes send to one of ``ports``."""
        return self.drop_from("-p", "tcp", "-m", "multiport", "--dports", ",".join(map(str, ports)))

    def remove(self) -> None:
        """Deletes the group once its processes have exited."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


def drop_port(port: int, direction: str) -> list[str]:
    """A rule dropping every TCP packet sent to (``dport``) or from (``sport``) loopback port ``port``."""
    return ["OUTPUT", "-p", "tcp", f"--{direction}", str(port), "-j", "DROP"]


@contextlib.contextmanager
def dropping(*rules: list[str]) -> Iterator[None]:
    """Adds each rule (chain first) for the block and removes every rule added, whatever happened."""
    comment = ["-m", "comment", "--comment", f"itopo-test-{os.getpid()}"]
    added: list[list[str]] = []
    try:
        for chain, *spec in rules:
            rule = [chain, *spec[:-2], *comment, *spec[-2:]]
            subprocess.run(["iptables", "-A", *rule], check=True, capture_output=True, text=True, timeout=30)
            added.append(rule)
        yield
    finally:
        for rule in reversed(added):
            subprocess.run(["iptables", "-D", *rule], capture_output=True, text=True, timeout=30)


class EtcdWithGroup(EtcdCluster):
    """An ``EtcdCluster`` whose first member runs in ``group`` (set before ``start``)."""

    group: Cgroup

    def _command(self, member: _Member, state: str) -> list[str]:
        command = super()._command(member, state)
        return [*self.group.wrapper, *command] if member is self._members[0] else command

    def isolate_first(self) -> list[list[str]]:
        """Rules that cut member 0 from the other members' peer traffic (not from clients): it keeps answering TCP
        on its client port but has no quorum. Its own dials to their peer ports and everything to or from its peer
        port are dropped; what the others still send on its dials goes unacknowledged and stops within a
        retransmission timeout."""
        first, *others = (m.peer_port for m in self._members)
        return [self.group.drop_to_ports(others), drop_port(first, "dport"), drop_port(first, "sport")]
