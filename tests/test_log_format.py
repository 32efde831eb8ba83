"""`ifrt-coordinator --log-format json`: one JSON object per line, with the cluster id and, for key events, the
event name, process id and host."""

from __future__ import annotations

import json
import logging
import re
import socket
import sys

from coordinator.local import LocalCoordinator
from coordinator.logs import JsonFormatter

HOST = socket.gethostname()
TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
FAILED_REASON = re.compile(r"lost its connection and did not come back within (0\.125|1)s")


GRPC_CORE = re.compile(r"[EWID]\d{4} ")
"""gRPC's C core writes its own (rare) errors to stderr in its own format, past Python's logging."""


def json_lines(coordinator: LocalCoordinator) -> list[dict]:
    """Every line the daemon logged, each parsed as one JSON object (any other line but gRPC core's fails)."""
    lines = coordinator.log.splitlines()
    assert all(line.startswith("{") or GRPC_CORE.match(line) for line in lines), coordinator.log
    return [json.loads(line) for line in lines if line.startswith("{")]


def events(lines: list[dict], name: str) -> list[dict]:
    return [line for line in lines if line.get("event") == name]


def test_formatter_writes_one_object_with_the_extra_fields_and_the_exception():
    record = logging.LogRecord("ifrt.coordinator", logging.WARNING, __file__, 1, "process %d failed: %s",
                               (2, "gone"), None)
    record.created = 1700000000.25
    record.event, record.process_id, record.host = "process_failed", 2, "node-c"
    line = JsonFormatter("job-9").format(record)
    assert "\n" not in line
    assert json.loads(line) == {"time": "2023-11-14T22:13:20.250Z", "level": "WARNING", "logger": "ifrt.coordinator",
                                "message": "process 2 failed: gone", "cluster_id": "job-9",
                                "event": "process_failed", "process_id": 2, "host": "node-c"}
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        failing = logging.LogRecord("ifrt.coordinator", logging.ERROR, __file__, 1, "internal error", (),
                                    sys.exc_info())
    parsed = json.loads(JsonFormatter("job-9").format(failing))
    assert parsed["message"] == "internal error"
    assert "RuntimeError: boom\nsecond line" in parsed["exception"]


def test_daemon_logs_registration_publication_and_failure_as_json(start_coordinator, workers):
    coordinator = start_coordinator("--log-format", "json", "--cluster-id", "job-7", "--heartbeat-timeout", "1",
                                    num_processes=2)
    started = [workers(coordinator.address, pid, 2) for pid in (0, 1)]
    fingerprints = {w.expect("topology")["topology"] for w in started}
    started[1].kill9()
    coordinator.wait_for_log('"event": "process_failed"')
    coordinator.stop()

    lines = json_lines(coordinator)
    assert len(lines) >= 5
    for line in lines:
        assert TIME.fullmatch(line["time"]), line
        assert line["level"] in ("DEBUG", "INFO", "WARNING", "ERROR") and line["message"], line
        assert line["cluster_id"] == "job-7", line
    registered = events(lines, "registered")
    assert sorted((e["process_id"], e["host"], e["host_address"]) for e in registered) == [
        (0, HOST, "127.0.0.1"), (1, HOST, "127.0.0.1")]
    published = events(lines, "published")
    assert [(e["generation"], e["fingerprint"]) for e in published] == [(1, fingerprints.pop())]
    failed = events(lines, "process_failed")
    assert [(e["process_id"], e["host"], e["level"]) for e in failed] == [(1, HOST, "WARNING")]
    assert FAILED_REASON.fullmatch(failed[0]["reason"]), failed


def test_a_leader_that_loses_its_store_logs_stepping_down(etcd):
    coordinator = LocalCoordinator("--log-format", "json", "--store", etcd.url, "--leader-ttl", "2", "--cluster-id",
                                   "job-8", num_processes=2)
    try:
        coordinator.wait_for_log("serving:")
        etcd.stop_all()
        coordinator.wait_for_log('"event": "stepping_down"')
        stepped = events(json_lines(coordinator), "stepping_down")
        assert [(e["level"], e["cluster_id"], e["reason"]) for e in stepped] == [("ERROR", "job-8", "leadership lost")]
    finally:
        coordinator.close()
