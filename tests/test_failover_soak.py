"""The failover soak at a small size (bench/failover_soak.py): a few leader kills and SIGSTOPs on a 3-member etcd
while the job's processes call the key-value store, run start-ups and see one of them killed and restarted; every
key's history is linearizable and every job event reaches every process once, in order."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.etcd_cluster import requires_etcd

SOAK = Path(__file__).resolve().parent.parent / "bench" / "failover_soak.py"
pytestmark = [requires_etcd, pytest.mark.serial]  # heartbeat timeouts of 3 s, leader leases of 2 s: an idle machine


def test_a_few_failovers_keep_every_history_linearizable_and_every_event_delivered_once_in_order(tmp_path):
    soak = subprocess.Popen([sys.executable, str(SOAK), "--link", "direct", "--failovers", "3", "--gap", "3",
                             "--heartbeat-timeout", "3", "--max-seconds", "120", "--keep", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = soak.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        soak.terminate()  # by its pid: it stops its processes, replicas and etcd before it exits
        out, err = soak.communicate(timeout=120)
        raise AssertionError(f"the soak did not end within 240 s:\n{err[-5000:]}") from None
    assert out, err[-3000:]
    report = json.loads(out.splitlines()[-1])["modes"]["direct"]
    assert report["failovers"] == 3, report
    kv, events = report["key_values"], report["events"]
    assert kv["ok"] > 100 and kv["keys"] == 3, kv
    # A reply lost in a failover: the retry carries the call's request id and is answered, not applied again (before
    # kv_set and kv_delete carried one, a retried delete answered 0 after removing the key, a set landed twice).
    assert kv["linearizable_keys"] == kv["keys"], kv
    assert report["log_exceptions"] == {}, report["log_exceptions"]  # no traceback in an agent's or a replica's log
    assert report["startups"] >= 1 and report["worker_kills"] >= 1, report
    assert events["same_at_every_observer"] and events["alternate"], events
    assert (events["lost"], events["duplicated"], events["reordered_at"]) == (0, 0, []), events
    assert events["failed_events_match_kills"] and events["restarted_events_match_restarts"], events
    assert events["killed_incarnations_out_of_order"] == [], events
    assert events["replacements_registered_more_than_once"] == 0, events
    assert report["sound"] and soak.returncode == 0, err[-3000:]
