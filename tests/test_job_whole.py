"""``JobWhole``: a process that used ``ifrt.discover()`` learns from its events when the processes that failed came
back with their ids and the job is whole again, with the generation they form: once, after the last of them, and
after the new generation when they changed it. Real coordinator and worker processes on loopback, and the pure
reading of the events."""

from __future__ import annotations

import queue

import ifrt
from ifrt import events, wire
from ifrt.wholeness import Wholeness
from tests.helpers import content, next_event, watched_cluster

HEARTBEAT_TIMEOUT = 1.0


def cluster(start_coordinator, workers, n=3):
    return watched_cluster(start_coordinator, workers, n, heartbeat_timeout=HEARTBEAT_TIMEOUT)


def events_until(received: queue.Queue, kind: type, timeout: float = 30) -> list:
    """Every event from a ``watcher`` queue up to and including the first ``kind``, in order."""
    seen = []
    while not seen or not isinstance(seen[-1], kind):
        seen.append(next_event(received, object, timeout)[1])
    return seen


def test_a_process_replaced_in_place_makes_the_job_whole_again_once(start_coordinator, workers):
    coordinator, client, received, (w1, w2) = cluster(start_coordinator, workers)
    before = client.topology
    w2.kill9()
    assert [type(e) for e in events_until(received, events.ProcessFailed)] == [events.ProcessFailed]
    again = workers(coordinator.address, 2, 3)
    assert again.expect("topology")["topology"] == before.fingerprint
    seen = events_until(received, events.JobWhole)
    assert seen[-2:] == [events.ProcessRestarted(2, 1), events.JobWhole(before, (events.ProcessRestarted(2, 1),))]
    assert seen[-1].generation == 1 and client.topology == before
    line = w1.expect("event", event="JobWhole")  # a survivor in a process of its own
    assert (line["generation"], line["fingerprint"], line["replaced"]) == (1, before.fingerprint, {"2": 1})
    client.close()


def test_two_failed_processes_make_one_event_once_both_are_back(start_coordinator, workers):
    coordinator, client, received, (w1, w2) = cluster(start_coordinator, workers)
    w1.kill9()
    w2.kill9()
    failed = events_until(received, events.ProcessFailed) + events_until(received, events.ProcessFailed)
    assert sorted(e.process_id for e in failed) == [1, 2]  # in either order
    workers(coordinator.address, 1, 3)  # answered only once the job is whole: process 2 is down
    assert events_until(received, events.ProcessRestarted)[-1] == events.ProcessRestarted(1, 1)
    workers(coordinator.address, 2, 3)
    assert events_until(received, events.JobWhole) == [  # none before process 2 came back too
        events.ProcessRestarted(2, 1),
        events.JobWhole(client.topology, (events.ProcessRestarted(1, 1), events.ProcessRestarted(2, 1)))]
    client.close()


def test_a_replacement_that_changes_the_topology_is_whole_in_its_new_generation(start_coordinator, workers):
    coordinator, client, received, (w1, w2) = cluster(start_coordinator, workers)
    w2.kill9()
    next_event(received, events.ProcessFailed, process_id=2)
    again = workers(coordinator.address, 2, 3, devices=4)
    line = again.expect("topology")
    assert line["generation"] == 2
    seen = events_until(received, events.JobWhole)
    assert [type(e) for e in seen] == [events.TopologyChanged, events.ProcessRestarted, events.JobWhole]
    whole = seen[-1]
    assert whole.generation == 2 and whole.topology.fingerprint == line["topology"]
    assert [d.local_id for d in whole.topology.devices if d.process_id == 2] == [0, 1, 2, 3]
    assert w1.expect("event", event="JobWhole")["generation"] == 2
    client.close()


def test_the_reading_waits_for_every_process_down_and_forgets_the_ids_a_generation_drops():
    one = ifrt.Topology(wire.encode(content(num_processes=3)), 0)
    two = ifrt.Topology(wire.encode(content(num_processes=2)), 0)
    w = Wholeness()
    assert w.see(events.ProcessFailed(1, "lost"), one) is None
    assert w.see(events.ProcessLeft(2), one) is None
    assert w.see(events.ProcessRestarted(1, 1), one) is None  # process 2 is still down
    assert w.see(events.TopologyChanged(two), two) == events.JobWhole(two, (events.ProcessRestarted(1, 1),))
    assert w.see(events.PreemptionNotice(1), two) is None
    assert w.see(events.ProcessRestarted(1, 2), two) == events.JobWhole(two, (events.ProcessRestarted(1, 2),))
