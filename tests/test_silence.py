"""The heartbeat timeout is the tolerance it says, with real processes: a process silent (stopped with SIGSTOP: its
connection stays open and answers nothing, so the coordinator's keepalive drops it) for 0.7 of --heartbeat-timeout,
again and again, is never declared failed; one silent for 1.5 of it is, no sooner than the timeout after it went
silent and within a quarter of it more."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ifrt.events import ProcessFailed
from tests.helpers import next_event, watched_cluster

TIMEOUT = 3.0
FLAPS = 3


def stopped_for(pid: int, seconds: float) -> float:
    """SIGSTOPs ``pid`` for ``seconds`` (then SIGCONT); returns when it was stopped (monotonic clock)."""
    os.kill(pid, signal.SIGSTOP)
    at = time.monotonic()
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return at


def test_a_process_silent_for_less_than_the_timeout_is_never_declared_failed(start_coordinator, workers):
    coordinator, client, received, (worker,) = watched_cluster(
        start_coordinator, workers, 2, heartbeat_timeout=TIMEOUT, worker_args=("--barrier", "after",
                                                                              "--barrier-when-told"))
    try:
        for _ in range(FLAPS):  # before: each silence of 0.7 timeouts failed it with odds of about 1 in 2
            stopped_for(worker.process.pid, 0.7 * TIMEOUT)
            time.sleep(1.0)  # it attaches again and answers before the next one
        time.sleep(TIMEOUT)
        assert "declared failed" not in coordinator.log and "stopped answering" not in coordinator.log, \
            coordinator.log
        with pytest.raises(AssertionError, match="no ProcessFailed"):
            next_event(received, ProcessFailed, timeout=0.1)
        worker.tell("arrive")  # the job goes on, with both processes
        client.barrier("after", timeout=10)
        assert worker.expect("barrier", timeout=10)["barrier"] == "ok"
    finally:
        client.close()


def test_a_process_silent_beyond_the_timeout_is_declared_failed_within_a_quarter_more(start_coordinator, workers):
    _coordinator, client, received, (worker,) = watched_cluster(start_coordinator, workers, 2,
                                                                heartbeat_timeout=TIMEOUT)
    try:
        time.sleep(1.0)
        os.kill(worker.process.pid, signal.SIGSTOP)
        silent_from = time.monotonic()
        try:
            at, event = next_event(received, ProcessFailed, timeout=1.5 * TIMEOUT + 5, process_id=1)
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)
        took = at - silent_from
        print(f"SIGSTOP to ProcessFailed: {took:.2f}s (heartbeat timeout {TIMEOUT}s)")
        assert TIMEOUT <= took < 1.25 * TIMEOUT + 1.0, (took, event)  # + 1 s for a loaded machine
        assert "stopped answering" in event.reason, event
    finally:
        client.close()

