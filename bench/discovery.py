"""Discovery at scale: N simulated processes with K devices each against the real coordinator (and XLA's).

    .venv/bin/python bench/discovery.py --processes 256,1024,4096 --devices 8
    .venv/bin/python bench/discovery.py --processes 256,1024,4096 --devices 8 --peer xla
    .venv/bin/python bench/discovery.py --mode late-coordinator

Prints one JSON object per configuration on stdout and nothing else there (progress goes to stderr). A
configuration that fails prints an object with an "error" field. Exits 1 if any configuration failed, in
particular if the simulated processes did not all get byte-identical topology bytes. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.local import LocalCoordinator
from ifrt.client import Client

HERE = Path(__file__).resolve().parent
IFRT_DRIVER = HERE / "ifrt_driver.py"
XLA_PEER = HERE / "xla_peer.py"
DEFAULT_XLA_PYTHON = "/tmp/venv-xla/bin/python"
XLA_PYTHON_ENV = "IFRT_BENCH_XLA_PYTHON"
START_TIMEOUT_S = 60.0
"""Longest the drivers (and the peer's service) may take to be ready."""
RUN_TIMEOUT_S = 120.0
"""Longest one configuration may take from the first registration sent to every driver's result."""


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


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def established(port: int) -> int:
    """Established TCP connections whose local end is ``port`` (the server's side), from /proc/net/tcp{,6}."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                fields = line.split()
                count += fields[3] == "01" and int(fields[1].rpartition(":")[2], 16) == port
    return count


def drive(server_pid: int, server_port: int, commands: list[list[str]], log_dir: Path) -> Measurement:
    """Runs the drivers' protocol against one server; measures the server's CPU from "go" to all received."""
    children = [Child(c, log_dir, f"driver{i}") for i, c in enumerate(commands)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for c in children:
            c.expect("ready", deadline)
        (user0, sys0), lo0 = cpu_seconds(server_pid), loopback_bytes()
        for c in children:
            c.send("go")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for c in children:
            c.expect("received", deadline)
        (user1, sys1), lo1 = cpu_seconds(server_pid), loopback_bytes()
        connections = established(server_port)
        results = [c.expect("sent", deadline) for c in children]
        return Measurement(results, user1 - user0, sys1 - sys0, lo1 - lo0, connections)
    finally:
        for c in children:  # all at once: XLA's clients leave through a barrier over every process
            c.send("exit")
        for c in children:
            c.stop()


def summarize(system: str, n: int, k: int, m: Measurement) -> dict[str, Any]:
    """The run's JSON record from the drivers' results and the server's measurements."""
    results = m.results
    cpu_s = m.user_s + m.sys_s
    sent = [t for r in results for t in r["sent"]]
    received = [t for r in results for t in r["received"]]
    errors: Counter[str] = Counter()
    fingerprints: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
        fingerprints.update(r["fingerprints"])
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
        topology_bytes=facts.get("canonical_bytes"),
        bytes_per_device_raw=round(facts["canonical_bytes"] / devices, 2) if facts else None,
        bytes_per_device_sent=round(facts["payload_bytes"] / devices, 2) if facts else None,
        encoding=facts.get("encoding"),
        loopback_bytes_per_process=round(m.loopback_bytes / n),
        server_connections=m.connections,
        client_decode_p50_ms=round(percentile(decode, 50) * 1e3, 3) if decode else None,
        driver_cpu_s=round(sum(r["driver_cpu_s"] for r in results), 2),
        attempts=sum(r["attempts"] for r in results),
        holding_topology=len(done),
        distinct_fingerprints=len(fingerprints),
    )
    problems = [f"{count} processes: {e}" for e, count in errors.most_common(5)]
    if len(done) != n:
        problems.append(f"{n - len(done)} of {n} processes do not hold the topology")
    if len(fingerprints) != 1:
        problems.append(f"{len(fingerprints)} distinct topology fingerprints (expected 1)")
    if problems:
        record["error"] = "; ".join(problems)
    return record


