"""Discovery with hosts of P processes, side by side (bench/discovery_runs.py ``--by agent,process``).

- ``ifrt/agent``: one simulated ``ifrt run`` agent per host (bench/host_driver.py): it joins the job, then registers
  its P workers in one ``RegisterHost`` call on its own connection. Joining is measured apart (``join_*``): an agent
  joins when it starts, before its workers list their devices.
- ``ifrt/process``: the same processes (same hosts, local ranks, devices and ids) each on its own connection with
  its own ``Register`` call (bench/ifrt_driver.py ``--processes-per-host``), as workers without an agent do.

Both publish the same topology, so their fingerprints must agree (``same_topology``). ``last_registration_to_all_s``
is the time from the last registration sent (the last agent's RegisterHost, or the last process's first Register)
to the last process holding the topology. ``--profile DIR`` runs the coordinator under bench/profiled.py and adds
where its main thread's CPU went during registration (``profile``) and the agents' joins (``join_profile``), as
shares of the profiled time (cProfile slows the coordinator; gRPC's completion-queue thread is not profiled).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import content
import discovery_runs
import profiled

from coordinator.local import LocalCoordinator

HERE = Path(__file__).resolve().parent
HOST_DRIVER = HERE / "host_driver.py"
MODES = ("agent", "process")
PROFILE_TOP = 30


def drive_phases(server_pid: int, server_port: int, commands: list[list[str]], log_dir: Path, timeout_s: float,
                 join: bool, profile: Path | None = None) -> tuple[discovery_runs.Measurement, dict[str, Any]]:
    """The drivers' protocol against one coordinator, measured as bench/discovery.py's ``drive`` measures it; with
    ``join`` (host drivers) the agents join first, measured apart. ``profile``: the coordinator runs under
    bench/profiled.py, and each phase (join, registration) is profiled on its own."""
    children = [discovery_runs.Child(c, log_dir, f"driver{i}") for i, c in enumerate(commands)]
    extra: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + discovery_runs.START_TIMEOUT_S
        for c in children:
            c.expect("ready", deadline)
        if join:
            if profile:
                profiled.switch(server_pid)
            (user0, sys0), t0 = discovery_runs.cpu_seconds(server_pid), time.monotonic()
            for c in children:
                c.send("join")
            deadline = time.monotonic() + timeout_s
            joined = [c.expect("joined", deadline) for c in children]
            (user1, sys1), t1 = discovery_runs.cpu_seconds(server_pid), time.monotonic()
            extra = {"join_cpu_s": round(user1 - user0 + sys1 - sys0, 3), "join_wall_s": round(t1 - t0, 3),
                     "join_driver_max_s": round(max(j["join_s"] for j in joined), 3)}
            if profile:
                extra["join_profile"] = profiled.profile_shares(profiled.stopped(server_pid, profile, 0), PROFILE_TOP)
        if profile:
            profiled.switch(server_pid)
        (user1, sys1), lo0 = discovery_runs.cpu_seconds(server_pid), discovery_runs.loopback_bytes()
        for c in children:
            c.send("go")
        deadline = time.monotonic() + timeout_s
        for c in children:
            c.expect("received", deadline)
        (user2, sys2), lo1 = discovery_runs.cpu_seconds(server_pid), discovery_runs.loopback_bytes()
        if profile:
            stats = profiled.stopped(server_pid, profile, 1 if join else 0)
            extra["profile"] = profiled.profile_shares(stats, PROFILE_TOP)
        connections, peak = discovery_runs.established(server_pid, server_port), discovery_runs.peak_rss_kib(server_pid)
        deadline = time.monotonic() + timeout_s
        results = [c.expect("sent", deadline) for c in children]
        return discovery_runs.Measurement(results, user2 - user1, sys2 - sys1, lo1 - lo0, connections, peak), extra
    finally:
        for c in children:
            c.send("exit")
        for c in children:
            c.stop()


def run(mode: str, n: int, k: int, per_host: int, drivers: int, log_dir: Path, content_args: argparse.Namespace,
        coordinator_args: Sequence[str] = (), profile: Path | None = None) -> dict[str, Any]:
    """One configuration of ``mode`` (agent or process) against the real coordinator."""
    if n % per_host:
        raise ValueError(f"{n} processes are not whole hosts of {per_host}")
    timeout = discovery_runs.run_timeout(n)
    script = HOST_DRIVER if mode == "agent" else discovery_runs.IFRT_DRIVER
    wrapper = [sys.executable, str(HERE / "profiled.py"), str(profile)] if profile else []
    with LocalCoordinator(*coordinator_args, num_processes=n, log_level="WARNING", wrapper=wrapper) as c:
        commands = [[sys.executable, str(script), "--address", c.address, "--first", str(first * per_host),
                     "--count", str(count * per_host), "--num-processes", str(n), "--devices", str(k),
                     "--processes-per-host", str(per_host), "--timeout", str(timeout - 10),
                     *content.driver_arguments(content_args)]
                    for first, count in discovery_runs.split(n // per_host, drivers)]
        port = int(c.address.rpartition(":")[2])
        measured, extra = drive_phases(c.pid, port, commands, log_dir, timeout, mode == "agent", profile)
        complaints = [line for line in c.log.splitlines() if " WARNING " in line or " ERROR " in line]
    record = discovery_runs.summarize(f"ifrt/{mode}", n, k, measured)
    sent = [t for r in measured.results for t in r["sent"]]
    received = [t for r in measured.results for t in r["received"]]
    fingerprints = {f for r in measured.results for f in r["fingerprints"]}
    record.update(extra, processes_per_host=per_host, hosts=n // per_host, content=content.describe(content_args),
                  fingerprint=next(iter(fingerprints)) if len(fingerprints) == 1 else None,
                  coordinator_log_warnings=len(complaints))
    if received and min(received) > 0:
        record["last_registration_to_all_s"] = round(max(received) - max(sent), 4)
    if mode == "agent":
        answers = {a for r in measured.results for a in r["answers"]}
        record["distinct_answers"] = len(answers)
        if len(answers) != 1:
            record["error"] = "; ".join(filter(None, [record.get("error"), f"{len(answers)} distinct host answers "
                                                                            "(expected 1)"]))
        total = record["coordinator_cpu_s"] + extra["join_cpu_s"]
        record["with_join_cpu_per_process_ms"] = round(total / n * 1e3, 3)
    for line in complaints[:5]:
        if "no cluster token" not in line:
            print(f"coordinator: {line}", file=sys.stderr)
    return record
