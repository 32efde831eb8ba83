"""Several hosts (network namespaces on one machine): ids by host address, and a host cut off the network."""

from __future__ import annotations

import time

import pytest

from coordinator.local import LocalCoordinator
from tests.netns import Hosts, skip_without_netns

HEARTBEAT = 2.0


@pytest.fixture
def hosts():
    skip_without_netns()
    with Hosts(3) as h:
        yield h


@pytest.fixture
def coordinator_on_h1(hosts):
    started: list[LocalCoordinator] = []

    def start(*args: str, num_processes: int) -> LocalCoordinator:
        c = LocalCoordinator(*args, num_processes=num_processes, bind=f"{hosts.address(1)}:8476",
                             wrapper=hosts.command(1, []))
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


def test_assigned_ids_follow_host_addresses_not_arrival(hosts, coordinator_on_h1, workers):
    coordinator = coordinator_on_h1(num_processes=2)
    late = workers(coordinator.address, None, 2, transfer_port=None, wrapper=hosts.command(3, []))
    coordinator.wait_for_log(f"({hosts.address(3)}) local rank 0 with 2 devices: 1/2 registered")  # host 3 first
    early = workers(coordinator.address, None, 2, transfer_port=None, wrapper=hosts.command(2, []))
    lines = [w.expect("topology") for w in (early, late)]
    assert [line["process_id"] for line in lines] == [0, 1]  # ordered by host address: 10.x.y.2 before .3
    assert lines[0]["topology"] == lines[1]["topology"]


def test_a_cut_off_host_is_failed_everywhere_and_learns_it(hosts, coordinator_on_h1, workers):
    coordinator = coordinator_on_h1("--heartbeat-timeout", str(HEARTBEAT), num_processes=2)
    survivor = workers(coordinator.address, 0, 2, transfer_port=None, wrapper=hosts.command(2, []))
    cut_off = workers(coordinator.address, 1, 2, transfer_port=None, wrapper=hosts.command(3, []))
    survivor.expect("topology")
    cut_off.expect("topology")
    for worker in (survivor, cut_off):  # sessions open: the survivor hears events; the cut-off one goes silent
        worker.expect("attached", attached=True)
    hosts.partition(3)
    cut_at = time.monotonic()  # the workers' "t" is this machine's monotonic clock too
    failed = survivor.expect("event", timeout=HEARTBEAT + 10, event="ProcessFailed", process_id=1)
    # its heartbeats stopped, then its keepalive went unanswered: to the coordinator it stopped answering
    assert "stopped answering (no heartbeat for" in failed["reason"] and "its host cut off" in failed["reason"]
    assert failed["t"] - cut_at < HEARTBEAT + 5  # the timeout (+ a tick) when the machine is not overloaded
    cut_off.expect("event", timeout=30, event="CoordinatorLost")  # its keepalive notices the silence
    hosts.heal(3)
    own = cut_off.expect("event", timeout=30, event="ProcessFailed", process_id=1)  # told when it reconnects
    assert "declared failed" in own["reason"]
