"""Liveness: what keeping N sessions alive costs the coordinator, and how fast failures reach the survivors.

    .venv/bin/python bench/liveness.py
    .venv/bin/python bench/liveness.py --processes 256 --window 5 --repeats 1
    .venv/bin/python bench/liveness.py --processes 1024 --legacy-heartbeats --repeats 0

Prints one JSON object per measurement on stdout and nothing else there (progress goes to stderr):

- ``sessions``: N simulated processes (8 ``cpu`` devices each) register with explicit ids and keep a live
  ``Session`` stream, sending Heartbeat messages as often as the coordinator's ``attached`` event asks (with
  ``--legacy-heartbeats``: every quarter timeout, as clients that predate keepalive liveness did); two driver
  processes (grpc.aio, one channel and so one connection per simulated process, with the client's channel options).
  The coordinator's CPU and RSS are read from /proc over a steady window once every session is attached; the
  headline is its CPU per ping interval (half the timeout: the coordinator's heartbeat interval) per process, and
  what that makes of the id layout's limit, 16,384 processes, as a share of a core.
- ``process_killed``: real ``ifrt.Client`` processes 0 and 1 (threads here) and process 2 (a subprocess); process
  2 gets SIGKILL and the time until both observers hold ``ProcessFailed`` is measured.
- ``process_stopped``: the same, with SIGSTOP: process 2 hangs with its connection open, so only its unanswered
  keepalive pings can tell.
- ``coordinator_sigterm``: the same cluster; the coordinator gets SIGTERM and the time until both observers hold
  ``CoordinatorLost`` is measured.

With ``--by agent``, ``sessions`` is replaced by ``host_sessions`` (bench/liveness_hosts.py): the N processes on
hosts of ``--processes-per-host``, one simulated ``ifrt run`` agent and HostSession stream per host; its steady cost,
then a worker's exit reported by its agent, timed to every other host session.

    .venv/bin/python bench/liveness.py --by agent --processes 16384 --repeats 0

Raises the soft RLIMIT_NOFILE to the hard limit (the coordinator holds one connection per simulated process; the
children inherit it).

Exits 1 if any measurement failed (its object then has an "error" field). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import resource
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.queues import Queue as MpQueue
from pathlib import Path
from typing import IO, Any

import grpc
import liveness_hosts
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

import ifrt
from coordinator.config import CoordinatorConfig
from coordinator.core.cluster import ClusterConfig
from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt.client_config import CHANNEL_OPTIONS
from ifrt.events import CoordinatorLost, Event, ProcessFailed
from ifrt.ids import MAX_PROCESSES

SERVICE = "/ifrt.topology.v1.Coordinator"
PLUGIN = "cpu"
DEVICES = 8
PROCESSES_PER_DRIVER = 4096
"""Default load of one driver process: with more, its gRPC core may answer the coordinator's pings too late while
thousands of sessions attach on two shared cores."""
DETECTION_HEARTBEAT_TIMEOUT_S = 1.0
CLUSTER_TIMEOUT_S = 60.0
"""Longest the three processes of a detection run may take to discover and attach."""
REGISTER_WAIT_MS = 30_000
CHILD = ("import ifrt, time; c = ifrt.Client(); c.discover(); print(c.wait_attached(30), flush=True); "
         "time.sleep(600)")


def emit(record: dict[str, Any]) -> None:
    """One measurement as one JSON line on stdout."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


# Session cost: the driver processes.
@dataclass
class Counters:
    """What one driver's sessions did: heartbeats sent (in all and within the window), events, errors."""

    sent: int = 0
    in_window: int = 0
    events: int = 0
    errors: list[str] = field(default_factory=list)
    window: tuple[float, float] = (float("inf"), float("inf"))
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    interval_s: float = 0.0  # what the coordinator's attached event asked for
    register_retries: int = 0  # Register calls made again after their connection was lost
    attach_retries: int = 0  # sessions opened again after their connection was lost


