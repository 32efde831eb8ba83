"""Nothing waits in silence: an unreachable coordinator is named with its cause while the client retries, a refused
certificate is an immediate typed error, progress lines are spaced, and a process that gives up leaves."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import pytest

import ifrt
from tests.helpers import BIN, discover_process, finish
from tests.tls import make_certs

REPORT = re.compile(r"cannot reach 127\.0\.0\.1:(\d+): (.+) \(retrying for (\d+) s more: the discovery timeout "
                    r"\(8 s, timeout= or IFRT_DISCOVERY_TIMEOUT\)\)")


@pytest.fixture(scope="module")
def two_cas(tmp_path_factory) -> tuple[Path, Path]:
    """Two independent certificate sets: the coordinator's, and another CA a client may trust by mistake."""
    return make_certs(tmp_path_factory.mktemp("ours")), make_certs(tmp_path_factory.mktemp("theirs"))


def test_an_unreachable_coordinator_is_named_with_its_cause_while_the_client_retries(free_port):
    # Nothing listens on free_port; no --verbose: these lines are shown anyway.
    child = discover_process(f"127.0.0.1:{free_port}", "--process-id", "0", "--num-processes", "2", timeout=8)
    code, _, err = finish(child, 40)
    assert code == 1
    reports = REPORT.findall(err)
    assert reports, err
    port, cause, remaining = reports[0]
    assert port == str(free_port) and cause == "connection refused"
    assert int(remaining) >= 4, f"the first report came late: {err}"  # within the first seconds of eight
    assert len(reports) >= 2, f"not repeated while retrying: {err}"
    final = err.strip().splitlines()[-1]
    assert "DiscoveryTimeout" in final and "connection refused" in final and "Deadline Exceeded" not in final, final


def test_a_coordinator_certificate_from_another_ca_is_refused_at_once_naming_what_to_set(start_coordinator,
                                                                                         two_cas):
    ours, theirs = two_cas
    coordinator = start_coordinator("--tls-cert", str(ours / "server.pem"), "--tls-key", str(ours / "server-key.pem"),
                                    num_processes=1)
    child = discover_process(coordinator.address, "--process-id", "0", "--num-processes", "1", timeout=120,
                             env={"IFRT_TLS_CA": str(theirs / "ca.pem")})
    code, _, err = finish(child, 60)  # far below the 120 s discovery timeout: an outage would wait it out
    assert code == 1
    assert "CertificateRejected" in err and "did not sign" in err and "IFRT_TLS_CA" in err, err
    assert str(theirs / "ca.pem") in err


def test_a_coordinator_certificate_without_the_dialled_name_is_refused_at_once(start_coordinator, two_cas):
    ours, _ = two_cas
    # Its certificate names 127.0.0.1 and localhost; the client dials 127.0.0.2 (also loopback).
    coordinator = start_coordinator("--tls-cert", str(ours / "server.pem"), "--tls-key", str(ours / "server-key.pem"),
                                    num_processes=1, bind="127.0.0.2:0")
    child = discover_process(coordinator.address, "--process-id", "0", "--num-processes", "1", timeout=120,
                             env={"IFRT_TLS_CA": str(ours / "ca.pem")})
    code, _, err = finish(child, 60)
    assert code == 1
    assert "CertificateRejected" in err and "does not name '127.0.0.2'" in err and "subjectAltName" in err, err


def test_progress_lines_are_spaced_also_just_before_the_timeout(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    child = discover_process(coordinator.address, "--process-id", "0", "--num-processes", "2", "-v", timeout=6)
    code, _, err = finish(child, 40)
    assert code == 1 and "DiscoveryTimeout" in err
    lines = [line for line in err.splitlines() if "waiting for the topology" in line]
    assert 1 <= len(lines) <= 2, lines  # one per 5 s poll; the short calls near the deadline add none


def test_a_process_that_gives_up_leaves_so_every_live_process_gets_one_generation(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    quitter = ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=1.5, session=False)
    with quitter, pytest.raises(ifrt.DiscoveryTimeout):
        quitter.discover()
    # A new process 1 and a new process 0 arrive: they form the job without the one that gave up.
    topologies: dict[int, ifrt.Topology] = {}

    def join(pid: int) -> None:
        with ifrt.Client(coordinator.address, process_id=pid, num_processes=2, timeout=30, session=False) as c:
            topologies[pid] = c.discover()

    threads = [threading.Thread(target=join, args=(pid,)) for pid in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(topologies) == [0, 1]
    assert {t.generation for t in topologies.values()} == {1}
    assert topologies[0].fingerprint == topologies[1].fingerprint


def test_a_token_file_readable_by_others_is_warned_about(start_coordinator, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-value\n")
    token.chmod(0o644)
    coordinator = start_coordinator("--token-file", str(token), num_processes=1)
    assert f"readable by other users (mode 644): chmod 600 {token}" in coordinator.log
    token.chmod(0o600)
    quiet = start_coordinator("--token-file", str(token), num_processes=1)
    assert "readable by other users" not in quiet.log


def test_output_piped_into_a_reader_that_stops_early_ends_without_a_traceback(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    reader = subprocess.Popen([str(BIN / "ifrt"), "status", "--coordinator", coordinator.address, "--watch", "0.01",
                               "--count", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout is not None
    reader.stdout.read(10)
    reader.stdout.close()  # as `| head -c 10` does
    _, err = reader.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
