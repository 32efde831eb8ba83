"""`ifrt status` against real coordinators and real processes: waiting, published, degraded, standby."""

from __future__ import annotations

import json
import subprocess

from coordinator.core.cluster import ClusterConfig
from coordinator.core.state import ClusterState
from tests.helpers import (
    FAILED_REASON,
    HOST,
    IFRT,
    admit,
    discover_process,
    ifrt_status,
    poll_until,
    reg,
    status_json,
    wait_status,
)
from tests.replicas import leader_and_standby
from tests.workers import Worker


def test_report_of_the_state_machine_names_the_missing_the_failed_and_heartbeat_ages():
    s = ClusterState(ClusterConfig(num_processes=3, cluster_id="job", heartbeat_timeout_s=1.0))
    admit(s, reg("p0", 0, host="h0"), 0.0)
    admit(s, reg("p2", 2, host="h2"), 0.5)
    waiting = s.current.report(2.0)
    assert (waiting.state, waiting.generation, waiting.registered, waiting.expected) == ("waiting", 0, 2, 3)
    assert waiting.missing_process_ids == (1,)
    assert waiting.waited_s == 2.0
    assert [(p.process_id, p.hostname, p.phase, p.heartbeat_age_s) for p in waiting.processes] == [
        (0, "h0", "joining", 2.0), (2, "h2", "joining", 1.5)]

    admit(s, reg("p1", 1, host="h1"), 3.0)
    for uid in ("p0", "p1", "p2"):
        s.current.attach(uid, 3.0)
    s.current.detach("p0", 3.8)  # p0's connection dropped; it is back within the grace
    s.current.attach("p0", 3.9)
    s.current.detach("p1", 3.9)
    s.tick(4.3)  # p1 did not come back within the reconnect grace
    degraded = s.current.report(4.5)
    assert (degraded.state, degraded.generation, degraded.registered) == ("degraded", 1, 3)
    assert degraded.missing_process_ids == ()
    assert [(p.process_id, p.hostname, p.reason) for p in degraded.failed] == [
        (1, "h1", "lost its connection and did not come back within 0.125s")]
    assert degraded.max_heartbeat_age_s == 0.0  # sessions open (their keepalive vouches); the failed p1 not counted


def test_json_of_a_fresh_coordinator_has_the_documented_keys(start_coordinator):
    coordinator = start_coordinator("--cluster-id", "job-1", num_processes=2)
    view = status_json(coordinator.address)
    assert {k: view[k] for k in ("cluster_id", "state", "registered", "expected", "missing", "missing_count",
                                 "failed", "generation", "fingerprint", "processes", "leader")} == {
        "cluster_id": "job-1", "state": "waiting", "registered": 0, "expected": 2, "missing": [], "missing_count": 2,
        "failed": [], "generation": 0, "fingerprint": None, "processes": [], "leader": coordinator.address}
    assert view["replicas"] == [{"address": coordinator.address, "role": "leader"}]


def test_waiting_with_explicit_ids_names_the_missing_ids(start_coordinator, children):
    coordinator = start_coordinator(num_processes=3)
    children += [discover_process(coordinator.address, "--process-id", pid, devices=2) for pid in ("0", "2")]
    coordinator.wait_for_log("registered process 0")
    coordinator.wait_for_log("registered process 2")
    view = status_json(coordinator.address)
    assert (view["state"], view["registered"], view["expected"], view["missing"]) == ("waiting", 2, 3, [1])
    assert [(p["process_id"], p["host"], p["host_address"], p["devices"], p["state"]) for p in view["processes"]] == [
        (0, HOST, "127.0.0.1", 2, "joining"), (2, HOST, "127.0.0.1", 2, "joining")]

    text = ifrt_status("--coordinator", coordinator.address)
    assert text.returncode == 0, text.stderr
    assert "cluster default: waiting" in text.stdout
    assert "processes:  2/3 registered" in text.stdout
    assert "missing:    process ids [1]" in text.stdout


def test_waiting_with_assigned_ids_counts_the_missing(start_coordinator, children):
    coordinator = start_coordinator(num_processes=3)
    children += [discover_process(coordinator.address, env={"IFRT_LOCAL_RANK": rank}) for rank in ("0", "1")]
    poll_until(lambda: coordinator.log.count("registered a process"), lambda n: n >= 2, what="2 registrations")
    view = status_json(coordinator.address)
    assert (view["state"], view["registered"], view["missing"], view["missing_count"]) == ("waiting", 2, [], 1)
    assert [(p["process_id"], p["local_rank"]) for p in view["processes"]] == [(None, 0), (None, 1)]
    text = ifrt_status("--coordinator", coordinator.address).stdout
    assert "missing:    1 process(es) (ids are assigned once all registered)" in text


