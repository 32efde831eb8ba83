"""The TCP sockets a gloo process group opened, and shutting them down when the group is left for a recovery.

gloo's ``abort`` does not return a collective that waits on a peer that is alive but has left the collective (a
survivor that already saw the failure): with more than two processes, the survivors not next to the failed one wait
for the group's whole collective timeout. A process leaving the group shuts its sockets down instead: each peer
waiting on it gets "Connection closed by peer" at once, and the survivors reach the recovery together. The sockets
are only shut down, never closed (gloo still owns the descriptors); each is checked to be the same socket as when
the group opened it (its inode), so a descriptor number reused for another connection is never touched.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

FD_DIR = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: number -> ``socket:[inode]``."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(FD_DIR):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{FD_DIR}/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


class Opened:
    """The TCP sockets opened while its ``watch()`` ran, less those with a port in ``excluded_ports`` at either end
    (the coordinator's and the processes' transfer endpoints: a connection of the ifrt client's, or of a pipeline's
    channels, that opened meanwhile)."""

    def __init__(self, excluded_ports: frozenset[int] = frozenset()) -> None:
        self.excluded_ports = excluded_ports
        self.sockets: dict[int, str] = {}

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        before = _sockets()
        try:
            yield
        finally:
            self.sockets = {fd: inode for fd, inode in _sockets().items()
                            if before.get(fd) != inode and self._is_tcp_to_peer(fd)}

    def _is_tcp_to_peer(self, fd: int) -> bool:
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            return False
        with probe:
            if probe.family not in (socket.AF_INET, socket.AF_INET6) or probe.type != socket.SOCK_STREAM:
                return False
            try:
                ports = {probe.getpeername()[1], probe.getsockname()[1]}
            except OSError:
                return False  # a listener: gloo's thread on it aborts the process if it fails
            return not ports & self.excluded_ports

    def shut_down(self) -> int:
        """Shuts down every socket still the one it was; returns how many."""
        done = 0
        now = _sockets()
        for fd, inode in self.sockets.items():
            if now.get(fd) != inode:
                continue  # closed by gloo, and maybe the number reused: not ours any more
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as probe:
                probe.shutdown(socket.SHUT_RDWR)
                done += 1
        self.sockets = {}
        return done
