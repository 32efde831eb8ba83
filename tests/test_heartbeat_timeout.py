"""Fail fast learns the coordinator's --heartbeat-timeout from the session's first answer (Attached), which every
process gets anyway: no Status call, which would cost processes x replicas calls at every start."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import rpc_calls

ARMED = """
import json, sys
import ifrt
from ifrt import failfast
with ifrt.Client(sys.argv[1], process_id=0, num_processes=1, transfer=False, timeout=30) as client:
    topology = client.discover()
    watchdog = failfast.arm(client, topology, "exit", "test")
    assert client.wait_attached(30), "the session did not attach"
    print(json.dumps({"client": client.heartbeat_timeout_s, "failfast": watchdog.heartbeat_timeout}), flush=True)
"""


def test_fail_fast_reads_the_coordinators_heartbeat_timeout_without_a_status_call(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "2.5", "--metrics-port", "0", num_processes=1)
    done = subprocess.run([sys.executable, "-c", ARMED, coordinator.address], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"client": 2.5, "failfast": 2.5}  # not the default 10 s
    calls = rpc_calls(coordinator)
    assert calls.get("Register") and "Status" not in calls, calls