def register_request(process_id: int, num_processes: int) -> bytes:
    """A serialized RegisterRequest with an explicit id and 8 cpu devices, as ``ifrt.Client._build_request`` does."""
    request = pb.RegisterRequest(cluster_id="", num_processes=num_processes, client_uid=uuid.uuid4().hex,
                                 hostname=f"host-{process_id:05d}", local_rank=0, plugin=PLUGIN, address="",
                                 wait_ms=REGISTER_WAIT_MS)
    request.process_id = process_id
    for i in range(DEVICES):
        request.devices.add(local_id=i, platform=PLUGIN, kind=PLUGIN)
    return request.SerializeToString()


async def register(channel: grpc.aio.Channel, request: bytes, deadline: float,
                   counters: Counters) -> tuple[str, int]:
    """Registers until the answer holds the topology, calling again after a lost connection as ``ifrt.Client`` does
    (each such retry is counted); returns (client uid, generation)."""
    call = channel.unary_unary(f"{SERVICE}/Register")
    uid = pb.RegisterRequest.FromString(request).client_uid
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            answer = pb.RegisterResponse.FromString(await call(request, timeout=remaining, wait_for_ready=True))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            counters.register_retries += 1
            await asyncio.sleep(0.05)
            continue
        if answer.topology:
            return uid, answer.generation
    raise TimeoutError("no topology before the deadline")


async def open_session(channel: grpc.aio.Channel, uid: str, generation: int) -> tuple[grpc.aio.StreamStreamCall, float]:
    """Opens the Session stream; returns it and the heartbeat interval in seconds from its ``attached`` event."""
    stream = channel.stream_stream(f"{SERVICE}/Session")(wait_for_ready=True)
    await stream.write(pb.SessionRequest(open=pb.SessionOpen(client_uid=uid, generation=generation))
                       .SerializeToString())
    first = pb.SessionEvent.FromString(await stream.read())
    if first.WhichOneof("kind") != "attached":
        raise RuntimeError(f"first session event is {first.WhichOneof('kind')!r}, expected 'attached'")
    return stream, first.attached.heartbeat_interval_ms / 1000


async def heartbeat(stream: grpc.aio.StreamStreamCall, interval_s: float, counters: Counters) -> None:
    """Writes a Heartbeat every ``interval_s`` (from a random phase, as independent processes do) until told to stop."""
    beat = pb.SessionRequest(heartbeat=pb.Heartbeat()).SerializeToString()
    loop = asyncio.get_running_loop()
    due = loop.time() + random.uniform(0, interval_s)
    while not counters.stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(counters.stop.wait(), max(0.0, due - loop.time()))
        if counters.stop.is_set():
            break
        await stream.write(beat)
        now = time.monotonic()
        counters.sent += 1
        counters.in_window += counters.window[0] <= now < counters.window[1]
        due += interval_s
    await stream.done_writing()


async def read_events(stream: grpc.aio.StreamStreamCall, counters: Counters) -> None:
    """Counts session events until the stream ends."""
    while (event := await stream.read()) is not grpc.aio.EOF:
        counters.events += event is not None


async def attach(channel: grpc.aio.Channel, uid: str, generation: int, deadline: float,
                 counters: Counters) -> tuple[grpc.aio.StreamStreamCall, float]:
    """Opens the session, again after a lost connection as ``ifrt.Client`` does (each such retry is counted)."""
    while True:
        try:
            return await open_session(channel, uid, generation)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            counters.attach_retries += 1
            await asyncio.sleep(0.05)


async def live_session(channel: grpc.aio.Channel, request: bytes, deadline: float, counters: Counters,
                       attached: Callable[[float], None], legacy_interval_s: float | None) -> None:
    """One simulated process: registers, attaches its session, heartbeats until stopped, then closes the stream."""
    uid, generation = await register(channel, request, deadline, counters)
    opened = time.monotonic()
    stream, interval_s = await attach(channel, uid, generation, deadline, counters)
    counters.interval_s = interval_s
    attached(time.monotonic() - opened)
    reader = asyncio.create_task(read_events(stream, counters))
    await heartbeat(stream, legacy_interval_s or interval_s, counters)
    await asyncio.wait_for(reader, 10.0)


