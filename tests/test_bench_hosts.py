"""The benchmarks by agent at a tiny size, so they cannot rot: simulated `ifrt run` agents register their hosts in
one call each and get the bytes processes registering alone get; their host sessions carry a reported exit to the
other host (docs/benchmarks.md, "Hosts by agent")."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(script: str, *args: str) -> list[dict]:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_discovery_by_agent_gets_the_bytes_processes_registering_alone_get():
    by_agent, by_process = run("discovery.py", "--by", "agent,process", "--processes", "16", "--repeat", "1",
                               "--peer", "none")
    assert (by_agent["system"], by_process["system"]) == ("ifrt/agent", "ifrt/process")
    assert by_agent["holding_topology"] == by_process["holding_topology"] == 16
    assert (by_agent["server_connections"], by_process["server_connections"]) == (2, 16)  # one per host, per process
    assert by_agent["distinct_answers"] == by_agent["distinct_payloads"] == 1
    assert by_process["same_topology"] is True and by_agent["fingerprint"] == by_process["fingerprint"]


def test_liveness_by_agent_carries_a_reported_exit_to_the_other_host():
    (record,) = run("liveness.py", "--by", "agent", "--processes", "16", "--window", "0.5", "--repeats", "0")
    assert (record["measurement"], record["attached_hosts"], record["exit_reached"]) == ("host_sessions", 2, 1)
    assert record["unexpected_events"] == {} and record["exit_to_others_max_ms"] < 1000