def test_published_shows_the_fingerprint_every_process_got(start_coordinator, children):
    coordinator = start_coordinator(num_processes=2)
    children += [Worker(coordinator.address, pid, 2) for pid in (0, 1)]
    fingerprints = {w.expect("topology")["topology"] for w in children}
    assert len(fingerprints) == 1
    view = wait_status(coordinator.address, lambda v: v["sessions_open"] == 2)
    assert (view["state"], view["generation"], view["registered"], view["failed"]) == ("published", 1, 2, [])
    assert view["fingerprint"] == fingerprints.pop()
    assert [(p["process_id"], p["host"], p["state"], p["attached"]) for p in view["processes"]] == [
        (0, HOST, "alive", True), (1, HOST, "alive", True)]
    assert all(0 <= p["heartbeat_age_s"] < view["heartbeat_timeout_s"] for p in view["processes"])
    assert view["time_to_publish_s"] > 0
    assert [p["pid"] for p in view["processes"]] == [w.process.pid for w in children]  # each on its host


def test_degraded_lists_the_killed_process_and_why(start_coordinator, children):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=3)
    children += [Worker(coordinator.address, pid, 3) for pid in (0, 1, 2)]
    for w in children:
        w.expect("topology")
    children[1].kill9()
    view = wait_status(coordinator.address, lambda v: v["state"] == "degraded")
    assert [{k: f[k] for k in ("process_id", "host", "host_address")} for f in view["failed"]] == [
        {"process_id": 1, "host": HOST, "host_address": "127.0.0.1"}]
    assert FAILED_REASON.fullmatch(view["failed"][0]["reason"]), view["failed"]
    assert [p["state"] for p in view["processes"]] == ["alive", "failed", "alive"]
    assert view["generation"] == 1 and view["registered"] == 3

    text = ifrt_status("--coordinator", coordinator.address).stdout
    assert "cluster default: degraded" in text
    assert f"failed:     process 1 on {HOST} (127.0.0.1): {view['failed'][0]['reason']}" in text


def test_a_standby_says_standby_and_names_the_leader(etcd):
    with leader_and_standby(etcd, num_processes=2, cluster_id="job-s") as (first, second):
        standby = status_json(second.address)
        assert (standby["state"], standby["leader"], standby["replica"]) == ("standby", first.address,
                                                                             second.address)
        assert standby["registered"] is None and standby["generation"] is None
        assert f"the coordinator at {first.address} leads" in standby["reason"]
        text = ifrt_status("--coordinator", second.address).stdout
        assert "cluster job-s: standby" in text and f"leader:     {first.address}" in text

        both = status_json(f"{second.address},{first.address}")
        assert (both["state"], both["leader"], both["replica"]) == ("waiting", first.address, first.address)
        assert both["replicas"] == [{"address": second.address, "role": "standby"},
                                    {"address": first.address, "role": "leader"}]


def test_watch_prints_a_report_each_interval_until_the_count(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    result = ifrt_status("--coordinator", coordinator.address, "--json", "--watch", "0.1", "--count", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert [json.loads(line)["state"] for line in lines] == ["waiting"] * 3


def test_no_coordinator_is_an_error_naming_the_address(free_port):
    address = f"127.0.0.1:{free_port}"
    result = ifrt_status("--coordinator", address, "--timeout", "2")
    assert result.returncode == 1
    assert result.stderr.startswith(f"ifrt status: CoordinatorUnavailable: no coordinator answered: coordinator "
                                    f"{address}:")


def test_a_coordinator_with_a_token_answers_only_callers_that_have_it(start_coordinator, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-for-status\n")
    coordinator = start_coordinator("--token-file", str(token), num_processes=2)
    refused = ifrt_status("--coordinator", coordinator.address, "--json")
    assert refused.returncode == 1
    assert "Unauthenticated" in refused.stderr and "carries no token" in refused.stderr
    assert "s3cret" not in refused.stderr
    allowed = ifrt_status("--coordinator", coordinator.address, "--json", env={"IFRT_TOKEN_FILE": str(token)})
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["state"] == "waiting"


def test_help_explains_every_flag():
    result = subprocess.run([IFRT, "status", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--coordinator", "--json", "--watch", "--count", "--timeout", "--token-file"):
        assert flag in result.stdout
    assert "standby" in result.stdout and "Ctrl-C" in result.stdout


def test_a_tls_coordinator_answers_over_tls_and_a_plaintext_caller_is_told_why(start_coordinator, tmp_path):
    from tests.tls import make_certs

    certs = make_certs(tmp_path)
    coordinator = start_coordinator("--tls-cert", str(certs / "server.pem"), "--tls-key",
                                    str(certs / "server-key.pem"), num_processes=2)
    plaintext = ifrt_status("--coordinator", coordinator.address)
    assert plaintext.returncode == 1
    assert plaintext.stderr.startswith(f"ifrt status: TransportMismatch: the coordinator at {coordinator.address} "
                                       "requires TLS")
    over_tls = ifrt_status("--coordinator", coordinator.address, "--json", env={"IFRT_TLS_CA": str(certs / "ca.pem")})
    assert over_tls.returncode == 0, over_tls.stderr
    assert json.loads(over_tls.stdout)["state"] == "waiting"