async def guarded(session: Coroutine[Any, Any, None], counters: Counters) -> None:
    """Runs one simulated process, recording its error instead of raising it."""
    try:
        await session
    except Exception as e:  # one failed session must not hide the others' numbers
        counters.errors.append(f"{type(e).__name__}: {e}"[:300])


async def drive(address: str, ids: list[int], num_processes: int, inbox: MpQueue, outbox: MpQueue,
                setup_deadline: float, deadline: float, legacy_interval_s: float | None) -> None:
    """Runs the simulated processes ``ids``; reports when all are attached, then heartbeats through the window."""
    counters = Counters()
    attach_s: list[float] = []
    all_attached = asyncio.Event()

    def attached(seconds: float) -> None:
        attach_s.append(seconds)
        if len(attach_s) == len(ids):
            all_attached.set()

    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in ids]
    started = time.monotonic()
    tasks = [asyncio.create_task(guarded(live_session(c, register_request(i, num_processes), setup_deadline, counters,
                                                      attached, legacy_interval_s), counters))
             for c, i in zip(channels, ids, strict=True)]
    try:
        await asyncio.wait_for(all_attached.wait(), max(0.0, setup_deadline - time.monotonic()))
    except TimeoutError:
        counters.errors.append(f"only {len(attach_s)} of {len(ids)} sessions attached in time")
    outbox.put({"attached": len(attach_s), "setup_s": time.monotonic() - started,
                "register_retries": counters.register_retries, "attach_retries": counters.attach_retries,
                "attach_max_s": max(attach_s, default=0.0), "errors": counters.errors[:5]})
    loop = asyncio.get_running_loop()
    counters.window = await loop.run_in_executor(None, inbox.get, True, max(0.0, deadline - time.monotonic()))
    await asyncio.sleep(max(0.0, counters.window[1] + 0.5 - time.monotonic()))
    counters.stop.set()
    await asyncio.wait(tasks, timeout=15.0)
    await asyncio.gather(*(c.close() for c in channels))
    outbox.put({"heartbeats": counters.in_window, "sent": counters.sent, "events": counters.events,
                "asked_interval_s": counters.interval_s, "errors": counters.errors[:5],
                "error_count": len(counters.errors)})


def driver_main(address: str, ids: list[int], num_processes: int, inbox: MpQueue, outbox: MpQueue,
                setup_timeout_s: float, timeout_s: float, legacy_interval_s: float | None) -> None:
    """Entry point of one driver process: reports within ``setup_timeout_s``, stops by itself within ``timeout_s``."""
    started = time.monotonic()
    threading.Thread(target=guard_memory, args=(DRIVER_MAX_RSS_MIB,), daemon=True).start()
    try:
        asyncio.run(asyncio.wait_for(drive(address, ids, num_processes, inbox, outbox, started + setup_timeout_s,
                                           started + timeout_s, legacy_interval_s), timeout_s + 30))
    except Exception as e:  # the orchestrator reports it
        outbox.put({"error": f"{type(e).__name__}: {e}"[:300]})


