"""The pre-flight (``Client.preflight``, ``ifrt doctor``, ``IFRT_PREFLIGHT=1``): every process probes its peers'
transfer endpoints and every process reports the same unreachable pairs. Real coordinators, real sockets; the
multi-host cases on network namespaces with a host's transfer port dropped by iptables in its own namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import ifrt
from coordinator.local import LocalCoordinator
from ifrt import preflight
from ifrt.errors import PreflightFailed
from ifrt.preflight import ALL_PAIRS_MAX, SAMPLE, pairs_probed, peers
from ifrt.settings import PREFLIGHT_ENV, PREFLIGHT_TIMEOUT_ENV
from tests.helpers import free_port, together
from tests.netns import Hosts, skip_without_iptables, skip_without_netns

IFRT = Path(sys.executable).with_name("ifrt")
PORT = 9137  # every namespace host's transfer endpoint listens here
DETECTED_WITHIN = 15.0  # seconds from start to every process's report: a 2 s probe timeout and process start-up


def test_small_jobs_probe_every_pair():
    for n in (2, 5, ALL_PAIRS_MAX):
        assert all(peers(p, n, "fp") == [q for q in range(n) if q != p] for p in range(n))
        assert pairs_probed(n) == n * (n - 1)


def test_large_jobs_probe_a_ring_and_a_bounded_sample_the_same_everywhere():
    n = ALL_PAIRS_MAX * 4
    plan = {p: peers(p, n, "f00d") for p in range(n)}
    assert all(len(targets) == 2 + SAMPLE and p not in targets for p, targets in plan.items())
    assert all({(p - 1) % n, (p + 1) % n} <= set(targets) for p, targets in plan.items())  # the ring
    # What a report says was probed is the number of distinct pairs the processes' own plans probe (a peer named
    # twice in one plan would be counted twice by a sum of their lengths, though probed once).
    assert len({(p, q) for p, targets in plan.items() for q in targets}) == pairs_probed(n)
    probed_by = {q: sum(q in t for t in plan.values()) for q in range(n)}
    assert min(probed_by.values()) >= 2  # every endpoint is probed, by its two ring neighbours at least
    # Another process computes the same plan, whatever its hash seed: a process knows what its peers probed.
    code = f"from ifrt.preflight import peers; print([peers(p, {n}, 'f00d') for p in range({n})])"
    for seed in ("1", "2"):
        other = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                               capture_output=True, text=True, check=True, timeout=60)
        assert other.stdout.strip() == str(list(plan.values()))
    assert peers(5, n, "another fingerprint") != plan[5]  # the sample follows the topology


@pytest.fixture
def cluster():
    """Clients of one job, in this process (each with its own endpoint and connection), on a real coordinator."""
    made: list[ifrt.Client] = []
    coordinators: list[LocalCoordinator] = []

    def make(n: int) -> list[ifrt.Client]:
        coordinators.append(LocalCoordinator(num_processes=n))
        made.extend(ifrt.Client(coordinators[-1].address, process_id=i, num_processes=n, timeout=30)
                    for i in range(n))
        return made[-n:]

    yield make
    for client in made:
        client.close()
    for coordinator in coordinators:
        coordinator.close()


def test_a_healthy_cluster_passes_with_the_same_report_everywhere(cluster):
    clients = cluster(3)
    together(clients, lambda c: c.discover())
    reports = together(clients, lambda c: c.preflight(timeout=30))
    assert all(isinstance(r, preflight.PreflightReport) and r.ok for r in reports), reports
    assert {(r.pairs_probed, r.all_pairs, r.generation, r.fingerprint) for r in reports} == {
        (6, True, clients[0].topology.generation, clients[0].topology.fingerprint)}
    assert "every transfer endpoint is reachable" in reports[0].describe()
    # A second check uses fresh keys and a fresh barrier: it runs again rather than repeating the first result.
    assert all(r.ok for r in together(clients, lambda c: c.preflight(timeout=30)))


def _nothing_listening() -> SimpleNamespace:
    """What a process advertises as its endpoint, with nothing listening there: a free loopback port."""
    return SimpleNamespace(address=f"127.0.0.1:{free_port()}", auth_key=None, close=lambda: None,
                           expect=lambda topology: None)


def test_discover_under_IFRT_PREFLIGHT_fails_in_every_process_naming_the_pair(cluster, monkeypatch):
    monkeypatch.setenv(PREFLIGHT_ENV, "1")
    monkeypatch.setenv(PREFLIGHT_TIMEOUT_ENV, "30")
    healthy, gone = cluster(2)
    gone.endpoint = _nothing_listening()
    errors = together([healthy, gone], lambda c: c.discover())
    assert all(isinstance(e, PreflightFailed) for e in errors), errors
    for error in errors:
        [pair] = error.report.unreachable
        assert (pair.source.process_id, pair.target.process_id) == (0, 1)
        assert pair.target.address == gone.endpoint.address
        assert "connection refused" in pair.error
        assert f"process 0 ({healthy.settings.hostname}, 127.0.0.1) cannot reach process 1" in str(error)


def test_discover_without_IFRT_PREFLIGHT_probes_nothing(cluster, monkeypatch):
    monkeypatch.delenv(PREFLIGHT_ENV, raising=False)
    healthy, gone = cluster(2)
    gone.endpoint = _nothing_listening()
    assert all(isinstance(t, ifrt.Topology) for t in together([healthy, gone], lambda c: c.discover()))


# Several hosts: `ifrt doctor` on each, one host's transfer port dropped by its own firewall.

@pytest.fixture
def hosts():
    skip_without_netns()
    with Hosts(4) as h:
        yield h


def _doctors(hosts: Hosts, blocked: int | None) -> tuple[list[subprocess.CompletedProcess], float]:
    """A coordinator on h1 and `ifrt doctor` as processes 0..2 on h2..h4; returns their runs and the seconds taken."""
    if blocked is not None:
        hosts.block_tcp_port(blocked, PORT)
    env = {k: v for k, v in os.environ.items()  # no proxy: gRPC would send the namespaces' calls there
           if not k.startswith("IFRT_") and k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")}
    with LocalCoordinator(num_processes=3, bind=f"{hosts.address(1)}:8476", wrapper=hosts.command(1, [])) as c:
        start = time.monotonic()
        doctors = [subprocess.Popen(hosts.command(h, [str(IFRT), "doctor", "--json", "--coordinator", c.address,
                                                      "--process-id", str(h - 2), "--num-processes", "3",
                                                      "--transfer-bind", f"{hosts.address(h)}:{PORT}",
                                                      "--timeout", "30", "--check-timeout", "30"]),
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for h in (2, 3, 4)]
        runs = []
        for d in doctors:
            out, err = d.communicate(timeout=60)
            runs.append(subprocess.CompletedProcess(d.args, d.returncode, out, err))
        return runs, time.monotonic() - start


def test_a_blocked_transfer_port_is_named_in_every_process_within_seconds(hosts):
    skip_without_iptables()
    runs, took = _doctors(hosts, blocked=4)  # host 4 runs process 2
    for run in runs:
        assert run.returncode == 1, (run.stdout, run.stderr)
        report = json.loads(run.stdout)
        assert not report["ok"]
        named = [(u["source"]["process_id"], u["source"]["address"].rpartition(":")[0],
                  u["target"]["process_id"], u["target"]["address"]) for u in report["unreachable"]]
        assert named == [(0, hosts.address(2), 2, f"{hosts.address(4)}:{PORT}"),
                         (1, hosts.address(3), 2, f"{hosts.address(4)}:{PORT}")]  # and process 2 reaches both
        assert all("no answer within 2s" in u["error"] for u in report["unreachable"])
        assert all(u["target"]["hostname"] for u in report["unreachable"])
    assert took < DETECTED_WITHIN, f"the reports took {took:.1f}s"


def test_a_healthy_multihost_cluster_passes(hosts):
    runs, _ = _doctors(hosts, blocked=None)
    for run in runs:
        assert run.returncode == 0, (run.stdout, run.stderr)
        report = json.loads(run.stdout)
        assert report["ok"] and report["pairs_probed"] == 6 and report["unreachable"] == []
