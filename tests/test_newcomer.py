"""A newcomer's first waits: a process waiting for a coordinator that is not up costs next to no CPU, its discovery
timeout comes from IFRT_DISCOVERY_TIMEOUT, and a port that answers HTTP instead of gRPC is named at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ifrt.errors import EXIT_COORDINATOR_LOST
from ifrt.run.agent import EXIT_USAGE
from tests.helpers import finish, metrics_port, poll_until
from tests.run_agents import RUN_WORKER, WAIT_S, RunAgent, loopback_env, started_lines
from tests.tls import make_certs

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
DISCOVER = ("import sys, ifrt\n"
            "ifrt.discover(coordinator=sys.argv[1], process_id=0, num_processes=2"
            "{timeout})\n")


def discover_child(address: str, timeout: float | None = None, **env: str) -> subprocess.Popen:
    """A process that calls ``ifrt.discover()`` against ``address`` (``timeout``: passed explicitly, else the
    variable's or the default)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    code = DISCOVER.format(timeout="" if timeout is None else f", timeout={timeout}")
    return subprocess.Popen([sys.executable, "-c", code, address], env={**clean, "IFRT_CPU_DEVICE_COUNT": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds ``pid`` has used (its threads included), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def test_waiting_for_a_coordinator_that_is_not_up_costs_a_few_percent_of_a_core(free_port):
    child = discover_child(f"127.0.0.1:{free_port}", timeout=60)  # nothing listens there
    try:
        time.sleep(2.0)  # past the interpreter's start-up and the first fast retries
        before, began = cpu_seconds(child.pid), time.monotonic()
        time.sleep(5.0)
        share = (cpu_seconds(child.pid) - before) / (time.monotonic() - began)
    finally:
        child.kill()
        _, _, err = finish(child, 30)
    assert "connection refused" in err, err
    assert share < 0.10, f"the waiting process used {share:.0%} of a core"  # retried every 0.1 s: about 20-33%


def test_the_discovery_timeout_comes_from_ifrt_discovery_timeout(free_port):
    address = f"127.0.0.1:{free_port}"
    began = time.monotonic()
    code, _, err = finish(discover_child(address, IFRT_DISCOVERY_TIMEOUT="3"), 60)
    took = time.monotonic() - began
    assert code == 1 and "DiscoveryTimeout" in err and address in err, err
    assert 2.5 < took < 20, f"{took:.1f}s with IFRT_DISCOVERY_TIMEOUT=3 (default: 300 s)"


def test_a_malformed_discovery_timeout_is_named_with_what_was_expected(free_port):
    code, _, err = finish(discover_child(f"127.0.0.1:{free_port}", IFRT_DISCOVERY_TIMEOUT="soon"), 60)
    assert code == 1 and "IFRT_DISCOVERY_TIMEOUT='soon'" in err and "expected a positive number of seconds" in err, err


def test_the_coordinators_metrics_port_is_named_at_once_as_http_not_grpc(start_coordinator):
    coordinator = start_coordinator("--metrics-port", "0", num_processes=2)
    address = f"127.0.0.1:{metrics_port(coordinator)}"
    began = time.monotonic()
    code, _, err = finish(discover_child(address, timeout=60), 60)
    took = time.monotonic() - began
    assert code == 1 and "TransportMismatch" in err, err
    assert f"{address} answers HTTP/1" in err and "expected the coordinator's gRPC address" in err, err
    assert took < 5, f"{took:.1f}s: an HTTP server on the port was retried as an outage"


def test_a_plain_web_server_is_named_at_once_also_under_tls(free_port, tmp_path):
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(free_port), "--bind", "127.0.0.1"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = f"127.0.0.1:{free_port}"
        deadline = time.monotonic() + 30
        while subprocess.run([sys.executable, "-c", f"import socket; socket.create_connection(('127.0.0.1', "
                              f"{free_port}), 1)"], capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "the HTTP server did not listen within 30 s"
            time.sleep(0.1)
        for env in ({}, {"IFRT_TLS_CA": str(make_certs(tmp_path) / "ca.pem")}):
            began = time.monotonic()
            code, _, err = finish(discover_child(address, timeout=60, **env), 60)
            assert code == 1 and "TransportMismatch" in err and f"{address} answers HTTP/1" in err, (env, err)
            assert time.monotonic() - began < 5, (env, err)
    finally:
        server.kill()
        server.wait(10)


def test_an_agent_waits_for_a_coordinator_not_up_yet_as_long_as_ifrt_discovery_timeout_says(free_port):
    address = f"127.0.0.1:{free_port}"  # nothing listens there; the failover window (10 s here) is not what counts
    began = time.monotonic()
    agent = RunAgent("--", sys.executable, str(RUN_WORKER), "finish",
                     env={**loopback_env(address), "IFRT_DISCOVERY_TIMEOUT": "3", "IFRT_FAILOVER_WINDOW": "1"})
    try:
        assert agent.wait() == EXIT_COORDINATOR_LOST, agent.output()
    finally:
        agent.stop()
    took = time.monotonic() - began
    err = "\n".join(agent.err)
    assert 2.5 < took < 20, f"{took:.1f}s; {agent.output()}"
    assert f"no coordinator replica ({address}) answered for" in err and "(IFRT_DISCOVERY_TIMEOUT)" in err, err


def test_an_agent_pointed_at_the_metrics_port_is_told_at_once(start_coordinator):
    coordinator = start_coordinator("--metrics-port", "0", num_processes=1)
    address = f"127.0.0.1:{metrics_port(coordinator)}"
    began = time.monotonic()
    agent = RunAgent("--", sys.executable, str(RUN_WORKER), "finish", env=loopback_env(address))
    try:
        assert agent.wait() == EXIT_USAGE, agent.output()
    finally:
        agent.stop()
    assert time.monotonic() - began < 10, agent.output()
    assert f"{address} answers HTTP/1" in "\n".join(agent.err), agent.output()


def test_two_agents_on_one_machine_without_host_ranks_are_told_how_in_one_line(start_coordinator):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    both = [RunAgent("--", sys.executable, str(RUN_WORKER), "finish", env=loopback_env(coordinator.address))
            for _ in range(2)]
    try:
        for agent in both:
            agent.wait()
    finally:
        for agent in both:
            agent.stop()
    for agent in both:
        own = [line for line in agent.err if line.startswith("ifrt run:")]
        assert any("another `ifrt run` agent" in line and "--host-rank R --num-hosts H" in line for line in own), \
            agent.output()
        assert not any("Traceback" in line for line in own), agent.output()


def test_a_stopped_worker_under_an_agent_is_reported_as_stopped_answering(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2)
    agent = RunAgent("--nproc-per-host", "2", "--max-restarts", "1", "--grace-seconds", "2", "--",
                     sys.executable, str(RUN_WORKER), "loop", env=loopback_env(coordinator.address))
    try:
        first = poll_until(lambda: started_lines(agent, 0), lambda found: len(found) == 2, timeout=WAIT_S,
                           what="both workers of attempt 0 started")
        os.kill(int(first[1].group(3)), signal.SIGSTOP)
        line = poll_until(lambda: [x for x in agent.err if "process 1" in x and "failed" in x], timeout=WAIT_S,
                          what="the agent's line on process 1's failure")[0]
    finally:
        agent.stop()
    assert "stopped answering" in line and "lost its connection" not in line, agent.output()
    said = [x for x in coordinator.log.splitlines() if "process 1" in x and "failed" in x]
    assert said and all("stopped answering" in x and "lost its connection" not in x for x in said), coordinator.log