# Session cost: the orchestrator.
def session_cost(drivers: int, num_processes: int, window_s: float, legacy: bool) -> dict[str, Any]:
    """Measures the coordinator's CPU and RSS while ``num_processes`` sessions stay attached (and heartbeat every
    quarter timeout if ``legacy``)."""
    context = multiprocessing.get_context("spawn")
    cluster = ClusterConfig(num_processes, heartbeat_timeout_s=SESSION_HEARTBEAT_TIMEOUT_S)
    interval_s = CoordinatorConfig(cluster=cluster).keepalive_interval_s
    record: dict[str, Any] = {"measurement": "sessions", "processes": num_processes, "devices_per_process": DEVICES,
                              "heartbeat_timeout_s": SESSION_HEARTBEAT_TIMEOUT_S, "heartbeat_interval_s": interval_s,
                              "drivers": drivers, "legacy_heartbeats": legacy, "window_s": window_s,
                              "load_average_1m": round(load_average(), 2)}
    setup_timeout_s = SETUP_TIMEOUT_S + SETUP_PER_PROCESS_S * num_processes
    with LocalCoordinator("--heartbeat-timeout", str(SESSION_HEARTBEAT_TIMEOUT_S), num_processes=num_processes,
                          log_level="WARNING") as coordinator:
        record["rss_idle_mib"] = round(rss_mib(coordinator.pid), 1)
        inboxes = [context.Queue() for _ in range(drivers)]
        outbox = context.Queue()
        lifetime = setup_timeout_s + SETTLE_S + window_s + 20
        drivers = [context.Process(target=driver_main, daemon=True,
                                   args=(coordinator.address, list(range(d, num_processes, drivers)), num_processes,
                                         inboxes[d], outbox, setup_timeout_s, lifetime,
                                         SESSION_HEARTBEAT_TIMEOUT_S / 4 if legacy else None))
                   for d in range(drivers)]
        started = time.monotonic()
        for d in drivers:
            d.start()
        try:
            ready = [expect(outbox, "attached", setup_timeout_s + 30) for _ in drivers]
            record["attached"] = sum(r["attached"] for r in ready)
            record["setup_s"] = round(time.monotonic() - started, 2)
            record["attach_max_ms"] = round(max(r["attach_max_s"] for r in ready) * 1000, 1)
            record["register_retries"] = sum(r["register_retries"] for r in ready)
            record["attach_retries"] = sum(r["attach_retries"] for r in ready)
            if record["attached"] != num_processes:
                raise RuntimeError(f"{record['attached']} of {num_processes} sessions attached: "
                                   f"{[r['errors'] for r in ready]}")
            progress(f"N={num_processes}: {record['attached']} sessions attached after {record['setup_s']}s")
            start = time.monotonic() + SETTLE_S
            for inbox in inboxes:
                inbox.put((start, start + window_s))
            sleep_until(start)
            cpu0, t0 = cpu_seconds(coordinator.pid), time.monotonic()
            drivers0 = sum(cpu_seconds(d.pid) for d in drivers if d.pid is not None)
            busy0 = machine_busy_seconds()
            peak = peak_cpu_pct(coordinator.pid, start + window_s)
            cpu1, t1 = cpu_seconds(coordinator.pid), time.monotonic()
            drivers1 = sum(cpu_seconds(d.pid) for d in drivers if d.pid is not None)
            busy1 = machine_busy_seconds()
            record["rss_mib"] = round(rss_mib(coordinator.pid), 1)
            done = [expect(outbox, "heartbeats", 60) for _ in drivers]
        finally:
            for d in drivers:
                d.join(30)
                if d.is_alive():
                    d.kill()
                    d.join()
        cpu_s = cpu1 - cpu0
        beats = sum(r["heartbeats"] for r in done)
        record.update({
            "asked_heartbeat_interval_s": max(r["asked_interval_s"] for r in done),
            "heartbeats": beats,
            "heartbeats_per_s": round(beats / (t1 - t0), 1),
            "coordinator_cpu_s": round(cpu_s, 3),
            "coordinator_cpu_pct_of_core": round(100 * cpu_s / (t1 - t0), 2),
            "coordinator_cpu_pct_max_1s": round(peak, 1),
            # The goal's unit: coordinator CPU per heartbeat (ping) interval per process, keepalive pings included;
            # and the share of a core that cost per process comes to at the id layout's limit.
            "cpu_ms_per_interval_per_process": round(1000 * cpu_s * interval_s / (t1 - t0) / num_processes, 4),
            "pct_of_core_at_16384": round(100 * cpu_s / (t1 - t0) / num_processes * MAX_PROCESSES, 1),
            "cpu_us_per_heartbeat": round(cpu_s / beats * 1e6, 1) if legacy and beats else None,
            "rss_per_session_kib": round((record["rss_mib"] - record["rss_idle_mib"]) * 1024 / num_processes, 1),
            "session_errors": sum(r["error_count"] for r in done),
            "drivers_cpu_pct_of_core": round(100 * (drivers1 - drivers0) / (t1 - t0), 1),
            "others_cpu_pct_of_core": round(100 * (busy1 - busy0 - cpu_s - (drivers1 - drivers0)) / (t1 - t0), 1),
            "coordinator_log": log_anomalies(coordinator)[:5],
        })
        if record["session_errors"]:
            record["error"] = f"session errors: {[r['errors'] for r in done]}"
    return record


