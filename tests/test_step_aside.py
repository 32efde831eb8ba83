"""A leader cut off from the job steps aside instead of declaring it dead (docs/failures.md, "A leader cut off from
most of the job"): two replicas on a real etcd, each on its own loopback address; the job's three processes are
real worker processes. The cut is real: iptables drops every packet to and from the leader's gRPC port (silence, no
reset), while the leader keeps etcd and the standby stays reachable. Every rule made is removed afterwards."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from coordinator.local import LocalCoordinator
from tests.helpers import poll_until
from tests.netns import skip_without_iptables
from tests.workers import Worker

HEARTBEAT = 3.0
LEADER_TTL = "2"
NUM = 3
FAILED = re.compile(r"process \d+ .* failed: ")


def loopback_addresses() -> tuple[str, str]:
    """Two loopback addresses of this test's own (127.0.0.0/8 is all local), so that one can be cut alone."""
    tag = os.getpid() % 60000
    return f"127.{100 + tag // 250 % 100}.{tag % 250}.1", f"127.{100 + tag // 250 % 100}.{tag % 250}.2"


@contextmanager
def cut(address: str) -> Iterator[None]:
    """Drops every TCP packet to and from ``address`` ("ip:port") on loopback while the block runs; the rules are
    removed afterwards whatever happens."""
    ip, port = address.rsplit(":", 1)
    rules = [["INPUT", "-i", "lo", "-p", "tcp", "-d", ip, "--dport", port, "-j", "DROP"],
             ["INPUT", "-i", "lo", "-p", "tcp", "-s", ip, "--sport", port, "-j", "DROP"]]
    made = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True, timeout=30)
            made.append(rule)
        yield
    finally:
        for rule in made:
            subprocess.run(["iptables", "-D", *rule], check=True, capture_output=True, timeout=30)


@pytest.fixture
def replicas(etcd):
    """Two replicas of one job on ``etcd``, on addresses of their own: (leader, standby), once one serves."""
    if os.geteuid() != 0:
        pytest.skip("needs root for iptables")
    skip_without_iptables()
    args = ("--store", etcd.url, "--leader-ttl", LEADER_TTL, "--heartbeat-timeout", str(HEARTBEAT),
            "--cluster-id", "job")
    started = [LocalCoordinator(*args, num_processes=NUM, bind=f"{ip}:0") for ip in loopback_addresses()]
    try:
        leader = poll_until(lambda: next((c for c in started if "serving:" in c.log), None), timeout=30,
                            what="a replica to serve")
        standby = next(c for c in started if c is not leader)
        standby.wait_for_log("standing by")
        yield leader, standby
    finally:
        for c in started:
            c.close()


def start_job(leader: LocalCoordinator, standby: LocalCoordinator) -> list[Worker]:
    addresses = f"{leader.address},{standby.address}"
    workers = [Worker(addresses, pid, NUM, "--barrier", "after", "--barrier-when-told", transfer_port=None)
               for pid in range(NUM)]
    for w in workers:
        w.expect("topology", timeout=60)
        w.expect("attached", timeout=30, attached=True)
    return workers


def test_a_leader_cut_off_from_the_job_steps_aside_and_the_job_goes_on(replicas):
    leader, standby = replicas
    workers = start_job(leader, standby)
    try:
        time.sleep(1.0)  # every session heard from
        with cut(leader.address):
            cut_at = time.monotonic()
            leader.wait_for_log("standing aside", timeout=2 * HEARTBEAT + 10)
            aside_after = time.monotonic() - cut_at
            standby.wait_for_log("serving:", timeout=20)
            for w in workers:  # each re-attaches to the standby, within its grace
                w.expect("event", timeout=2 * HEARTBEAT + 10, event="CoordinatorRestored")
            for w in workers:  # the job goes on: a barrier of every process completes
                w.tell("arrive")
            for w in workers:
                assert w.expect("barrier", timeout=30)["barrier"] == "ok"
        print(f"cut to standing aside: {aside_after:.2f}s (heartbeat timeout {HEARTBEAT}s)")
        assert HEARTBEAT <= aside_after < 1.25 * HEARTBEAT + 2.0
        assert not FAILED.search(leader.log), leader.log  # nothing declared on that evidence...
        assert not FAILED.search(standby.log), standby.log  # ...nor by the replica that took over
        assert not any(line.get("event") == "ProcessFailed" for w in workers for line in w.seen)
    finally:
        for w in workers:
            w.stop()


@pytest.mark.serial  # a bound of seconds on heartbeats, a lease and a takeover, which other tests' load stretches
def test_a_job_killed_silently_is_still_declared_failed_within_the_bound(replicas):
    leader, standby = replicas
    workers = start_job(leader, standby)
    stopped_at = time.monotonic()
    try:
        for w in workers:  # silent, as hosts powered off are: connections open, nothing answered
            os.kill(w.process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        leader.wait_for_log("standing aside", timeout=2 * HEARTBEAT + 10)
        bound = 2.25 * HEARTBEAT + float(LEADER_TTL) + 3.0  # suspect, stand aside, the grace after a takeover
        poll_until(lambda: len(FAILED.findall(standby.log)) == NUM, timeout=bound + 10,
                   what="every process to be declared failed by the replica that took over")
        took = time.monotonic() - stopped_at
        print(f"every process silent to all declared failed: {took:.2f}s (heartbeat timeout {HEARTBEAT}s)")
        assert took < bound, standby.log
        assert not FAILED.search(leader.log), leader.log
    finally:
        for w in workers:
            os.kill(w.process.pid, signal.SIGCONT)
            w.stop()


def test_a_job_killed_outright_is_declared_failed_as_fast_as_before(replicas):
    leader, standby = replicas
    workers = start_job(leader, standby)
    for w in workers:
        w.kill9()  # their sockets close at once: no suspicion, the reconnect grace
    killed_at = time.monotonic()
    poll_until(lambda: len(FAILED.findall(leader.log)) == NUM, timeout=HEARTBEAT + 10,
               what="every killed process to be declared failed")
    took = time.monotonic() - killed_at
    print(f"every process killed to all declared failed: {took:.2f}s (heartbeat timeout {HEARTBEAT}s)")
    assert took < HEARTBEAT / 8 + 2.0
    assert "standing aside" not in leader.log
