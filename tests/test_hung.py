"""A process hung with its connection still answered (a deadlock holding Python's GIL: gRPC's own threads keep
answering the keepalive pings, its Heartbeats stop) is declared failed after ``--hung-timeouts`` heartbeat timeouts,
not only shown slow. The pure state machine, and a real process that holds the GIL in a C call."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ifrt
from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import Evict
from ifrt import events
from ifrt.errors import InvalidArgument
from ifrt.events import ProcessFailed
from tests.helpers import failures, next_event, published, watcher

ROOT = Path(__file__).parents[1]
HUNG_REASON = ("stopped answering: no heartbeat for {:.1f}s while its connection stayed up (more than 3s, "
               "--hung-timeouts): hung, e.g. deadlocked holding Python's GIL")


def test_a_connected_session_whose_heartbeats_stopped_is_failed_after_the_hung_timeouts():
    s = published()  # heartbeat timeout 1 s: slow after 1/3 s, failed as hung after 3 s
    for uid in ("p0", "p1", "p2"):
        s.current.heard(uid, 0.1)
    for now in (1.0, 2.0, 3.0):
        s.current.heard("p0", now)
        s.current.heard("p2", now)
        assert failures(s.tick(now)) == []  # process 1 is slow (quiet 2.9 s at 3.0), not failed yet
    assert [p.process_id for p in s.current.report(3.0).slow] == [1]
    s.current.heard("p0", 3.2)
    effects = s.tick(3.2)
    assert failures(effects) == [ProcessFailed(1, HUNG_REASON.format(3.1))]
    assert Evict("p1", f"declared failed: {HUNG_REASON.format(3.1)}") in effects  # its session is closed
    assert failures(s.tick(3.3)) == []  # once; process 2 was heard at 3.0


def test_a_session_that_never_heartbeats_or_hung_timeouts_0_is_never_failed_as_hung():
    never = published()  # clients that predate heartbeats: keepalive vouches for them, as before
    assert failures(never.tick(100.0)) == []
    off = published(hung_timeouts=0)
    off.current.heard("p1", 0.1)
    assert failures(off.tick(100.0)) == []
    assert [p.process_id for p in off.current.report(100.0).slow] == [1]  # shown slow, as before


def test_hung_timeouts_spaced_heartbeats_stretch_it_and_a_negative_one_is_refused():
    assert ClusterConfig(num_processes=4, heartbeat_timeout_s=10).hung_after_s == 30
    spaced = ClusterConfig(num_processes=16384, heartbeat_timeout_s=10, max_heartbeat_rate=512)  # one per 32 s
    assert spaced.hung_after_s == 3 * 32
    with pytest.raises(InvalidArgument, match=r"--hung-timeouts -1 is negative: expected a number of heartbeat "
                                              r"timeouts >= 0 \(0: never\)"):
        ClusterConfig(num_processes=1, hung_timeouts=-1)


HOLD_THE_GIL = """
import ctypes, time, ifrt
client = ifrt.Client(transfer=False)
client.discover()
assert client.wait_attached(30)
time.sleep(1.0)  # runs a while (its session sends heartbeats), then deadlocks
print("holding the GIL", flush=True)
ctypes.PyDLL(None).sleep(120)  # libc's sleep through PyDLL: the GIL stays held, no other thread of ours runs
"""


def test_a_process_deadlocked_holding_the_gil_is_declared_failed_with_its_connection_up(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    env.update(IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID="1", IFRT_NUM_PROCESSES="2",
               IFRT_CPU_DEVICE_COUNT="1", PYTHONPATH=str(ROOT))
    hung = subprocess.Popen([sys.executable, "-c", HOLD_THE_GIL], env=env, stdout=subprocess.PIPE, text=True)
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=2, transfer=False, timeout=60)
    try:
        received = watcher(client)
        client.discover()
        assert hung.stdout.readline().strip() == "holding the GIL"  # type: ignore[union-attr]
        began = time.monotonic()
        _, failed = next_event(received, events.ProcessFailed, timeout=30, process_id=1)
        quiet = re.search(r"no heartbeat for ([\d.]+)s while its connection stayed up", failed.reason)
        assert quiet and float(quiet.group(1)) >= 3.0, failed.reason  # hung 3 timeouts, its connection never dropped
        assert time.monotonic() - began < 3 + 5  # and a loaded machine's slack
        assert hung.poll() is None  # it still holds the GIL: its agent (ifrt run) kills it
    finally:
        client.close()
        hung.kill()
        hung.wait()