# Failure detection.
@dataclass
class Observer:
    """A real ``ifrt.Client`` that records when the awaited event first arrives."""

    client: ifrt.Client
    wanted: Callable[[Event], bool]
    arrived: threading.Event = field(default_factory=threading.Event)
    at: float = 0.0
    reason: str = ""

    def on_event(self, event: Event) -> None:
        """The client's callback (on its session thread)."""
        if not self.arrived.is_set() and self.wanted(event):
            self.at = time.monotonic()
            self.reason = getattr(event, "reason", "")
            self.arrived.set()


def read_line(stream: IO[str], timeout_s: float) -> str:
    """One line from a child's stdout pipe, or "" if none comes within ``timeout_s``."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline().strip() if ready else ""


VICTIM_SIGNAL = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "sigterm": signal.SIGTERM}
"""What each kind of detection run sends: process 2 gets SIGKILL or SIGSTOP, the coordinator SIGTERM."""


def detection_run(kind: str) -> tuple[list[float], str, list[str]]:
    """One cluster of 3; kills or stops process 2 (``kill``, ``stop``) or stops the coordinator (``sigterm``);
    returns the latencies."""
    def wanted(event: Event) -> bool:
        if kind != "sigterm":
            return isinstance(event, ProcessFailed) and event.process_id == 2
        return isinstance(event, CoordinatorLost)

    with LocalCoordinator("--heartbeat-timeout", str(DETECTION_HEARTBEAT_TIMEOUT_S), num_processes=3,
                          log_level="INFO") as coordinator:
        env = {**os.environ, "IFRT_COORDINATOR": coordinator.address, "IFRT_PROCESS_ID": "2",
               "IFRT_NUM_PROCESSES": "3"}
        child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        observers = [Observer(ifrt.Client(coordinator.address, process_id=i, num_processes=3, transfer=False,
                                          timeout=CLUSTER_TIMEOUT_S), wanted) for i in (0, 1)]
        try:
            for o in observers:
                o.client.on_event(o.on_event)
            with ThreadPoolExecutor(len(observers)) as pool:
                for future in [pool.submit(o.client.discover) for o in observers]:
                    future.result(CLUSTER_TIMEOUT_S + 5)
            if not all(o.client.wait_attached(CLUSTER_TIMEOUT_S) for o in observers):
                raise RuntimeError("an observer's session did not attach")
            assert child.stdout is not None
            if read_line(child.stdout, CLUSTER_TIMEOUT_S) != "True":
                raise RuntimeError(f"process 2 did not attach its session (exit code {child.poll()})")
            victim = coordinator.pid if kind == "sigterm" else child.pid
            sent = time.monotonic()
            os.kill(victim, VICTIM_SIGNAL[kind])
            for o in observers:
                if not o.arrived.wait(EVENT_TIMEOUT_S):
                    raise RuntimeError(f"no {detection_event(kind)} within {EVENT_TIMEOUT_S}s")
            latencies = [o.at - sent for o in observers]
        finally:
            if child.poll() is None:
                child.kill()  # a stopped process too
            child.wait()
            for o in observers:
                o.client.close()
        coordinator.stop()
        expected = ("failed: lost its connection",) if kind != "sigterm" else ()
        return latencies, observers[0].reason, log_anomalies(coordinator, expected)


def detection_name(kind: str) -> str:
    """The measurement's name in the output."""
    return {"kill": "process_killed", "stop": "process_stopped", "sigterm": "coordinator_sigterm"}[kind]


