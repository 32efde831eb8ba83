"""What a live process holds, read from /proc: resident memory and open descriptors."""

from __future__ import annotations

import os


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (VmRSS from /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    """Number of descriptors ``pid`` holds open (entries of /proc/<pid>/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))
