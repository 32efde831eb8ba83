"""What both liveness measurements (bench/liveness.py, bench/liveness_hosts.py) share: their time limits, progress
lines, a driver's reports, and readings of the coordinator and the machine from /proc."""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.queues import Queue as MpQueue
from pathlib import Path
from typing import Any

from coordinator.local import LocalCoordinator

SESSION_HEARTBEAT_TIMEOUT_S = 10.0
SETTLE_S = 3.0
"""Pause between the last attach and the measured window (lets the attach burst drain)."""
DRIVER_MAX_RSS_MIB = 4096
"""A driver past this much resident memory exits (a storm of reconnects once grew one to 15 GB here)."""
SETUP_TIMEOUT_S = 150.0
"""Longest the drivers may take to register every simulated process and attach every session (plus SETUP_PER_S)."""
SETUP_PER_PROCESS_S = 0.02
EVENT_TIMEOUT_S = 15.0
"""Longest an observer may wait for the event under test."""


def progress(message: str) -> None:
    """A progress line on stderr."""
    print(f"[liveness {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) in seconds, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB, from VmRSS in /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy (not idle, not waiting for I/O) since boot, from /proc/stat."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def log_anomalies(coordinator: LocalCoordinator, expected: tuple[str, ...] = ()) -> list[str]:
    """Lines of the coordinator's log that are warnings, errors or tracebacks, except those containing ``expected``."""
    marks = ("WARNING", "ERROR", "CRITICAL", "Traceback", "Exception")
    return [line for line in coordinator.log.splitlines()
            if any(m in line for m in marks) and not any(e in line for e in expected)]


def expect(outbox: MpQueue, key: str, timeout_s: float) -> dict[str, Any]:
    """The next report of a driver, which must have ``key``."""
    report = outbox.get(timeout=timeout_s)
    if key not in report:
        raise RuntimeError(f"a driver reported {report}, expected {key!r}")
    return report


def sleep_until(moment: float) -> None:
    """Sleeps until time.monotonic() reaches ``moment``."""
    time.sleep(max(0.0, moment - time.monotonic()))


def peak_cpu_pct(pid: int, until: float) -> float:
    """Samples the CPU of ``pid`` every second until ``until``; returns the busiest second's % of one core."""
    peak = 0.0
    cpu, at = cpu_seconds(pid), time.monotonic()
    while at < until - 0.5:
        sleep_until(min(at + 1.0, until))
        now_cpu, now = cpu_seconds(pid), time.monotonic()
        peak = max(peak, 100 * (now_cpu - cpu) / (now - at))
        cpu, at = now_cpu, now
    sleep_until(until)
    return peak