def detection_event(kind: str) -> str:
    """The event the survivors wait for."""
    return "CoordinatorLost" if kind == "sigterm" else "ProcessFailed"


def detection(kind: str, repeats: int) -> dict[str, Any]:
    """``repeats`` detection runs of ``kind``, each with a new coordinator; p50 and max over both observers."""
    event = detection_event(kind)
    victim = "the coordinator" if kind == "sigterm" else "process 2"
    record: dict[str, Any] = {"measurement": detection_name(kind),
                              "signal": f"{VICTIM_SIGNAL[kind].name} to {victim}",
                              "event": event, "heartbeat_timeout_s": DETECTION_HEARTBEAT_TIMEOUT_S,
                              "repeats": repeats, "observers": 2, "load_average_1m": round(load_average(), 2)}
    runs: list[list[float]] = []
    reasons: set[str] = set()
    anomalies: list[str] = []
    for i in range(repeats):
        latencies, reason, odd = detection_run(kind)
        runs.append([round(s * 1000, 1) for s in latencies])
        reasons.add(reason)
        anomalies += odd
        progress(f"{kind} #{i + 1}: {event} after {runs[-1]} ms")
    every = [ms for run in runs for ms in run]
    record.update({
        "latency_ms": runs,
        "p50_ms": round(statistics.median(every), 1),
        "max_ms": round(max(every), 1),
        "p50_minus_timeout_ms": round(statistics.median(every) - DETECTION_HEARTBEAT_TIMEOUT_S * 1000, 1),
        "reasons": sorted(reasons),
        "coordinator_log": anomalies[:5],
    })
    return record


def measured(name: str, measure: Callable[[], dict[str, Any]]) -> bool:
    """Runs one measurement and prints its object (an "error" one if it raised); returns whether it succeeded."""
    try:
        record = measure()
    except Exception as e:  # reported as data: the other measurements still run
        record = {"measurement": name, "error": f"{type(e).__name__}: {e}"[:2000]}
    emit(record)
    return "error" not in record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", default="1024,4096,16384",
                   help="simulated process counts (default %(default)s)")
    p.add_argument("--window", type=float, default=20.0, help="measured steady window in seconds (default 20)")
    p.add_argument("--repeats", type=int, default=5, help="detection runs per kind; 0 skips them (default 5)")
    p.add_argument("--drivers", type=int, default=0,
                   help=f"driver processes (default: one per {PROCESSES_PER_DRIVER} sessions, at least 2)")
    p.add_argument("--legacy-heartbeats", action="store_true",
                   help="simulated processes heartbeat every quarter timeout whatever the coordinator asks")
    p.add_argument("--by", choices=["process", "agent"], default="process",
                   help="sessions of processes (default), or of simulated `ifrt run` agents, one per host")
    p.add_argument("--processes-per-host", type=int, default=8, help="with --by agent (default %(default)s)")
    p.add_argument("--profile", type=Path, metavar="PREFIX",
                   help="with --by agent: profile the coordinator through the window (bench/profiled.py)")
    args = p.parse_args()
    if args.repeats < 0 or args.window <= 0:
        p.error("--repeats must not be negative and --window must be positive")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))  # inherited by the coordinator and the drivers
    progress(f"RLIMIT_NOFILE {soft} -> {wanted}")
    ok = True
    for n in (int(x) for x in args.processes.split(",") if x.strip()):
        if args.by == "agent":
            profile = args.profile and args.profile.with_name(f"{args.profile.name}-{n}")
            ok &= measured("host_sessions", lambda n=n, p=profile: liveness_hosts.measure(
                n, args.processes_per_host, args.window, args.drivers, p))
            continue
        drivers = args.drivers or max(2, -(-n // PROCESSES_PER_DRIVER))
        ok &= measured("sessions", lambda n=n, d=drivers: session_cost(d, n, args.window, args.legacy_heartbeats))
    for kind in ("kill", "stop", "sigterm") if args.repeats else ():
        ok &= measured(detection_name(kind), lambda kind=kind: detection(kind, args.repeats))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
