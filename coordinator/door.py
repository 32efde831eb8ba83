"""Slots for the job first: the connections of callers that never showed the cluster token have a budget of their own.

gRPC accepts connections up to a cap shared by everyone, and a caller without the token can keep a connection busy
(a health watch, checks that never send their request): enough of them once held every slot, and no process,
agent or operator could connect. The door knows the server's established connections (Linux: the socket inodes of
``/proc/self/fd`` joined with ``/proc/net/tcp`` and ``tcp6`` on the listening port) and the peers that made a call
with the token (``trust``, called as such a call starts). A sweep closes the connections of strangers older than
STRANGER_GRACE_S, oldest first, while strangers hold more than ``--max-stranger-connections``: a
``shutdown(SHUT_RDWR)`` on a duplicate of the descriptor, after which gRPC frees the connection. gRPC's own accept
cap is raised by twice that budget (``accept_cap``), so the job's share is never the strangers'.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

from coordinator.core.limits import FLAGS
from coordinator.noise import noisy

log = logging.getLogger("ifrt.coordinator")

STRANGER_GRACE_S = 1.0
"""How long a connection may go without a call carrying the token before it counts as a stranger's: a job's client
makes its first call within milliseconds of connecting. While the event loop runs late (a registration storm), the
grace grows by the lag, so a first call waiting in line is not taken for a stranger's silence."""
SWEEP_S = 0.1
"""How often the door looks: a count of this process's descriptors (one stat), and a full scan only while they are
more than the job's known connections and the strangers' budget."""
FULL_SCAN_S = 5.0
"""The longest between two full scans even when connections are few (forgets peers whose connections are gone)."""
COST_SHARE = 20
"""A sweep waits at least this many times its last round's duration (5% of the loop at most)."""
TCP_ESTABLISHED = "01"
PROC_FD = "/proc/self/fd"
PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


@dataclass(frozen=True)
class Connection:
    """One established connection to the server: its socket inode, the descriptor it is on, and its peer."""

    inode: int
    fd: int
    peer: tuple[str, int]


def available() -> str | None:
    """Why the door cannot work here (no /proc), or None when it can."""
    missing = [path for path in (PROC_FD, *PROC_TCP) if not os.path.exists(path)]
    return f"{', '.join(missing)} missing" if missing else None


