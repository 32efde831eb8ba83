"""Prometheus metrics scraped over HTTP, parsed with Prometheus's own text parser, while real clusters run."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import select
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import CoordinatorConfig
from coordinator.core.cluster import ClusterConfig
from coordinator.http_server import MAX_CONNECTIONS, REQUEST_TIMEOUT_S
from coordinator.server import serve
from ifrt._generated import coordinator_pb2 as pb
from tests.helpers import METRICS_LINE, metrics_port, poll_until, run_coordinator, taken_port
from tests.replicas import leader_and_standby
from tests.resources import open_fds

COORDINATOR = "ifrt.topology.v1.Coordinator"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample the coordinator's /metrics serves, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def rpcs(samples: Samples, method: str, code: str = "OK") -> float:
    return get(samples, "ifrt_rpcs_total", service=COORDINATOR, method=method, code=code) or 0.0


def wait_metrics(port: int, done: Callable[[Samples], bool], timeout: float = 30) -> Samples:
    """Scrapes again until ``done(samples)``; fails naming the last scrape after ``timeout`` seconds."""
    return poll_until(lambda: scrape(port), done, timeout, "the metrics", interval=0.1)


def test_metrics_follow_a_cluster_that_registers_fails_and_restarts(start_coordinator, workers):
    coordinator = start_coordinator("--metrics-port", "0", "--metrics-bind", "127.0.0.1", "--heartbeat-timeout", "1",
                                    num_processes=3)
    port = metrics_port(coordinator)
    empty = scrape(port)
    assert {name: get(empty, name) for name in ("ifrt_leader", "ifrt_processes_expected", "ifrt_processes_registered",
                                                "ifrt_processes_failed", "ifrt_generation", "ifrt_sessions_open")} == {
        "ifrt_leader": 1.0, "ifrt_processes_expected": 3.0, "ifrt_processes_registered": 0.0,
        "ifrt_processes_failed": 0.0, "ifrt_generation": 0.0, "ifrt_sessions_open": 0.0}
    assert get(empty, "ifrt_cluster_state", state="waiting") == 1.0
    assert get(empty, "ifrt_time_to_publish_seconds") is None  # nothing published yet
    assert rpcs(empty, "Register") == 0.0

    started = [workers(coordinator.address, pid, 3) for pid in range(3)]  # a restart keeps its transfer port
    for w in started:
        w.expect("topology")
    running = wait_metrics(port, lambda m: get(m, "ifrt_sessions_open") == 3.0)
    assert (get(running, "ifrt_processes_registered"), get(running, "ifrt_generation"),
            get(running, "ifrt_processes_failed"), get(running, "ifrt_leader")) == (3.0, 1.0, 0.0, 1.0)
    assert get(running, "ifrt_cluster_state", state="published") == 1.0
    assert rpcs(running, "Register") >= 3.0
    assert get(running, "ifrt_rpc_duration_seconds_count", service=COORDINATOR, method="Register",
               code="OK") == rpcs(running, "Register")
    assert get(running, "ifrt_journal_append_seconds_count") >= 1.0
    assert get(running, "ifrt_time_to_publish_seconds") > 0.0
    assert 0.0 <= get(running, "ifrt_heartbeat_age_max_seconds") < 1.0  # older than the timeout would be failed
    registers_before = rpcs(running, "Register")

    started[1].kill9()
    failed = wait_metrics(port, lambda m: get(m, "ifrt_processes_failed") == 1.0)
    assert get(failed, "ifrt_cluster_state", state="degraded") == 1.0
    assert (get(failed, "ifrt_processes_registered"), get(failed, "ifrt_generation")) == (3.0, 1.0)

    assert workers(coordinator.address, 1, 3).expect("topology")["generation"] == 1
    restarted = wait_metrics(port, lambda m: get(m, "ifrt_processes_failed") == 0.0
                             and get(m, "ifrt_sessions_open") == 3.0)
    assert get(restarted, "ifrt_cluster_state", state="published") == 1.0
    assert (get(restarted, "ifrt_processes_registered"), get(restarted, "ifrt_generation")) == (3.0, 1.0)
    assert rpcs(restarted, "Register") > registers_before
    sessions_ended = sum(v for (name, labels), v in restarted.items()
                         if name == "ifrt_rpcs_total" and ("method", "Session") in labels)
    assert sessions_ended >= 1.0  # the killed process's stream
    assert get(restarted, "ifrt_leader") == 1.0


def test_two_coordinators_in_one_process_keep_their_own_metrics(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ifrt.coordinator")

    async def run() -> tuple[Samples, Samples]:
        stop = asyncio.Event()
        ready = [tmp_path / f"ready-{i}" for i in range(2)]
        configs = [CoordinatorConfig(cluster=ClusterConfig(num_processes=1 + i, cluster_id=f"c{i}"),
                                     bind="127.0.0.1:0", ready_file=str(ready[i]), metrics_port=0,
                                     metrics_bind="127.0.0.1") for i in range(2)]
        servers = [asyncio.create_task(serve(c, stop)) for c in configs]
        try:
            deadline = time.monotonic() + 20
            while not all(r.exists() for r in ready):
                assert time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.02)
            ports = [int(p) for p in METRICS_LINE.findall(caplog.text)]
            assert len(ports) == 2
            for address, calls in zip((r.read_text().strip() for r in ready), (3, 1), strict=True):
                async with grpc.aio.insecure_channel(address) as channel:
                    status = channel.unary_unary(f"/{COORDINATOR}/Status")
                    for _ in range(calls):
                        pb.StatusResponse.FromString(await status(b"", timeout=10))
            # Scraped from another thread, as Prometheus's HTTP server does: the gauges are read on this loop.
            return tuple(await asyncio.gather(*(asyncio.to_thread(scrape, p) for p in ports)))  # type: ignore
        finally:
            stop.set()
            await asyncio.gather(*servers)

    first, second = asyncio.run(run())
    assert (rpcs(first, "Status"), rpcs(second, "Status")) == (3.0, 1.0)
    assert (get(first, "ifrt_processes_expected"), get(second, "ifrt_processes_expected")) == (1.0, 2.0)


def test_only_the_leading_replica_reports_leader_1(etcd):
    with leader_and_standby(etcd, "--metrics-port", "0", "--metrics-bind", "127.0.0.1", num_processes=2,
                            cluster_id="job-m") as (first, second):
        leader, standby = scrape(metrics_port(first)), scrape(metrics_port(second))
        assert (get(leader, "ifrt_leader"), get(standby, "ifrt_leader")) == (1.0, 0.0)
        assert get(leader, "ifrt_processes_registered") == 0.0
        assert get(standby, "ifrt_processes_registered") is None  # a standby knows nothing of the processes


def test_a_metrics_port_out_of_range_is_a_usage_error():
    result = run_coordinator("--num-processes", "1", "--metrics-port", "70000")
    assert result.returncode == 2
    assert "--metrics-port 70000 is out of range: expected 0 to 65535" in result.stderr


def test_a_metrics_port_in_use_stops_the_daemon_with_a_clear_error():
    with taken_port() as port:
        result = run_coordinator("--num-processes", "1", "--bind", "127.0.0.1:0", "--metrics-port", str(port),
                                 "--metrics-bind", "127.0.0.1")
    assert result.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr


def test_refused_calls_are_counted_by_their_status_code(start_coordinator, tmp_path):
    token = tmp_path / "token"
    token.write_text("metrics-token\n")
    coordinator = start_coordinator("--token-file", str(token), "--metrics-port", "0", "--metrics-bind", "127.0.0.1",
                                    num_processes=2)
    with grpc.insecure_channel(coordinator.address) as channel:
        status = channel.unary_unary(f"/{COORDINATOR}/Status")
        with pytest.raises(grpc.RpcError) as no_token:
            status(b"", timeout=10)
        with pytest.raises(grpc.RpcError) as malformed:
            status(b"\xff\xff", timeout=10, metadata=(("ifrt-token", "metrics-token"),))
        answer = pb.StatusResponse.FromString(status(b"", timeout=10, metadata=(("ifrt-token", "metrics-token"),)))
    assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert answer.state == pb.CLUSTER_PHASE_WAITING
    samples = scrape(metrics_port(coordinator))
    assert [rpcs(samples, "Status", code) for code in ("UNAUTHENTICATED", "INVALID_ARGUMENT", "OK")] == [1.0, 1.0, 1.0]


def threads_of(pid: int) -> int:
    """Threads of ``pid`` (from /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (its read ends, or is reset)."""
    ready, _, _ = select.select([sock], [], [], within)
    if not ready:
        return False
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def test_a_flood_of_idle_connections_costs_bounded_threads_and_descriptors_and_the_page_still_answers(
        start_coordinator):
    """Three times the cap of idle connections, none sending a byte: the coordinator holds at most the cap more
    threads and descriptors, an operator's request is answered at once, and every idle one is hung up by its
    request deadline."""
    coordinator = start_coordinator("--metrics-port", "0", "--metrics-bind", "127.0.0.1", num_processes=1)
    port = metrics_port(coordinator)
    scrape(port)
    base_threads, base_fds = threads_of(coordinator.pid), open_fds(coordinator.pid)
    flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        time.sleep(1.0)  # every one accepted that will be
        threads, fds = threads_of(coordinator.pid) - base_threads, open_fds(coordinator.pid) - base_fds
        assert threads <= MAX_CONNECTIONS + 4, f"{threads} more threads for {len(flood)} idle connections"
        assert fds <= MAX_CONNECTIONS + 4, f"{fds} more descriptors for {len(flood)} idle connections"
        began = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=10) as answer:
            assert json.loads(answer.read())["state"] == "waiting"
        assert time.monotonic() - began < 2.0
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 3.0
        still_open = [s for s in flood if not hung_up(s, max(0.0, deadline - time.monotonic()))]
        assert not still_open, f"{len(still_open)} of {len(flood)} idle connections still open past the deadline"
    finally:
        for s in flood:
            s.close()
    poll_until(lambda: (threads_of(coordinator.pid) - base_threads, open_fds(coordinator.pid) - base_fds),
               lambda grown: grown[0] <= 2 and grown[1] <= 2, timeout=10, what="the threads and descriptors back")


def test_a_request_sent_a_byte_at_a_time_is_hung_up_at_its_deadline(start_coordinator):
    coordinator = start_coordinator("--metrics-port", "0", "--metrics-bind", "127.0.0.1", num_processes=1)
    request = b"GET /status.json HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", metrics_port(coordinator)), timeout=10) as slow:
        began = time.monotonic()
        for byte in request:  # one byte every 0.25 s: each read is quick, the whole request is not
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                break
            if hung_up(slow, 0.25):
                break
        else:
            raise AssertionError(f"still open after {time.monotonic() - began:.1f}s of a slow request")
        took = time.monotonic() - began
    assert REQUEST_TIMEOUT_S - 0.5 <= took <= REQUEST_TIMEOUT_S + 2.0, took


def http_get(url: str, **headers: str) -> tuple[int, bytes]:
    """(status, body) of a GET, errors included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_with_metrics_token_the_port_answers_only_requests_carrying_the_token(start_coordinator, tmp_path):
    token = tmp_path / "token"
    token.write_text("page-token-5e1f\n")
    coordinator = start_coordinator("--token-file", str(token), "--metrics-port", "0", "--metrics-bind", "127.0.0.1",
                                    "--metrics-token", num_processes=1)
    base = f"http://127.0.0.1:{metrics_port(coordinator)}"
    for path in ("/metrics", "/", "/status.json", "/status/view"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + b64encode(b"u:wrong")}):
            status, body = http_get(base + path, **headers)
            assert status == 401 and b"cluster's token" in body and coordinator.address.encode() not in body, (
                path, headers, status, body)
    status, body = http_get(base + "/metrics", Authorization="Bearer page-token-5e1f")
    assert status == 200 and b"ifrt_processes_expected 1.0" in body
    status, body = http_get(base + "/status.json", Authorization="Basic " + b64encode(b"operator:page-token-5e1f"))
    assert status == 200 and json.loads(body)["state"] == "waiting"


def test_metrics_token_without_a_token_file_is_a_usage_error():
    result = run_coordinator("--num-processes", "1", "--metrics-port", "0", "--metrics-token")
    assert result.returncode == 2
    assert "--metrics-token needs --token-file" in result.stderr


def b64encode(raw: bytes) -> str:
    return base64.b64encode(raw).decode()
