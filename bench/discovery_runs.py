"""What one discovery run is made of, shared by bench/discovery.py and bench/discovery_hosts.py: the drivers as
children speaking JSON lines, the server's CPU, loopback bytes, sockets and memory read from /proc, and the run's
JSON record."""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
IFRT_DRIVER = HERE / "ifrt_driver.py"
START_TIMEOUT_S = 60.0
"""Longest the drivers (and the peer's service) may take to be ready."""


def run_timeout(n: int) -> float:
    """Longest one configuration of ``n`` processes may take from the first registration to every result."""
    return max(120.0, n * 0.02)


class Child:
    """A driver or service subprocess that speaks one JSON object per line on stdout."""

    def __init__(self, command: list[str], log_dir: Path, name: str) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                            text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def expect(self, key: str, deadline: float) -> dict[str, Any]:
        """The next JSON line, which must have ``key``; RuntimeError if it does not come before ``deadline``."""
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no {key!r} line in time; stderr: {self.stderr_tail()}") from None
        if line is None:
            raise RuntimeError(f"{self.name} exited ({self.process.poll()}) before {key!r}; "
                               f"stderr: {self.stderr_tail()}")
        record = json.loads(line)
        if key not in record:
            raise RuntimeError(f"{self.name}: expected {key!r}, got {line.strip()[:200]}")
        return record

    def send(self, line: str) -> None:
        """Writes one line to the child's stdin (ignored if it is gone)."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def stop(self, timeout: float = 20.0) -> None:
        """Asks the child to exit (``exit`` line, then EOF); kills it by pid if it does not within ``timeout``."""
        self.send("exit")
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def stderr_tail(self, lines: int = 5) -> str:
        """The last lines the child wrote to stderr."""
        return " | ".join(self.stderr_path.read_text(errors="replace").strip().splitlines()[-lines:])


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime, stime) of ``pid``, all its threads, in seconds, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def loopback_bytes() -> int:
    """Bytes that crossed the loopback interface so far (everything on ``lo``, not only this benchmark)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[0])
    return 0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def peak_rss_kib(pid: int) -> int | None:
    """The peak resident set (VmHWM) of ``pid`` in KiB, from /proc/<pid>/status; None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """(first, count) slices of ``range(n)`` for ``parts`` drivers."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


@dataclass
class Measurement:
    """What one run of the drivers against one server gave."""

    results: list[dict]
    user_s: float
    sys_s: float
    loopback_bytes: int
    connections: int
    peak_rss_kib: int | None


def established(pid: int, port: int) -> int:
    """Established TCP connections that ``pid`` holds with ``port`` as their local end: the server's side.

    From /proc/net/tcp{,6}, any local address (a server on all interfaces has one socket per client address
    dialed, 127.x.y.z), and only sockets among the server's file descriptors: gRPC servers listen with
    SO_REUSEPORT, so another program's server on the same port number is not impossible on a shared machine.
    Those tables are read in chunks while other programs open and close sockets, so a socket can show up twice
    or be skipped in one reading: this counts distinct sockets over two readings.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    seen = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6") * 2:
        path = Path(table)
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rpartition(":")[2], 16) == port and fields[9] in inodes:
                    seen.add(fields[9])
    return len(seen)


def summarize(system: str, n: int, k: int, m: Measurement) -> dict[str, Any]:
    """The run's JSON record from the drivers' results and the server's measurements."""
    results = m.results
    cpu_s = m.user_s + m.sys_s
    sent = [t for r in results for t in r["sent"]]
    received = [t for r in results for t in r["received"]]
    errors: Counter[str] = Counter()
    fingerprints: Counter[str] = Counter()
    payloads: Counter[str] = Counter()
    retried: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
        retried.update(r.get("retried", {}))
        fingerprints.update(r["fingerprints"])
        payloads.update(r["payloads"])
    facts = next((r["facts"] for r in results if r["facts"]), {})
    record: dict[str, Any] = {"system": system, "processes": n, "devices_per_process": k}
    done = [(s, e) for s, e in zip(sent, received, strict=True) if e > 0]
    if done:
        latencies = [e - s for s, e in done]
        record.update(
            wall_s=round(max(e for _, e in done) - min(s for s, _ in done), 4),
            send_spread_s=round(max(sent) - min(sent), 4),
            latency_p50_ms=round(percentile(latencies, 50) * 1e3, 2),
            latency_p99_ms=round(percentile(latencies, 99) * 1e3, 2),
            latency_max_ms=round(max(latencies) * 1e3, 2),
        )
    devices = n * k
    decode = [d for r in results for d in r["decode_s"]]
    record.update(
        coordinator_cpu_s=round(cpu_s, 3),
        coordinator_user_s=round(m.user_s, 3),
        coordinator_sys_s=round(m.sys_s, 3),
        cpu_per_process_ms=round(cpu_s / n * 1e3, 3),
        coordinator_peak_rss_mib=round(m.peak_rss_kib / 1024, 1) if m.peak_rss_kib else None,
        topology_bytes=facts.get("canonical_bytes"),
        bytes_per_device_raw=round(facts["canonical_bytes"] / devices, 2) if facts else None,
        bytes_per_device_sent=round(facts["payload_bytes"] / devices, 2) if facts else None,
        encoding=facts.get("encoding"),
        loopback_bytes_per_process=round(m.loopback_bytes / n),
        server_connections=m.connections,
        client_decode_p50_ms=round(percentile(decode, 50) * 1e3, 3) if decode else None,
        driver_cpu_s=round(sum(r["driver_cpu_s"] for r in results), 2),
        drivers=len(results),
        attempts=sum(r["attempts"] for r in results),
        retried_calls=sum(retried.values()),
        holding_topology=len(done),
        distinct_fingerprints=len(fingerprints),
        distinct_payloads=len(payloads),
    )
    if retried:
        record["retried_reasons"] = {e: count for e, count in retried.most_common(3)}
    problems = [f"{count} processes: {e}" for e, count in errors.most_common(5)]
    if len(done) != n:
        problems.append(f"{n - len(done)} of {n} processes do not hold the topology")
    if len(fingerprints) != 1:
        problems.append(f"{len(fingerprints)} distinct topology fingerprints (expected 1)")
    if len(payloads) != 1:
        problems.append(f"{len(payloads)} distinct payloads as sent (expected 1)")
    if problems:
        record["error"] = "; ".join(problems)
    return record