def median_run(run: Callable[[], dict[str, Any]], repeat: int) -> dict[str, Any]:
    """Runs ``repeat`` times; the run with the median coordinator CPU, plus every run's CPU and wall time.

    The first failing run is returned as is (with "run": its index).
    """
    records = []
    for i in range(repeat):
        record = run()
        if "error" in record:
            return {**record, "run": i}
        records.append(record)
    chosen = sorted(records, key=lambda r: r["coordinator_cpu_s"])[len(records) // 2]
    return {**chosen, "runs": len(records), "coordinator_cpu_s_runs": [r["coordinator_cpu_s"] for r in records],
            "wall_s_runs": [r["wall_s"] for r in records]}


def run_ifrt(n: int, k: int, drivers: int, log_dir: Path) -> dict[str, Any]:
    """One configuration against the real ifrt-coordinator."""
    with LocalCoordinator(num_processes=n, log_level="WARNING") as coordinator:
        commands = [[sys.executable, str(IFRT_DRIVER), "--address", coordinator.address, "--first", str(first),
                     "--count", str(count), "--num-processes", str(n), "--devices", str(k),
                     "--timeout", str(RUN_TIMEOUT_S - 10)] for first, count in split(n, drivers)]
        port = int(coordinator.address.rpartition(":")[2])
        record = summarize("ifrt", n, k, drive(coordinator.pid, port, commands, log_dir))
        complaints = [line for line in coordinator.log.splitlines() if " WARNING " in line or " ERROR " in line]
    record["coordinator_log_warnings"] = len(complaints)
    for line in complaints[:5]:
        print(f"coordinator: {line}", file=sys.stderr)
    return record


def run_xla(n: int, k: int, drivers: int, python: str, log_dir: Path) -> dict[str, Any]:
    """One configuration against XLA's coordination service (jaxlib), doing PJRT's topology exchange."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    service = Child([python, str(XLA_PEER), "service", "--bind", address, "--num-processes", str(n)], log_dir,
                    "xla-service")
    try:
        service.expect("ready", time.monotonic() + START_TIMEOUT_S)
        commands = [[python, str(XLA_PEER), "driver", "--address", address, "--first", str(first), "--count",
                     str(count), "--num-processes", str(n), "--devices", str(k),
                     "--timeout", str(int(RUN_TIMEOUT_S - 10))] for first, count in split(n, drivers)]
        return summarize("xla", n, k, drive(service.process.pid, port, commands, log_dir))
    finally:
        service.stop()


def discover_into(address: str, into: dict[str, float]) -> None:
    """One real process: ``ifrt.Client(...).discover()``; records when it returned (monotonic and wall ns)."""
    with Client(address, process_id=0, num_processes=1, timeout=30.0) as client:
        client.discover()
        into["monotonic"], into["wall_ns"] = time.monotonic(), time.time_ns()


def late_coordinator(repetitions: int, head_start_s: float) -> dict[str, Any]:
    """Latency from a late coordinator being ready to a process that started first holding the topology."""
    from_return, from_file = [], []
    for _ in range(repetitions):
        address = f"127.0.0.1:{free_port()}"
        done: dict[str, float] = {}
        worker = threading.Thread(target=discover_into, args=(address, done), daemon=True)
        worker.start()
        time.sleep(head_start_s)
        with LocalCoordinator(num_processes=1, bind=address, log_level="WARNING") as coordinator:
            ready = time.monotonic()
            ready_file = coordinator.log_path.with_name("address")  # LocalCoordinator's --ready-file
            written_ns = ready_file.stat().st_mtime_ns if ready_file.exists() else None
            worker.join(30.0)
        if "monotonic" not in done:
            return {"mode": "late-coordinator", "error": f"discover() did not return within 30 s of {address} "
                                                         "being ready"}
        from_return.append(done["monotonic"] - ready)
        if written_ns is not None:
            from_file.append((done["wall_ns"] - written_ns) / 1e9)
    record: dict[str, Any] = {"mode": "late-coordinator", "repetitions": repetitions, "head_start_s": head_start_s,
                              "num_processes": 1}
    for name, values in (("from_return", from_return), ("from_ready_file", from_file)):
        if values:
            record[f"{name}_p50_ms"] = round(percentile(values, 50) * 1e3, 1)
            record[f"{name}_max_ms"] = round(max(values) * 1e3, 1)
    return record


def xla_python(explicit: str | None) -> str | None:
    """The interpreter with jaxlib for the peer, or None if there is none."""
    candidate = explicit or os.environ.get(XLA_PYTHON_ENV) or DEFAULT_XLA_PYTHON
    path = shutil.which(candidate)
    if path is None:
        return None
    ok = subprocess.run([path, "-c", "from jaxlib import _jax; _jax.get_distributed_runtime_service"],
                        capture_output=True, timeout=60)
    return path if ok.returncode == 0 else None


def emit(record: dict[str, Any]) -> None:
    """One configuration's JSON object on stdout."""
    print(json.dumps(record), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["scale", "late-coordinator"], default="scale")
    p.add_argument("--processes", default="256,1024,4096", help="comma-separated N (default %(default)s)")
    p.add_argument("--devices", type=int, default=8, help="devices per process, K (default %(default)s)")
    p.add_argument("--drivers", type=int, default=2, help="driver processes simulating the N (default %(default)s)")
    p.add_argument("--repeat", type=int,
                   help="runs per configuration, the median by coordinator CPU is reported (default 3); "
                        "late-coordinator: repetitions (default 10)")
    p.add_argument("--peer", choices=["auto", "xla", "none"], default="auto",
                   help="also run XLA's coordination service: auto runs it when its interpreter is found, xla "
                        "requires it (default %(default)s)")
    p.add_argument("--xla-python", help=f"interpreter with jax/jaxlib (default ${XLA_PYTHON_ENV} or "
                                        f"{DEFAULT_XLA_PYTHON})")
    p.add_argument("--peer-drivers", type=int, default=8,
                   help="driver processes for the peer; its clients are heavier and share one connection per "
                        "driver process (default %(default)s)")
    p.add_argument("--peer-max-processes", type=int, default=4096,
                   help="skip peer configurations above this N (default %(default)s)")
    p.add_argument("--head-start", type=float, default=0.5,
                   help="seconds the worker runs before the coordinator starts (default %(default)s)")
    args = p.parse_args()

    if args.mode == "late-coordinator":
        record = late_coordinator(args.repeat or 10, args.head_start)
        emit(record)
        return 1 if "error" in record else 0

    peer = None if args.peer == "none" else xla_python(args.xla_python)
    if args.peer == "xla" and peer is None:
        print(f"--peer xla: no interpreter with jaxlib (set --xla-python or ${XLA_PYTHON_ENV}); see "
              "docs/benchmarks.md", file=sys.stderr)
        return 2
    failed = False
    with tempfile.TemporaryDirectory(prefix="ifrt-bench-") as tmp:
        for n in (int(x) for x in args.processes.split(",")):
            runs = [("ifrt", lambda n=n: run_ifrt(n, args.devices, args.drivers, Path(tmp)))]
            if peer is not None and n <= args.peer_max_processes:
                runs.append(("xla", lambda n=n: run_xla(n, args.devices, args.peer_drivers, peer, Path(tmp))))
            for system, run in runs:
                print(f"{system}: {n} processes x {args.devices} devices ...", file=sys.stderr, flush=True)
                try:
                    record = median_run(run, args.repeat or 3)
                except Exception as e:  # a failed configuration is reported as such; the others still run
                    record = {"system": system, "processes": n, "devices_per_process": args.devices,
                              "error": f"{type(e).__name__}: {e}"}
                emit(record)
                failed |= "error" in record
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
