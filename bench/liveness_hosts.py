"""Liveness by agent (bench/liveness.py ``--by agent``): N processes on hosts of P, each host one simulated ``ifrt
run`` agent (bench/sim_agent.py) that joined the job, registered its P workers in one call and carries their sessions
on one HostSession stream, attached and idle (liveness by the connection's keepalive pings, as the agent's is).

Two measurements on the same cluster, one JSON object:

- the coordinator's CPU and RSS over a steady window once every host session and worker is attached (its share of a
  core, and the busiest second);
- then the agent of host 0 reports its worker 1 exited (as it does the moment ``waitpid`` returns it) and every other
  host session's arrival of that ``process_failed`` is timed from the report: p50 and max over the N/P - 1 others.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.queues import Queue as MpQueue
from pathlib import Path
from typing import Any

import profiled
from content import Cluster
from ifrt_driver import guard_memory
from liveness_readings import (
    DRIVER_MAX_RSS_MIB,
    EVENT_TIMEOUT_S,
    SESSION_HEARTBEAT_TIMEOUT_S,
    SETTLE_S,
    SETUP_PER_PROCESS_S,
    SETUP_TIMEOUT_S,
    cpu_seconds,
    expect,
    load_average,
    log_anomalies,
    machine_busy_seconds,
    peak_cpu_pct,
    progress,
    rss_mib,
    sleep_until,
)
from sim_agent import SimAgent, hosts

from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb

DEVICES = 8
VICTIM_HOST, VICTIM_WORKER = 0, 1
"""The agent of host 0 reports its worker of local rank 1 (process 1) exited."""
HOSTS_PER_DRIVER = 2048


async def drive(address: str, firsts: list[int], cluster: Cluster, per_host: int, inbox: MpQueue, outbox: MpQueue,
                setup_deadline: float) -> None:
    """The agents of hosts ``firsts``: joined, registered, attached; idle through the window; then the exit."""
    agents = [SimAgent(address, cluster, first, per_host) for first in firsts]
    victim = VICTIM_HOST * per_host + VICTIM_WORKER
    reporter = next((a for a in agents if a.first == VICTIM_HOST * per_host), None)
    others = {a.first for a in agents if a is not reporter}
    arrivals: dict[int, float] = {}
    everyone = asyncio.Event()
    counts: Counter[str] = Counter()

    def on_event(agent: SimAgent) -> Callable[[pb.SessionEvent], None]:
        def seen(event: pb.SessionEvent) -> None:
            kind = event.WhichOneof("kind")
            if kind == "process_failed" and event.process_failed.process_id == victim:
                if agent.first in others and agent.first not in arrivals:
                    arrivals[agent.first] = time.monotonic()
                    if len(arrivals) == len(others):
                        everyone.set()
            elif not (kind in ("worker_ended", "exit_noted") and agent is reporter):
                counts[kind] += 1  # the reporter's session ends its worker's and acknowledges the report
        return seen

    started = time.monotonic()
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(asyncio.gather(*(a.join() for a in agents)), setup_deadline - time.monotonic())
        joined = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(a.register(setup_deadline) for a in agents)),
                               setup_deadline - time.monotonic())
        registered = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(a.open_session() for a in agents)), setup_deadline - time.monotonic())
    except Exception as e:  # the orchestrator reports it
        outbox.put({"error": f"setup: {type(e).__name__}: {e}"[:500]})
        return
    readers = [asyncio.create_task(a.read_events(on_event(a))) for a in agents]
    outbox.put({"attached": len(agents), "join_s": joined - started, "register_s": registered - joined,
                "attach_s": time.monotonic() - registered, "retried": sum(len(a.retried) for a in agents)})
    await loop.run_in_executor(None, inbox.get)  # the window is over
    if reporter is not None:
        reported = time.monotonic()
        await reporter.report_exit(VICTIM_WORKER, "killed by SIGKILL (simulated: its agent saw it in waitpid)")
        outbox.put({"reported": reported})
    if not others:
        everyone.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(everyone.wait(), EVENT_TIMEOUT_S)
    outbox.put({"arrivals": list(arrivals.values()), "missing": len(others) - len(arrivals),
                "unexpected_events": dict(counts)})
    await loop.run_in_executor(None, inbox.get)  # exit
    for r in readers:
        r.cancel()
    await asyncio.gather(*(a.close() for a in agents))


def driver_main(address: str, firsts: list[int], num_processes: int, per_host: int, inbox: MpQueue, outbox: MpQueue,
                setup_timeout_s: float) -> None:
    """Entry point of one driver process."""
    threading.Thread(target=guard_memory, args=(DRIVER_MAX_RSS_MIB,), daemon=True).start()
    cluster = Cluster("synthetic", num_processes, DEVICES)
    try:
        asyncio.run(drive(address, firsts, cluster, per_host, inbox, outbox, time.monotonic() + setup_timeout_s))
    except Exception as e:  # the orchestrator reports it
        outbox.put({"error": f"{type(e).__name__}: {e}"[:500]})


def measure(num_processes: int, per_host: int, window_s: float, drivers: int = 0,
            profile: Path | None = None) -> dict[str, Any]:
    """The steady cost of N/P idle host sessions, then the fan-out of one reported exit. ``profile``: the
    coordinator runs under bench/profiled.py, which profiles the window (``profile`` in the record)."""
    if num_processes % per_host or num_processes < 2 * per_host:
        raise ValueError(f"{num_processes} processes are not at least two whole hosts of {per_host}")
    n_hosts = num_processes // per_host
    drivers = drivers or max(2, -(-n_hosts // HOSTS_PER_DRIVER))
    context = multiprocessing.get_context("spawn")
    record: dict[str, Any] = {"measurement": "host_sessions", "processes": num_processes, "hosts": n_hosts,
                              "processes_per_host": per_host, "devices_per_process": DEVICES,
                              "heartbeat_timeout_s": SESSION_HEARTBEAT_TIMEOUT_S, "drivers": drivers,
                              "window_s": window_s, "load_average_1m": round(load_average(), 2)}
    setup_timeout_s = SETUP_TIMEOUT_S + SETUP_PER_PROCESS_S * num_processes
    firsts = hosts(0, num_processes, per_host)
    wrapper = [sys.executable, str(Path(__file__).with_name("profiled.py")), str(profile)] if profile else []
    with LocalCoordinator("--heartbeat-timeout", str(SESSION_HEARTBEAT_TIMEOUT_S), num_processes=num_processes,
                          log_level="WARNING", wrapper=wrapper) as coordinator:
        record["rss_idle_mib"] = round(rss_mib(coordinator.pid), 1)
        inboxes = [context.Queue() for _ in range(drivers)]
        outbox = context.Queue()
        children = [context.Process(target=driver_main, daemon=True,
                                    args=(coordinator.address, firsts[d::drivers], num_processes, per_host, inboxes[d],
                                          outbox, setup_timeout_s)) for d in range(drivers)]
        started = time.monotonic()
        for child in children:
            child.start()
        try:
            ready = [expect(outbox, "attached", setup_timeout_s + 30) for _ in children]
            record.update(setup_s=round(time.monotonic() - started, 2),
                          attached_hosts=sum(r["attached"] for r in ready),
                          join_s=round(max(r["join_s"] for r in ready), 2),
                          register_s=round(max(r["register_s"] for r in ready), 2),
                          attach_s=round(max(r["attach_s"] for r in ready), 2),
                          retried_calls=sum(r["retried"] for r in ready))
            progress(f"N={num_processes}: {record['attached_hosts']} host sessions attached after {record['setup_s']}s")
            start = time.monotonic() + min(SETTLE_S, window_s)  # a short window (a smoke test) settles shortly
            sleep_until(start)
            if profile:
                profiled.switch(coordinator.pid)
            cpu0, t0, busy0 = cpu_seconds(coordinator.pid), time.monotonic(), machine_busy_seconds()
            peak = peak_cpu_pct(coordinator.pid, start + window_s)
            cpu1, t1, busy1 = cpu_seconds(coordinator.pid), time.monotonic(), machine_busy_seconds()
            if profile:
                record["profile"] = profiled.profile_shares(profiled.stopped(coordinator.pid, profile, 0), 30)
            record.update(rss_mib=round(rss_mib(coordinator.pid), 1), coordinator_cpu_s=round(cpu1 - cpu0, 3),
                          coordinator_cpu_pct_of_core=round(100 * (cpu1 - cpu0) / (t1 - t0), 2),
                          coordinator_cpu_pct_max_1s=round(peak, 1),
                          machine_busy_pct_of_core=round(100 * (busy1 - busy0) / (t1 - t0), 1))
            for inbox in inboxes:
                inbox.put("exit report")
            reported, arrivals, missing, events = fan_out(outbox, drivers)
        finally:
            for inbox in inboxes:
                inbox.put("exit")
            for child in children:
                child.join(30)
                if child.is_alive():
                    child.kill()
                    child.join()
        anomalies = log_anomalies(coordinator, ("no cluster token", "killed by SIGKILL"))
    latencies = [1000 * (t - reported) for t in arrivals]
    record.update(unexpected_events=events, other_host_sessions=len(arrivals) + missing,
                  exit_reached=len(arrivals), coordinator_log=anomalies[:5])
    if latencies:
        record.update({f"exit_to_others_{k}": v for k, v in summary(latencies).items()})
    problems = [f"{missing} other host sessions did not get process_failed within {EVENT_TIMEOUT_S}s"] if missing \
        else []
    if events:
        problems.append(f"session events other than the exit's process_failed (expected none): {events}")
    if problems:
        record["error"] = "; ".join(problems)
    return record


def fan_out(outbox: MpQueue, drivers: int) -> tuple[float, list[float], int, dict[str, int]]:
    """The drivers' reports after the exit: when it was reported, every other host session's arrival time, how many
    got none, and the events the sessions got once attached other than that process_failed (by kind)."""
    reported, arrivals, missing, events, done = None, [], 0, Counter[str](), 0
    while done < drivers or reported is None:
        report = outbox.get(timeout=EVENT_TIMEOUT_S + 30)
        if "error" in report:
            raise RuntimeError(f"a driver failed: {report['error']}")
        if "reported" in report:
            reported = report["reported"]
            continue
        arrivals += report["arrivals"]
        missing += report["missing"]
        events.update(report["unexpected_events"])
        done += 1
    return reported, arrivals, missing, dict(events)


def summary(latencies_ms: list[float]) -> dict[str, float]:
    """p50 and max of ``latencies_ms``."""
    return {"p50_ms": round(statistics.median(latencies_ms), 1), "max_ms": round(max(latencies_ms), 1)}
