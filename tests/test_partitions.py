"""Partitions, not only kills (bench/partition_nemeses.py, each nemesis once at a short size): a 3-member etcd, two
replicas and the job's processes in their own network namespaces, links cut with iptables DROP rules; what the job's
processes observed must hold: no job ended that should have survived, every key's history linearizable, no read
answered by a deposed leader with an older value, no frame accepted from an old incarnation, no retry applied twice.

Real etcd, real replicas, real processes on real sockets; each test asserts on what a client recorded."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bench.partition_nemeses import NEW, OLD, applied_twice, deposed_reads, old_frames, run_nemesis, short
from tests.etcd_cluster import requires_etcd
from tests.netns import skip_without_iptables, skip_without_netns


def trial(name: str, tmp_path) -> dict[str, Any]:
    """One short trial of nemesis ``name``; skips (fails under CI=true) without namespaces or iptables."""
    skip_without_netns()
    skip_without_iptables()
    report = run_nemesis(name, tmp_path / name, short())
    assert report["calls_ok"] > 50, report  # the job did work: the counts below are about something
    return report


def safe(report: dict[str, Any]) -> None:
    """The counts every nemesis measures are 0; the report is the message."""
    brief = {k: v for k, v in report.items() if k != "sent"}
    assert report["jobs_ended"] == 0, brief
    assert report["non_linearizable_keys"] == 0, brief
    assert report["undecided_keys"] == 0, brief
    assert report["deposed_leader_reads"] == 0, brief


# --- the measures themselves, on hand-built records (so each can fail) ------------------------------------------


def call(i: str, kind: str, args: list, at: float, ret: float, result: Any, via: str) -> tuple[dict, dict]:
    return ({"id": i, "kind": kind, "key": "k", "args": args, "call": at},
            {"id": i, "outcome": "ok", "result": result, "ret": ret, "via": via})


def test_a_read_from_the_old_leader_after_the_new_one_acknowledged_a_write_is_counted():
    ops = [call("a.0.0", "set", ["1", True], 0.0, 0.1, "ok", "c1"),
           call("b.0.0", "set", ["2", True], 1.0, 1.1, "ok", "c2"),  # c2 took over and acknowledged 2
           call("a.0.1", "get", [], 1.2, 1.3, "1", "c1"),  # c1 still answers, with the older value
           call("a.0.2", "get", [], 1.4, 1.5, "2", "c2")]
    assert deposed_reads(ops) == (1, 1)


def test_a_read_of_a_value_still_being_written_is_not_counted():
    ops = [call("a.0.0", "set", ["1", True], 0.0, 0.1, "ok", "c1"),
           call("b.0.0", "set", ["2", True], 1.0, 1.1, "ok", "c2"),
           ({"id": "b.0.1", "kind": "set", "key": "k", "args": ["3", True], "call": 1.15}, None),  # under way
           call("a.0.1", "get", [], 1.2, 1.3, "3", "c1")]
    assert deposed_reads(ops)[0] == 0


def test_only_the_old_incarnations_frames_sent_after_the_fence_count():
    frames = [[OLD, 0, 1.0, 1.01], [OLD, 1, 2.5, 2.51], [NEW, 0, 2.6, 2.61], [OLD, 2, 3.0, 3.5]]
    assert old_frames(frames, 2.0) == [[OLD, 1, 2.5, 2.51], [OLD, 2, 3.0, 3.5]]
    assert old_frames(frames, math.inf) == []


# --- the nemeses ----------------------------------------------------------------------------------------------


@requires_etcd
def test_a_leader_cut_from_the_job_but_not_from_etcd_steps_aside_and_the_job_survives(tmp_path):
    safe(trial("gray_leader", tmp_path))


@requires_etcd
def test_a_leader_cut_from_etcd_answers_nothing_once_the_standby_leads(tmp_path):
    report = trial("leader_etcd", tmp_path)
    safe(report)
    assert report["leader_after"] == 1, report  # the standby took over: the cut leader's lease ran out


@requires_etcd
def test_a_host_cut_from_the_coordinator_is_replaced_and_its_old_frames_are_refused(tmp_path):
    report = trial("host_cut", tmp_path)
    brief = {k: v for k, v in report.items() if k != "sent"}
    assert report["old_frames_before_the_fence"] > 0, brief  # the receiver did take process 1's frames before
    assert report["new_frames"] > 0, brief  # and takes the replacement's
    assert report["old_incarnation_frames"] == 0, brief
    safe(report)


@requires_etcd
def test_a_link_that_flaps_well_inside_the_heartbeat_timeout_costs_the_job_nothing(tmp_path):
    """Outages of 1/6 to 1/3 of the timeout (the bench also tries 1/3 to 2/3: docs/benchmarks.md). An etcd member
    without quorum is tried in tests/test_etcd_quorum.py."""
    report = trial("flapping", tmp_path)
    assert len(report["outages_s"]) >= 3, report
    safe(report)


@requires_etcd
def test_a_retry_whose_answer_was_pushed_out_is_not_applied_twice(tmp_path):
    report = trial("lost_reply", tmp_path)
    assert report["retry_probe_conclusive"], report["retry_probe"]  # the lost increment was applied once, unanswered
    assert report["retries_applied_twice"] == 0, report["retry_probe"]
    safe(report)


@pytest.mark.parametrize(("retry", "final", "twice"), [
    ({"answer": 1}, {"value": "1"}, 0),  # remembered: answered as the first time
    ({"error": "InvalidArgument: ... is not applied again"}, {"value": "1"}, 0),  # forgotten, refused
    ({"answer": 2}, {"value": "2"}, 1),  # forgotten, applied again
    ({"error": "CoordinatorUnavailable"}, {"value": "2"}, 1),  # applied again, its answer lost
])
def test_the_retry_probe_counts_a_second_application(retry, final, twice):
    assert applied_twice(retry, final) == twice
