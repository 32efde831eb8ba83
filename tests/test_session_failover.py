"""A session comes back after a failover while a replica serves, and what a process prints meanwhile is one voice.

Real coordinator replicas on a real etcd; leaders killed (SIGKILL) and a replica stopped (SIGSTOP) by pid. A stopped
replica stands for one that is hung or cut off without a word: its connections stay open and nothing answers on
them, which without a bound held a session on it until the connection's keepalive gave up (15 s), past the grace a
new leader gives every process to re-attach: the process was declared failed and its session never came back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import ifrt
from coordinator.local import LocalCoordinator
from ifrt.events import CoordinatorLost, CoordinatorRestored, ProcessFailed
from tests.replicas import LEADER_TTL, Replicas, serving

LIVE_WORKER = Path(__file__).with_name("live_worker.py")
HEARTBEAT = 3.0  # the replicas' --heartbeat-timeout: the attach bound is half of it
BOUNDS = ("the failover window (", "the attach bound", "the discovery timeout (", " s timeout of ")
"""How a line names the bound it counts against."""
GRPC_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
"""gRPC core's own log lines (glog format), which ifrt neither writes nor words."""


def _replica(etcd, num_processes: int) -> LocalCoordinator:
    return LocalCoordinator("--store", etcd.url, "--leader-ttl", LEADER_TTL, "--heartbeat-timeout", f"{HEARTBEAT:g}",
                            "--cluster-id", "job", num_processes=num_processes)


@contextlib.contextmanager
def _stopped(replica: LocalCoordinator):
    """``replica`` stopped (SIGSTOP by pid) for the block; continued afterwards so that it can be closed."""
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(replica.pid, signal.SIGCONT)


def test_a_silent_replica_costs_a_session_at_most_the_attach_bound_and_it_comes_back(etcd, caplog):
    caplog.set_level(logging.INFO, logger="ifrt.wait")
    leader = _replica(etcd, 1)
    replicas = [leader]
    try:
        serving(leader)
        silent, successor = _replica(etcd, 1), _replica(etcd, 1)
        replicas += [silent, successor]
        # The silent replica first: registration asks it (a standby) before the leader, so this process holds an open
        # connection to it; after the leader, the successor, so the session tries successor, silent, leader, ...
        addresses = ",".join(r.address for r in (silent, leader, successor))
        events: queue.Queue = queue.Queue()
        with ifrt.Client(addresses, process_id=0, num_processes=1, transfer=False, timeout=60) as client:
            client.on_event(events.put)
            client.discover()
            assert client.wait_attached(30) and client.current_coordinator() == leader.address
            with _stopped(silent):
                killed = time.monotonic()
                leader.stop(signal.SIGKILL)
                seen = []
                while not any(isinstance(e, CoordinatorRestored | ProcessFailed) for e in seen):
                    seen.append(events.get(timeout=60))
                back = time.monotonic() - killed
                assert isinstance(seen[0], CoordinatorLost), seen
                assert seen[-1] == CoordinatorRestored(successor.address), seen  # not ProcessFailed(0, ...)
                # A takeover (--leader-ttl 2) and at most one attach bound (1.5 s) on the silent replica, well within
                # the new leader's grace: without the bound the session waited out the keepalive (15 s) there.
                assert back < 2 * HEARTBEAT + 1, back
                time.sleep(HEARTBEAT + 1)  # past the grace: the new leader still holds the process live
                assert client.kv_try_get("missing", timeout=10) is None
            assert "failed" not in successor.log, successor.log
    finally:
        for r in replicas:
            r.close()
    said = [r.getMessage() for r in caplog.records if r.name == "ifrt.wait"]
    skipped = [line for line in said if f"coordinator {silent.address} did not answer the session within" in line]
    assert skipped and "the attach bound" in skipped[0], said


def _stderr_lines(process: subprocess.Popen, into: list[str]) -> None:
    for line in process.stderr:  # type: ignore[union-attr]
        into.append(line.rstrip("\n"))


def test_what_a_process_prints_during_a_failover_is_prefixed_and_names_its_bound(etcd):
    with Replicas(etcd, num_processes=2, heartbeat=f"{HEARTBEAT:g}") as replicas:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        env.update(IFRT_COORDINATOR=replicas.addresses, IFRT_PROCESS_ID="0", IFRT_NUM_PROCESSES="2",
                   IFRT_CPU_DEVICE_COUNT="1", IFRT_FAILOVER_WINDOW="20")
        # A plain program: no logging set up, so what ifrt says reaches stderr as the program's user sees it.
        worker = subprocess.Popen([sys.executable, str(LIVE_WORKER), "--kv-get", "after"], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stderr: list[str] = []
        threading.Thread(target=_stderr_lines, args=(worker, stderr), daemon=True).start()
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(json.loads(raw)) for raw in worker.stdout], daemon=True).start()

        def expect(key: str, timeout: float = 60, **match) -> dict:
            deadline = time.monotonic() + timeout
            while (remaining := deadline - time.monotonic()) > 0:
                with contextlib.suppress(queue.Empty):
                    line = lines.get(timeout=remaining)
                    if key in line and all(line.get(k) == v for k, v in match.items()):
                        return line
            raise AssertionError(f"the worker printed no {key} {match}; its stderr: {stderr}")

        try:
            with ifrt.Client(replicas.addresses, process_id=1, num_processes=2, transfer=False, timeout=60) as client:
                client.discover()
                expect("attached", attached=True)
                before = len(stderr)
                replicas.kill_leader()  # the worker waits in kv_get("after") meanwhile
                expect("event", event="CoordinatorLost")
                expect("event", event="CoordinatorRestored")
                client.kv_set("after", b"1")
                assert expect("kv_get")["value"] == "1"
            worker.stdin.close()  # type: ignore[union-attr]
            worker.wait(30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    during = [line for line in stderr[before:] if line.strip() and not GRPC_LOG.match(line)]
    assert any("lost the coordinator" in line for line in during), stderr
    assert any("session re-attached to coordinator" in line for line in during), stderr
    for line in during:
        assert line.startswith("ifrt: "), f"a line without ifrt's prefix: {line!r}; all: {during}"
        assert any(bound in line for bound in BOUNDS), f"a line that names no bound: {line!r}; all: {during}"
    windows = [line for line in during if "the failover window (" in line]
    assert windows and all("the failover window (20 s, IFRT_FAILOVER_WINDOW)" in line for line in windows), during


@pytest.mark.parametrize(("heartbeat", "bound"), [(None, 10.0), (10.0, 5.0), (3.0, 1.5), (1.0, 1.0), (600.0, 10.0)])
def test_the_attach_bound_is_half_the_heartbeat_timeout_within_limits(heartbeat, bound):
    from ifrt.session import attach_bound

    assert attach_bound(heartbeat) == bound
