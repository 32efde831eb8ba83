"""Sockets and processes read from /proc (Linux): established TCP connections to a port by the process that holds
each (what the benchmarks count connections per host with), what a process listens on, its children and its
memory (what the healing benchmark reports beside the job)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path

ESTABLISHED, LISTEN = "01", "0A"


def connections_to(port: int) -> tuple[set[int], int]:
    """The socket inodes of the client ends of established TCP connections to ``port``, and how many server ends
    ``port`` holds (the coordinator's count)."""
    clients, served = set(), 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != ESTABLISHED:
                continue
            if int(fields[2].rsplit(":", 1)[1], 16) == port:
                clients.add(int(fields[9]))
            elif int(fields[1].rsplit(":", 1)[1], 16) == port:
                served += 1
    return clients, served


def sockets_of(pid: int) -> set[int]:
    """The socket inodes process ``pid`` holds (none once it is gone)."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                found.add(int(link[8:-1]))
    except OSError:
        pass
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return f"[{ipaddress.IPv6Address(words)}]"


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on, read from /proc (Linux)."""
    mine = sockets_of(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN and int(fields[9]) in mine:
                address, port = fields[1].rsplit(":", 1)
                found.append((_address(address), int(port, 16)))
    return sorted(found)


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (every thread's), read from /proc (Linux)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None
