"""Liveness with real processes: kill -9, restarts, failure policies, barriers, key-values, coordinator loss."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
import urllib.request

import grpc
import pytest

import ifrt
from ifrt import events
from ifrt._generated import coordinator_pb2 as pb
from ifrt.client_config import CHANNEL_OPTIONS
from tests.helpers import (
    SERVICE,
    barrier_started_for,
    ifrt_status,
    metrics_port,
    next_event,
    wait_status,
    watched_cluster,
    watcher,
)

HEARTBEAT_TIMEOUT = 1.0
SLACK = 5.0  # scheduling on a loaded 2-core machine; detection itself is within the heartbeat timeout + a tick


def cluster(start_coordinator, workers, n=3, *flags: str, worker_args=()):
    return watched_cluster(start_coordinator, workers, n, *flags, heartbeat_timeout=HEARTBEAT_TIMEOUT,
                           worker_args=worker_args)


@pytest.mark.serial  # a closed connection seen before the 0.4 s heartbeat lapses: a loaded machine reverses them
def test_kill_9_is_reported_to_every_other_process_and_fails_its_barriers(start_coordinator, workers):
    coordinator, client, received, (w1, w2) = cluster(start_coordinator, workers)
    barrier_result: queue.Queue = queue.Queue()

    def arrive():
        try:
            client.barrier("before-step-1", timeout=60)
            barrier_result.put(None)
        except ifrt.IfrtError as e:
            barrier_result.put(e)

    threading.Thread(target=arrive, daemon=True).start()
    seen = barrier_started_for(coordinator.address, client, "before-step-1")
    assert "was started for processes [0, 1, 2]" in seen  # pending: processes 1 and 2 never arrive
    assert barrier_result.empty()
    killed_at = w2.kill9()
    at, event = next_event(received, events.ProcessFailed, process_id=2)
    assert at - killed_at < HEARTBEAT_TIMEOUT + SLACK
    assert "lost its connection and did not come back" in event.reason
    other = w1.expect("event", event="ProcessFailed", process_id=2)
    assert other["t"] - killed_at < HEARTBEAT_TIMEOUT + SLACK
    error = barrier_result.get(timeout=10)
    assert isinstance(error, ifrt.BarrierFailed) and not isinstance(error, ifrt.BarrierTimeout)
    assert "process 2 failed" in str(error)
    client.close()


def test_a_stopped_process_is_failed_by_its_unanswered_keepalive_and_told_when_it_resumes(start_coordinator,
                                                                                           workers):
    _, client, received, (w1, w2) = cluster(start_coordinator, workers)
    for w in (w1, w2):  # both hold a session: w1 hears the failure, w2's connection is the one that goes silent
        w.expect("attached", attached=True)
    assert client.wait_attached(10)
    os.kill(w2.process.pid, signal.SIGSTOP)  # alive to the kernel (its socket stays open), silent to gRPC
    stopped_at = time.monotonic()
    try:
        at, event = next_event(received, events.ProcessFailed, process_id=2)
    finally:
        os.kill(w2.process.pid, signal.SIGCONT)
    assert at - stopped_at < HEARTBEAT_TIMEOUT + SLACK
    # At a 1 s timeout a heartbeat the loaded coordinator reads late can make the hang look like a lost connection;
    # the 6 s test below tells them apart
    assert "stopped answering (no heartbeat for" in event.reason or "lost its connection" in event.reason
    assert w1.expect("event", event="ProcessFailed", process_id=2)["t"] - stopped_at < HEARTBEAT_TIMEOUT + SLACK
    own = w2.expect("event", event="ProcessFailed", process_id=2)  # resumed: its new session is refused
    assert "declared failed" in own["reason"]
    client.close()


@pytest.mark.serial  # slow within a second of timeout / 3: a loaded machine delays the report
def test_a_stopped_process_shows_as_slow_before_it_is_declared_failed(start_coordinator, workers):
    timeout = 6.0  # slow after 2 s without a heartbeat; failed about 6 s after it stopped
    coordinator = start_coordinator("--heartbeat-timeout", str(timeout), "--metrics-port", "0", "--metrics-bind",
                                    "127.0.0.1", num_processes=2)
    worker = workers(coordinator.address, 1, 2)
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=60)
    received = watcher(client)
    client.discover()
    worker.expect("attached", attached=True)
    assert client.wait_attached(10)

    def process(status: dict, pid: int) -> dict:
        return next(p for p in status["processes"] if p["process_id"] == pid)

    healthy = wait_status(coordinator.address, lambda s: process(s, 1)["attached"])
    assert process(healthy, 1)["heartbeat_age_s"] < timeout / 3  # heard from every 1.2 s
    os.kill(worker.process.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        slow = wait_status(coordinator.address, lambda s: process(s, 1)["heartbeat_age_s"] > timeout / 3)
        slow_after = time.monotonic() - stopped_at
        text = ifrt_status("--coordinator", coordinator.address).stdout
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(coordinator)}/metrics", timeout=10).read()
        at, event = next_event(received, events.ProcessFailed, process_id=1)
    finally:
        os.kill(worker.process.pid, signal.SIGCONT)
    assert process(slow, 1)["state"] == "alive" and process(slow, 0)["heartbeat_age_s"] < timeout / 3
    assert slow_after < timeout / 3 + SLACK and at > stopped_at + slow_after  # slow first, failed later
    row = next(line for line in text.splitlines() if line.split()[:1] == ["1"])
    assert "alive (slow)" in row, text
    assert b"\nifrt_processes_slow 1.0\n" in metrics, metrics.decode()
    assert "stopped answering" in event.reason
    client.close()


class RawSession:
    """A registered process that holds its session stream by hand, sending Heartbeat messages every ``beat_s``
    seconds (as clients that predate keepalive liveness did) or none at all; collects the events it gets."""

    def __init__(self, address: str, process_id: int, num_processes: int, beat_s: float | None) -> None:
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.events: queue.Queue = queue.Queue()
        self._beat_s = beat_s
        self._closed = threading.Event()
        request = pb.RegisterRequest(num_processes=num_processes, client_uid=f"raw-{process_id}",
                                     hostname=f"raw-{process_id}", plugin="cpu", wait_ms=1000)
        request.process_id = process_id
        request.devices.add(local_id=0, platform="cpu", kind="cpu")
        self._request = request
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        register = self.channel.unary_unary(f"{SERVICE}/Register")
        while not pb.RegisterResponse.FromString(register(self._request.SerializeToString(), timeout=30)).topology:
            pass
        opening = pb.SessionRequest(open=pb.SessionOpen(client_uid=self._request.client_uid))
        stream = self.channel.stream_stream(f"{SERVICE}/Session")(self._messages(opening))
        try:
            for raw in stream:
                self.events.put(pb.SessionEvent.FromString(raw))
        except grpc.RpcError:
            if not self._closed.is_set():
                raise  # a failed stream: next() then names the event that never came

    def _messages(self, opening: pb.SessionRequest):
        yield opening.SerializeToString()
        while not self._closed.wait(self._beat_s):
            yield pb.SessionRequest(heartbeat=pb.Heartbeat()).SerializeToString()

    def next(self, kind: str, timeout: float = 30) -> pb.SessionEvent:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            with contextlib.suppress(queue.Empty):
                event = self.events.get(timeout=remaining)
                if event.WhichOneof("kind") == kind:
                    return event
        raise AssertionError(f"raw session of {self._request.client_uid} got no {kind} event within {timeout}s")

    def close(self) -> None:
        self._closed.set()
        self.channel.close()


def test_sessions_need_no_heartbeats_and_heartbeating_ones_still_work(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), num_processes=3)
    silent = RawSession(coordinator.address, 1, 3, beat_s=None)
    beating = RawSession(coordinator.address, 2, 3, beat_s=HEARTBEAT_TIMEOUT / 10)
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=3, timeout=60)
    received = watcher(client)
    try:
        client.discover()
        attached = [raw.next("attached") for raw in (silent, beating)]
        # it asks for one every fifth of the timeout (so that a quiet session shows as slow), but fails nobody for it
        assert all(a.attached.heartbeat_interval_ms == round(HEARTBEAT_TIMEOUT / 5 * 1000) for a in attached)
        time.sleep(3 * HEARTBEAT_TIMEOUT)  # deliberately: three timeouts of sending nothing on one session
        assert [e for _, e in list(received.queue) if isinstance(e, events.ProcessFailed)] == []
        with grpc.insecure_channel(coordinator.address) as channel:
            status = pb.StatusResponse.FromString(channel.unary_unary(f"{SERVICE}/Status")(
                pb.StatusRequest().SerializeToString(), timeout=10))
        alive = pb.PROCESS_PHASE_ALIVE
        assert [(p.process_id, p.phase, p.attached) for p in status.processes] == [
            (0, alive, True), (1, alive, True), (2, alive, True)]
        client.close()  # its Leave reaches both, whatever they send
        for raw in (silent, beating):
            assert raw.next("process_left").process_left.process_id == 0
    finally:
        silent.close()
        beating.close()
        client.close()
    noise = [line for line in coordinator.log.splitlines()
             if ("WARNING" in line or "ERROR" in line) and "no cluster token" not in line]  # but the start-up notice
    assert noise == []


def test_restart_with_the_same_devices_keeps_ids_and_generation(start_coordinator, workers):
    coordinator, client, received, (w1, w2) = cluster(start_coordinator, workers)
    before = client.topology
    w2.kill9()
    next_event(received, events.ProcessFailed, process_id=2)
    again = workers(coordinator.address, 2, 3)
    line = again.expect("topology")
    assert (line["topology"], line["generation"], line["process_id"]) == (before.fingerprint, 1, 2)
    next_event(received, events.ProcessRestarted, process_id=2, incarnation=1)
    w1.expect("event", event="ProcessRestarted", process_id=2)
    assert client.topology == before
    client.close()


def test_restart_with_other_devices_publishes_the_next_generation_everywhere(start_coordinator, workers):
    coordinator, client, received, (w1, w2) = cluster(start_coordinator, workers)
    w2.kill9()
    again = workers(coordinator.address, 2, 3, devices=4)
    line = again.expect("topology")
    assert line["generation"] == 2
    _, changed = next_event(received, events.TopologyChanged)
    assert changed.topology.generation == 2 and changed.topology.fingerprint == line["topology"]
    assert client.topology.fingerprint == line["topology"]
    assert [d.local_id for d in client.topology.devices if d.process_id == 2] == [0, 1, 2, 3]
    assert w1.expect("event", event="TopologyChanged")["fingerprint"] == line["topology"]
    client.close()


def test_elastic_policy_publishes_the_survivors(start_coordinator, workers):
    _, client, received, (w1, w2) = cluster(
        start_coordinator, workers, 3, "--on-failure", "elastic", "--min-processes", "2")
    w1.kill9()
    _, changed = next_event(received, events.TopologyChanged)
    assert changed.topology.generation == 2
    assert [p.process_id for p in changed.topology.processes] == [0, 2]
    assert w2.expect("event", event="TopologyChanged")["fingerprint"] == changed.topology.fingerprint
    assert client.topology.process_id == 0
    client.close()


def test_elastic_policy_below_the_minimum_is_a_fatal_failure(start_coordinator, workers):
    _, client, received, (w1, _) = cluster(
        start_coordinator, workers, 3, "--on-failure", "elastic", "--min-processes", "3")
    w1.kill9()
    _, failed = next_event(received, events.ProcessFailed, process_id=1)
    assert "fewer than --min-processes 3: the cluster cannot continue" in failed.reason
    assert client.topology.generation == 1
    client.close()


def test_barrier_and_key_values_across_processes(start_coordinator, workers):
    coordinator = start_coordinator("--kv-max-value-bytes", "1024", num_processes=3)
    w1 = workers(coordinator.address, 1, 3, "--kv-set", "nccl/unique-id=abc123", "--barrier", "ready")
    w2 = workers(coordinator.address, 2, 3, "--kv-get", "nccl/unique-id", "--barrier", "ready")
    with ifrt.Client(coordinator.address, process_id=0, num_processes=3, timeout=60) as client:
        client.discover()
        assert client.kv_get("nccl/unique-id", timeout=30) == b"abc123"
        assert w2.expect("kv_get")["value"] == "abc123"
        client.barrier("ready", timeout=30)
        assert w1.expect("barrier")["barrier"] == "ok"
        assert w2.expect("barrier")["barrier"] == "ok"
        client.kv_set("nccl/other", b"x")
        assert client.kv_dir("nccl/") == {"nccl/other": b"x", "nccl/unique-id": b"abc123"}
        with pytest.raises(ifrt.KeyExists, match="already holds another value"):
            client.kv_set("nccl/unique-id", b"different")
        with pytest.raises(ifrt.InvalidArgument, match="2000 bytes: expected at most 1024"):
            client.kv_set("big", b"x" * 2000)
        with pytest.raises(ifrt.KeyValueTimeout, match=r"'never' was not set within 0\.5s"):
            client.kv_get("never", timeout=0.5)
        with pytest.raises(ifrt.BarrierTimeout, match=r"2 of 3 processes did not arrive: 1 \(.*\), 2 \("):
            client.barrier("lonely", timeout=1.0)
        assert client.kv_get("nccl/unique-id", timeout=1) == b"abc123"  # nothing else changed


def test_graceful_close_is_reported_as_left(start_coordinator, workers):
    _, client, received, (_, w2) = cluster(start_coordinator, workers)
    w2.stop()
    next_event(received, events.ProcessLeft, process_id=2)
    # Deliberately let time pass: twice the heartbeat timeout after which a silent process would be failed.
    time.sleep(2 * HEARTBEAT_TIMEOUT)
    assert all(not isinstance(e, events.ProcessFailed) for _, e in list(received.queue))
    client.close()


def test_coordinator_sigterm_is_seen_at_once(start_coordinator, workers):
    coordinator, client, received, (w1, _) = cluster(start_coordinator, workers)
    assert client.wait_attached(10)
    os.kill(coordinator.pid, signal.SIGTERM)
    stopped_at = time.monotonic()
    at, lost = next_event(received, events.CoordinatorLost, timeout=10)
    assert "shutting down" in lost.reason  # told by the coordinator, not found out by a keepalive timeout
    assert at - stopped_at < 5.0
    w1.expect("event", event="CoordinatorLost")
    client.close()  # its Leave reaches a coordinator that is shutting down: refused, not left hanging
    assert coordinator.process.wait(30) == 0
    assert "Traceback" not in coordinator.log and "ERROR" not in coordinator.log


def test_processes_reattach_to_a_restarted_coordinator(start_coordinator, workers):
    coordinator, client, received, (w1, _) = cluster(start_coordinator, workers)
    before = client.topology
    coordinator.stop(signal.SIGKILL)
    next_event(received, events.CoordinatorLost)
    start_coordinator("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), num_processes=3, bind=coordinator.address)
    next_event(received, events.CoordinatorRestored, timeout=30)
    assert client.topology == before  # everyone registered again: the same bytes, same generation
    w1.expect("event", event="CoordinatorRestored")
    client.kv_set("after-restart", b"1")  # the restarted coordinator knows this process again
    assert client.kv_get("after-restart", timeout=5) == b"1"
    client.close()