def peer_key(peer: str) -> tuple[str, int] | None:
    """(address, port) of a gRPC peer string (``ipv4:10.0.0.2:5000``, ``ipv6:[::1]:5000``), IPv4-mapped IPv6
    addresses as IPv4; None for other kinds (unix sockets) or what does not parse."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return _canonical(ipaddress.ip_address(host.strip("[]").partition("%")[0])), int(port)
    except ValueError:
        return None


def shown_peer(peer: tuple[str, int]) -> str:
    """(address, port) as gRPC names a peer: ``ipv4:10.0.0.2:5000``, ``ipv6:[::1]:5000``."""
    address, port = peer
    return f"ipv6:[{address}]:{port}" if ":" in address else f"ipv4:{address}:{port}"


def _canonical(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def _proc_address(text: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6} (hex, each 32-bit word in host order) as (address, port)."""
    host, _, port = text.partition(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return _canonical(ipaddress.ip_address(raw)), int(port, 16)


def scan(port: int) -> list[Connection]:
    """This process's established TCP connections whose local port is ``port``."""
    sockets: dict[int, int] = {}
    for name in os.listdir(PROC_FD):
        try:
            target = os.readlink(f"{PROC_FD}/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            sockets[int(target[8:-1])] = int(name)
    found = []
    for path in PROC_TCP:
        try:
            with open(path) as table:
                lines = table.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_ESTABLISHED:
                continue
            inode = int(fields[9])
            if inode not in sockets or int(fields[1].rpartition(":")[2], 16) != port:
                continue
            found.append(Connection(inode, sockets[inode], _proc_address(fields[2])))
    return found


class Door:
    """Tells the job's connections from strangers' and closes strangers' past their budget (see the module)."""

    def __init__(self, strangers: int, grace_s: float = STRANGER_GRACE_S) -> None:
        self._budget = strangers
        self._grace_s = grace_s
        self._port = 0
        self._trusted: set[str] = set()  # gRPC peer strings that made a call with the token
        self._keys: dict[str, tuple[str, int] | None] = {}  # a trusted peer string -> its (address, port)
        self._first_seen: dict[int, float] = {}  # inode -> when a scan first saw it
        self._baseline_fds = 0
        self.connections = 0
        """Connections to the server at the last full scan."""
        self.strangers = 0
        """Of them, strangers' (no call with the token yet) at the last full scan."""
        self.closed = 0
        """Strangers' connections closed so far."""

    def listen(self, port: int) -> None:
        """The server's port (known once it is bound)."""
        self._port = port
        self._baseline_fds = _count_fds()

    def trust(self, peer: str) -> None:
        """``peer`` made a call with the token: its connection is the job's (a set insert per call)."""
        self._trusted.add(peer)

    def trusted(self, peer: str) -> bool:
        """Whether ``peer``'s connection made a call with the token."""
        return peer in self._trusted

    async def guard(self) -> None:
        """Sweeps until cancelled: every SWEEP_S while strangers may be over their budget (more descriptors than
        the job's known connections and the budget), a full scan at least every FULL_SCAN_S; a round that took
        long waits COST_SHARE times as long before the next (a job of thousands pays little)."""
        loop = asyncio.get_running_loop()
        interval, last_full = SWEEP_S, loop.time()
        while True:
            expected = loop.time() + interval
            await asyncio.sleep(interval)
            now = loop.time()
            lag = max(0.0, now - expected)
            started = time.perf_counter()
            many = _count_fds() - self._baseline_fds - len(self._trusted) > self._budget
            if many or now - last_full >= FULL_SCAN_S:
                try:
                    connections = scan(self._port)
                    last_full = loop.time()
                    self.sweep(connections, last_full, lag)
                except (OSError, ValueError) as e:  # /proc changed under the scan, no descriptor left: next round
                    noisy.warning("door:scan", "cannot look at the coordinator's connections: %s: %s",
                                  type(e).__name__, e)
            interval = max(SWEEP_S, COST_SHARE * (time.perf_counter() - started))

    def sweep(self, connections: list[Connection], now: float, lag: float = 0.0) -> list[Connection]:
        """Closes strangers' connections older than the grace, oldest first, down to the budget; forgets peers
        whose connections are gone. Returns the connections closed."""
        present = {c.peer for c in connections}
        for peer in list(self._trusted):
            key = self._keys.get(peer, False)
            if key is False:
                key = self._keys[peer] = peer_key(peer)
            if key not in present:
                self._trusted.discard(peer)
                del self._keys[peer]
        trusted = set(self._keys.values())
        inodes = {c.inode for c in connections}
        self._first_seen = {inode: since for inode, since in self._first_seen.items() if inode in inodes}
        strangers = []
        for c in connections:
            since = self._first_seen.setdefault(c.inode, now)
            if c.peer not in trusted:
                strangers.append((since, c))
        self.connections, self.strangers = len(connections), len(strangers)
        excess = len(strangers) - self._budget
        if excess <= 0:
            return []
        grace = self._grace_s + lag
        strangers.sort(key=lambda pair: pair[0])
        closed = []
        for since, c in strangers:
            if len(closed) >= excess or now - since < grace:
                break
            if _shut(c):
                closed.append(c)
                noisy.warning("door:closed", "closed the connection of %s: it made no call with the token in %.1fs, "
                              "and callers without the token held %d connections, more than the coordinator's %s of "
                              "%d", shown_peer(c.peer), now - since, len(strangers), FLAGS["stranger_connections"],
                              self._budget)
        self.closed += len(closed)
        self.strangers -= len(closed)
        return closed


def _shut(connection: Connection) -> bool:
    """Hangs up ``connection`` (gRPC then frees it) if its descriptor still holds it: the descriptor may have been
    closed and reused since the scan, so the duplicate's inode is compared first."""
    try:
        fd = os.dup(connection.fd)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != connection.inode:
            return False
        sock = socket.socket(fileno=fd)
        fd = -1  # the socket object owns the duplicate now
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            sock.close()
        return True
    finally:
        if fd >= 0:
            os.close(fd)


def _count_fds() -> int:
    """This process's open descriptors: the size Linux 6.2 and later gives /proc/self/fd (no listing), else its
    listing's length."""
    try:
        return os.stat(PROC_FD).st_size or len(os.listdir(PROC_FD))
    except OSError:
        return 0
