"""Discovery at scale: N simulated processes with K devices each against the real coordinator (and XLA's).

    .venv/bin/python bench/discovery.py --processes 256,1024,4096 --devices 8
    .venv/bin/python bench/discovery.py --processes 256,1024,4096 --devices 8 --peer xla
    .venv/bin/python bench/discovery.py --mode late-coordinator
    .venv/bin/python bench/discovery.py --processes 4096 --devices 8 --content gpu --peer none  # bench/content.py

Prints one JSON object per configuration on stdout and nothing else there (progress goes to stderr). A
configuration that fails prints an object with an "error" field. Exits 1 if any configuration failed, in
particular if the simulated processes did not all get byte-identical topology bytes. See docs/benchmarks.md.

Every simulated process has its own TCP connection to the server, so the server holds N sockets: the benchmark
raises its soft RLIMIT_NOFILE (inherited by the coordinator, the drivers and the peer's processes) to the largest
N plus 1024, and exits 2 before running anything if the hard limit (`ulimit -Hn`) is lower; 16384 processes need
17408. The ifrt drivers all dial 127.0.0.1, so net.ipv4.ip_local_port_range must hold N + 1024 ports (Linux's
default 32768-60999 holds 28232). The XLA peer's simulated processes dial 127.1.0.0, 127.1.0.1, ... (all of
127.0.0.0/8 is loopback) at a service listening on all interfaces, since its clients share one connection per
target within a process. The peer needs about 3 threads per simulated process (kernel.pid_max bounds them all).

    .venv/bin/python bench/discovery.py --processes 16384 --devices 8 --peer none --repeat 1

With ``--by agent,process`` the processes sit on hosts of ``--processes-per-host`` (8), and each size runs through
one simulated ``ifrt run`` agent per host (one connection and one RegisterHost call per host), then with one
connection per process, then XLA's peer: see bench/discovery_hosts.py.

    .venv/bin/python bench/discovery.py --by agent,process --processes 1024,4096,16384 --peer-max-processes 4096
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import content

from coordinator.local import LocalCoordinator
from ifrt.client import Client

HERE = Path(__file__).resolve().parent
IFRT_DRIVER = HERE / "ifrt_driver.py"
XLA_PEER = HERE / "xla_peer.py"
DEFAULT_XLA_PYTHON = "/tmp/venv-xla/bin/python"
XLA_PYTHON_ENV = "IFRT_BENCH_XLA_PYTHON"
START_TIMEOUT_S = 60.0
"""Longest the drivers (and the peer's service) may take to be ready."""
PROCESSES_PER_DRIVER = 4096
"""Default load of one ifrt driver: at 8192 channels a driver's loop lags enough under load that the coordinator
forgets some registrations (their next call arrives more than the heartbeat timeout after the last)."""
FD_MARGIN = 1024
"""File descriptors a process needs beyond one per simulated process (gRPC's pollers, pipes, logs, the venv)."""


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def raise_fd_limit(needed: int) -> str | None:
    """Raises the soft RLIMIT_NOFILE (children inherit it) to ``needed``; the reason it cannot, else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    if hard != resource.RLIM_INFINITY and hard < needed:
        return (f"need {needed} open files (one socket per simulated process in the server, plus {FD_MARGIN}), but "
                f"the hard limit is {hard}: raise it (as root, `ulimit -Hn {needed}` in the shell that starts the "
                f"benchmark; `ulimit -Hn` shows it) or run fewer processes")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return None


def port_range_problem(n: int) -> str | None:
    """Why ``n`` connections to one address and port cannot all get an ephemeral port, or None."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    if high - low + 1 < n + FD_MARGIN:
        return (f"{n} processes dial one coordinator address, but net.ipv4.ip_local_port_range ({low}-{high}) has "
                f"only {high - low + 1} ephemeral ports; widen it or run fewer processes")
    return None


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


def drive(server_pid: int, server_port: int, commands: list[list[str]], log_dir: Path,
          timeout_s: float) -> Measurement:
    """Runs the drivers' protocol against one server; measures the server's CPU from "go" to all received."""
    children = [Child(c, log_dir, f"driver{i}") for i, c in enumerate(commands)]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for c in children:
            c.expect("ready", deadline)
        (user0, sys0), lo0 = cpu_seconds(server_pid), loopback_bytes()
        for c in children:
            c.send("go")
        deadline = time.monotonic() + timeout_s
        for c in children:
            c.expect("received", deadline)
        (user1, sys1), lo1 = cpu_seconds(server_pid), loopback_bytes()
        connections, peak = established(server_pid, server_port), peak_rss_kib(server_pid)
        deadline = time.monotonic() + timeout_s  # checking every answer takes its own time
        results = [c.expect("sent", deadline) for c in children]
        return Measurement(results, user1 - user0, sys1 - sys0, lo1 - lo0, connections, peak)
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


def run_ifrt(n: int, k: int, drivers: int, log_dir: Path, content_args: argparse.Namespace,
             coordinator_args: Sequence[str] = ()) -> dict[str, Any]:
    """One configuration against the real ifrt-coordinator, with the device content ``content_args`` name."""
    with LocalCoordinator(*coordinator_args, num_processes=n, log_level="WARNING") as coordinator:
        commands = [[sys.executable, str(IFRT_DRIVER), "--address", coordinator.address, "--first", str(first),
                     "--count", str(count), "--num-processes", str(n), "--devices", str(k),
                     "--timeout", str(run_timeout(n) - 10), *content.driver_arguments(content_args)]
                    for first, count in split(n, drivers)]
        port = int(coordinator.address.rpartition(":")[2])
        record = summarize("ifrt", n, k, drive(coordinator.pid, port, commands, log_dir, run_timeout(n)))
        record["content"] = content.describe(content_args)
        complaints = [line for line in coordinator.log.splitlines() if " WARNING " in line or " ERROR " in line]
    record["coordinator_log_warnings"] = len(complaints)
    for line in complaints[:5]:
        print(f"coordinator: {line}", file=sys.stderr)
    return record


def run_xla(n: int, k: int, drivers: int, python: str, connections: str, log_dir: Path) -> dict[str, Any]:
    """One configuration against XLA's coordination service (jaxlib), doing PJRT's topology exchange.

    ``connections`` per-process: the service listens on all interfaces and each client dials a loopback address
    of its own; shared: the clients of one driver share one connection to 127.0.0.1.
    """
    port = free_port("0.0.0.0")
    bind = f"0.0.0.0:{port}" if connections == "per-process" else f"127.0.0.1:{port}"
    service = Child([python, str(XLA_PEER), "service", "--bind", bind, "--num-processes", str(n)], log_dir,
                    "xla-service")
    try:
        service.expect("ready", time.monotonic() + START_TIMEOUT_S)
        commands = [[python, str(XLA_PEER), "driver", "--address", f"127.0.0.1:{port}", "--connections", connections,
                     "--first", str(first), "--count", str(count), "--num-processes", str(n), "--devices", str(k),
                     "--timeout", str(int(run_timeout(n) - 10))] for first, count in split(n, drivers)]
        return summarize("xla", n, k, drive(service.process.pid, port, commands, log_dir, run_timeout(n)))
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
    p.add_argument("--drivers", type=int,
                   help=f"driver processes simulating the N (default: N / {PROCESSES_PER_DRIVER}, at least 2)")
    p.add_argument("--repeat", type=int,
                   help="runs per configuration, the median by coordinator CPU is reported (default 3); "
                        "late-coordinator: repetitions (default 10)")
    p.add_argument("--peer", choices=["auto", "xla", "none"], default="auto",
                   help="also run XLA's coordination service: auto runs it when its interpreter is found, xla "
                        "requires it (default %(default)s)")
    p.add_argument("--xla-python", help=f"interpreter with jax/jaxlib (default ${XLA_PYTHON_ENV} or "
                                        f"{DEFAULT_XLA_PYTHON})")
    p.add_argument("--peer-drivers", type=int, default=8,
                   help="driver processes for the peer; its clients are heavier (default %(default)s)")
    p.add_argument("--peer-connections", choices=["per-process", "shared"], default="per-process",
                   help="per-process: each peer client dials a loopback address of its own and so has its own "
                        "connection; shared: a driver's clients share one (default %(default)s)")
    p.add_argument("--peer-max-processes", type=int, default=4096,
                   help="skip peer configurations above this N (default %(default)s)")
    p.add_argument("--heartbeat-timeout", type=float, metavar="SECONDS",
                   help="the coordinator's --heartbeat-timeout (default: its own, 10 s); a registered process whose "
                        "next Register call has not reached the coordinator within it is forgotten")
    p.add_argument("--by", help="comma-separated: agent (one simulated `ifrt run` agent per host), process (each "
                                "process on its own), side by side on hosts of --processes-per-host")
    p.add_argument("--processes-per-host", type=int, default=8, help="with --by (default %(default)s)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="with --by: run each coordinator under cProfile, its stats in DIR (use --repeat 1)")
    p.add_argument("--head-start", type=float, default=0.5,
                   help="seconds the worker runs before the coordinator starts (default %(default)s)")
    content.add_arguments(p)  # the XLA peer always exchanges synthetic devices
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
    sizes = [int(x) for x in args.processes.split(",")]
    problem = raise_fd_limit(max(sizes) + FD_MARGIN) or port_range_problem(max(sizes))
    if problem is not None:
        print(f"discovery: {problem}", file=sys.stderr)
        return 2
    coordinator_args = () if args.heartbeat_timeout is None else ("--heartbeat-timeout", str(args.heartbeat_timeout))
    if args.by:
        import discovery_hosts

        modes = args.by.split(",")
        if not set(modes) <= set(discovery_hosts.MODES) or any(n % args.processes_per_host for n in sizes):
            p.error(f"--by {args.by}: expected modes among {', '.join(discovery_hosts.MODES)} and sizes that are "
                    f"whole hosts of --processes-per-host {args.processes_per_host}")
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="ifrt-bench-") as tmp:
            return 0 if discovery_hosts.side_by_side(sizes, modes, args, peer, Path(tmp), coordinator_args) else 1
    failed = False
    with tempfile.TemporaryDirectory(prefix="ifrt-bench-") as tmp:
        for n in sizes:
            drivers = args.drivers or max(2, -(-n // PROCESSES_PER_DRIVER))
            runs = [("ifrt", lambda n=n, d=drivers: run_ifrt(n, args.devices, d, Path(tmp), args, coordinator_args))]
            if peer is not None and n <= args.peer_max_processes:
                runs.append(("xla", lambda n=n: run_xla(n, args.devices, args.peer_drivers, peer,
                                                        args.peer_connections, Path(tmp))))
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
