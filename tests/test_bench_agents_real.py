"""bench/agents_real.py at 2 hosts x 2 workers, so it cannot rot: real ``ifrt run`` agents, each worker link, every
worker holding one topology and hearing of the killed worker (docs/benchmarks.md, "Real agents end to end")."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "agents_real.py"


def test_both_worker_links_deliver_the_topology_and_the_failure_to_every_worker():
    done = subprocess.run([sys.executable, str(BENCH), "--hosts", "2", "--workers", "2", "--repeats", "1",
                           "--settle", "1", "--window", "1"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert (result["hosts"], result["workers_per_host"], result["processes"]) == (2, 2, 4)
    assert [r["mode"] for r in result["runs"]] == ["agent", "direct"]
    for run in result["runs"]:
        assert run["via"] == [run["mode"]] and run["fingerprints"] == 1
        assert run["failure_expected"] == 3 and run["failure_heard_by"] == 3, run
        assert run["kill_to_all_heard_s"] is not None and run["start_to_all_topology_s"] > 0
        assert run["connections"]["unattributed"] == 0
    by_mode = {r["mode"]: r["connections"]["per_host"] for r in result["runs"]}
    assert all(h["agent"] >= 1 and h["workers"] == 0 for h in by_mode["agent"])  # the agent carries its host
    assert all(h["workers"] == 2 for h in by_mode["direct"])  # each worker its own
    calls = {r["mode"]: r["coordinator_calls"] for r in result["runs"]}
    assert "Register" not in calls["agent"] and calls["agent"].get("RegisterHost", 0) >= 2, calls
    assert "RegisterHost" not in calls["direct"] and calls["direct"].get("Register", 0) >= 4, calls
    for summary in result["modes"].values():
        assert summary["failure_heard_by_all"] and summary["one_fingerprint"]
        assert summary["kill_to_all_heard_s"]["median"] >= 0
