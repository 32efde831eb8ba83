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
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import content
import discovery_hosts
from discovery_runs import (
    IFRT_DRIVER,
    START_TIMEOUT_S,
    Child,
    Measurement,
    cpu_seconds,
    established,
    loopback_bytes,
    peak_rss_kib,
    percentile,
    run_timeout,
    split,
    summarize,
)

from coordinator.local import LocalCoordinator
from ifrt.client import Client

HERE = Path(__file__).resolve().parent
XLA_PEER = HERE / "xla_peer.py"
DEFAULT_XLA_PYTHON = "/tmp/venv-xla/bin/python"
XLA_PYTHON_ENV = "IFRT_BENCH_XLA_PYTHON"
PROCESSES_PER_DRIVER = 4096
"""Default load of one ifrt driver: at 8192 channels a driver's loop lags enough under load that the coordinator
forgets some registrations (their next call arrives more than the heartbeat timeout after the last)."""
FD_MARGIN = 1024
"""File descriptors a process needs beyond one per simulated process (gRPC's pollers, pipes, logs, the venv)."""


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


def side_by_side(sizes: list[int], modes: list[str], args: argparse.Namespace, peer: str | None, tmp: Path,
                 coordinator_args: Sequence[str]) -> bool:
    """Every mode (and XLA's peer where it runs) at every size; one JSON object each. True if all succeeded."""
    failed = False
    for n in sizes:
        drivers = args.drivers or max(2, -(-n // PROCESSES_PER_DRIVER))
        fingerprints: dict[str, str | None] = {}
        for mode in modes:
            profile = args.profile / f"{mode}-{n}" if args.profile else None
            print(f"ifrt/{mode}: {n} processes x {args.devices} devices, hosts of {args.processes_per_host} ...",
                  file=sys.stderr, flush=True)
            try:
                record = median_run(lambda mode=mode, n=n, d=drivers, p=profile: discovery_hosts.run(
                    mode, n, args.devices, args.processes_per_host, d, tmp, args, coordinator_args, p),
                    args.repeat or 3)
            except Exception as e:  # reported as data: the other configurations still run
                record = {"system": f"ifrt/{mode}", "processes": n, "error": f"{type(e).__name__}: {e}"}
            fingerprints[mode] = record.get("fingerprint")
            if len(fingerprints) > 1 and "error" not in record and None not in fingerprints.values():
                record["same_topology"] = len(set(fingerprints.values())) == 1
                if not record["same_topology"]:
                    record["error"] = f"topology fingerprints differ by mode: {fingerprints}"
            emit(record)
            failed |= "error" in record
        if peer is not None and n <= args.peer_max_processes:
            print(f"xla: {n} processes x {args.devices} devices ...", file=sys.stderr, flush=True)
            try:
                record = median_run(lambda n=n: run_xla(
                    n, args.devices, args.peer_drivers, peer, args.peer_connections, tmp), args.repeat or 3)
            except Exception as e:
                record = {"system": "xla", "processes": n, "error": f"{type(e).__name__}: {e}"}
            emit(record)
            failed |= "error" in record
    return not failed


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
        modes = args.by.split(",")
        if not set(modes) <= set(discovery_hosts.MODES) or any(n % args.processes_per_host for n in sizes):
            p.error(f"--by {args.by}: expected modes among {', '.join(discovery_hosts.MODES)} and sizes that are "
                    f"whole hosts of --processes-per-host {args.processes_per_host}")
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="ifrt-bench-") as tmp:
            return 0 if side_by_side(sizes, modes, args, peer, Path(tmp), coordinator_args) else 1
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
