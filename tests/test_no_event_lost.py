"""No event is lost: a process learns of every change after the topology it holds, also when it happened before its
session attached or while it reconnected to a new leader; each once, in order.

A session is held back by its client's test gate (ifrt.settings.SESSION_GATE_ENV: it does not open while a file is
missing), so the events happen before it attaches by construction, not by timing.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

import ifrt
from ifrt import events
from ifrt._generated import coordinator_pb2 as pb
from ifrt.protocol import SECRET_METADATA
from ifrt.settings import SESSION_GATE_ENV
from tests.helpers import SERVICE, free_port, next_event, poll_until, watcher
from tests.replicas import NUM, Replicas, client0, start_worker

HEARTBEAT_TIMEOUT = "10"  # a held session leaves its process on the clock: this long before it would be failed
LEFT, FAILED = pb.PROCESS_PHASE_LEFT, pb.PROCESS_PHASE_FAILED
JOB_EVENTS = (events.ProcessFailed, events.ProcessLeft, events.ProcessRestarted, events.PreemptionNotice)


def wait_phases(address: str, expected: dict[int, int], timeout: float = 60) -> None:
    """Waits until the coordinator at ``address`` reports each process id in ``expected`` in its phase."""
    with grpc.insecure_channel(address) as channel:
        status = channel.unary_unary(f"{SERVICE}/Status")

        def phases() -> dict[int, int]:
            report = pb.StatusResponse.FromString(status(pb.StatusRequest().SerializeToString(), timeout=10))
            return {p.process_id: p.phase for p in report.processes}

        poll_until(phases, lambda seen: all(seen.get(pid) == phase for pid, phase in expected.items()), timeout,
                   f"{address} to report the phases {expected}")


def drained(client: ifrt.Client) -> None:
    """Returns once the session has delivered everything the coordinator queued for it so far: a watched key's
    change travels on the same stream, after every event sent before it."""
    changes = client.kv_watch("drained/", timeout=30)
    client.kv_set(f"drained/{time.monotonic_ns()}", b"1")
    assert next(changes, None) is not None, "the watched key's change never arrived"


def opening(address: str, client: ifrt.Client, since: int) -> list[tuple[str, int]]:
    """(kind, event number) of what a second, hand-held session of ``client``'s process opened from job event
    ``since`` is sent, up to the acknowledgement of a watch sent right after the opening."""
    open_ = pb.SessionOpen(client_uid=client.client_uid, generation=client.topology.generation, since_event=since)
    requests = [pb.SessionRequest(open=open_), pb.SessionRequest(watch=pb.WatchKeys(prefix="raw/"))]
    with grpc.insecure_channel(address) as channel:
        stream = channel.stream_stream(f"{SERVICE}/Session")(
            (r.SerializeToString() for r in requests), metadata=((SECRET_METADATA, client.process_secret),),
            timeout=30)
        sent = [pb.SessionEvent.FromString(raw) for raw in stream]  # ends once its requests have ended
    return [(e.WhichOneof("kind"), e.event_number) for e in sent]


def job_events(received) -> list[tuple[str, int]]:
    return [(type(e).__name__, e.process_id) for _, e in list(received.queue) if isinstance(e, JOB_EVENTS)]


def held_then_left_and_failed(start_coordinator, workers, gate: Path, *flags: str):
    """Process 0 (a Client here) discovers with its session held; then process 1 leaves and process 2 is killed
    (failed), both decided by the coordinator before the gate opens."""
    coordinator = start_coordinator("--heartbeat-timeout", HEARTBEAT_TIMEOUT, *flags, num_processes=3)
    w1, w2 = (workers(coordinator.address, pid, 3) for pid in (1, 2))
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=3, timeout=60)
    received = watcher(client)
    topology = client.discover()
    for w in (w1, w2):
        assert w.expect("topology")["topology"] == topology.fingerprint
    w1.stop()  # closes its client: Leave
    w2.kill9()
    wait_phases(coordinator.address, {1: LEFT, 2: FAILED})
    assert not client.wait_attached(0)
    gate.touch()
    assert client.wait_attached(30)
    drained(client)
    return coordinator, client, received


@pytest.fixture
def gate(tmp_path, monkeypatch) -> Path:
    """The file whose absence holds the sessions of Clients made in this test."""
    path = tmp_path / "session-gate"
    monkeypatch.setenv(SESSION_GATE_ENV, str(path))
    return path


def test_events_before_the_session_attaches_arrive_once_it_does_in_order_once_each(start_coordinator, workers, gate):
    coordinator, client, received = held_then_left_and_failed(start_coordinator, workers, gate)
    assert job_events(received) == [("ProcessLeft", 1), ("ProcessFailed", 2)]
    since = client.events_since_topology()
    assert [(type(e).__name__, e.process_id) for e in since] == [("ProcessLeft", 1), ("ProcessFailed", 2)]
    # A start-up exchange that begins watching now still sees both, before anything newer.
    late = client.watch(timeout=0.5, since_topology=True)
    assert [type(e).__name__ for e in late] == ["ProcessLeft", "ProcessFailed"]
    called: list = []
    client.on_event(called.append, since_topology=True)
    assert [type(e).__name__ for e in called] == ["ProcessLeft", "ProcessFailed"]
    # On the wire: the topology answer's position (generation 1 is job event 1), and what a session opening from it
    # is sent; a session that sends no position (as clients that predate numbering) only what happens from now on.
    assert client.topology_position == 1
    assert opening(coordinator.address, client, 1) == [("attached", 0), ("process_left", 2), ("process_failed", 3),
                                                       ("watching", 0)]
    assert opening(coordinator.address, client, 0) == [("attached", 0), ("watching", 0)]
    client.close()


def test_a_session_further_behind_than_the_history_gets_each_process_state(start_coordinator, workers, gate):
    coordinator, client, received = held_then_left_and_failed(start_coordinator, workers, gate,
                                                              "--max-event-history", "1")
    # The history holds only the failure: the session is sent the state of each process instead, failures first.
    assert job_events(received) == [("ProcessFailed", 2), ("ProcessLeft", 1)]
    assert "no longer holds: sent each process's state" in coordinator.log
    client.close()


def test_a_session_that_reconnects_to_the_new_leader_gets_the_events_it_missed_once_each(etcd, gate):
    ports = {pid: free_port() for pid in range(NUM)}
    gate.touch()
    replicas = Replicas(etcd, heartbeat=HEARTBEAT_TIMEOUT)
    try:
        w1, w2 = (start_worker(replicas, pid, ports) for pid in (1, 2))
        client = client0(replicas, ports)
        received = watcher(client)
        topology = client.discover()
        for w in (w1, w2):
            assert w.expect("topology")["topology"] == topology.fingerprint
        assert client.wait_attached(30)
        client.report_preemption()  # an event this session receives before the failover
        next_event(received, events.PreemptionNotice, process_id=0)
        gate.unlink()  # from now on the session does not open again until the gate is back
        replicas.kill_leader()
        next_event(received, events.CoordinatorLost)
        for w in (w1, w2):  # attached to the new leader: a kill is then noticed at once
            w.expect("event", event="CoordinatorRestored")
        w1.stop()
        w2.kill9()
        wait_phases(replicas.leader.address, {1: LEFT, 2: FAILED})
        gate.touch()
        next_event(received, events.CoordinatorRestored)
        drained(client)
        # What arrived after the notice was taken: the two missed events, and the notice not again.
        assert job_events(received) == [("ProcessLeft", 1), ("ProcessFailed", 2)]
        client.close()
    finally:
        replicas.close()
