"""Established TCP connections to a port, by the process that holds each, read from /proc (Linux): what the
benchmarks count connections per host with."""

from __future__ import annotations

import os

ESTABLISHED = "01"


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
