"""The failover soak through real ``ifrt run`` agents at a small size (bench/failover_soak.py ``--link agent``): 3 hosts
of 2 workers (``--recover replace``) on a 3-member etcd, a few leader kills and SIGSTOPs while the workers call the
key-value store through their agents, run start-ups, see one of them killed and replaced in place, and see the last
host's agent killed and started again; every key's history is linearizable, every job event reaches every worker once,
in order, a replacement registers once and no worker outlives its agent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.etcd_cluster import requires_etcd

SOAK = Path(__file__).resolve().parent.parent / "bench" / "failover_soak.py"
pytestmark = [requires_etcd, pytest.mark.serial]  # heartbeat timeouts of 3 s, leader leases of 2 s: an idle machine


def test_a_few_failovers_through_agents_keep_histories_linearizable_events_once_and_no_worker_past_its_agent(tmp_path):
    soak = subprocess.Popen([sys.executable, str(SOAK), "--link", "agent", "--failovers", "3", "--gap", "3",
                             "--heartbeat-timeout", "3", "--max-seconds", "120", "--keep", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = soak.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        soak.terminate()  # by its pid: it stops its agents, workers, replicas and etcd before it exits
        out, err = soak.communicate(timeout=120)
        raise AssertionError(f"the soak did not end within 300 s:\n{err[-5000:]}") from None
    assert out, err[-3000:]
    report = json.loads(out.splitlines()[-1])["modes"]["agent"]
    assert report["failovers"] == 3, report
    kv, events = report["key_values"], report["events"]
    assert kv["ok"] > 100 and kv["linearizable_keys"] == kv["keys"] == 3, kv
    assert report["startups"] >= 1 and report["worker_kills"] >= 1 and report["agent_kills"] >= 1, report
    assert report["log_exceptions"] == {}, report["log_exceptions"]  # no traceback in an agent's or a replica's log
    # Only the soak's kills fail a process: a host session that broke in a failover (before, an agent whose session
    # came back with a key watch in place lost its session thread, and its workers were failed and replaced over and
    # over) fails none.
    assert events["others_declared_failed_or_left"] == [] and events["observers"] == 4, events
    assert events["same_at_every_observer"] and events["alternate"], events
    assert (events["lost"], events["duplicated"], events["reordered_at"]) == (0, 0, []), events
    assert events["failed_events_match_kills"] and events["restarted_events_match_restarts"], events
    assert events["killed_incarnations_out_of_order"] == [], events
    assert events["replacements_registered_more_than_once"] == 0, events
    assert report["replacements_started_more_than_once"] == 0, report
    assert report["workers_outliving_their_agent_past_1s"] == 0, report
    assert report["startups_failed_while_store_held_every_answer"] == 0, report
    assert (report["failures_not_told"], report["restarts_not_told"]) == (0, 0), report
    assert report["sound"] and soak.returncode == 0, err[-3000:]
