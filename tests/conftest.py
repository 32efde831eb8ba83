"""Shared fixtures: a real ifrt-coordinator daemon on loopback, `ifrt discover` subprocesses, real etcd servers.

What the suite needs from the machine (etcd, network namespaces, jax) is checked by tests/requirements.py's
``require``: a failure under CI=true, a skip that says why elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.local import LocalCoordinator

BIN = Path(sys.executable).parent


@pytest.fixture
def start_coordinator() -> Iterator[Callable[..., LocalCoordinator]]:
    """Starts `ifrt-coordinator` through its console script; every one started is stopped afterwards."""
    started: list[LocalCoordinator] = []

    def start(*args: str, num_processes: int, **kwargs) -> LocalCoordinator:
        coordinator = LocalCoordinator(*args, num_processes=num_processes, **kwargs)
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.close()


def discover_process(address: str, *args: str, devices: int = 1, env: dict[str, str] | None = None,
                     timeout: float = 60) -> subprocess.Popen:
    """`ifrt discover --json` in a child process (its own interpreter, like a job's process)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    full_env.update(IFRT_CPU_DEVICE_COUNT=str(devices), **(env or {}))
    return subprocess.Popen([str(BIN / "ifrt"), "discover", "--coordinator", address, "--timeout", str(timeout),
                             "--json", *args], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def doomed_peer(address: str) -> subprocess.Popen:
    """Process 1 of a 2-process job that discovers, then exits (code 3) without a goodbye: the coordinator declares
    it failed once its heartbeat timeout passes."""
    dies = ("import os, ifrt\n"
            f"ifrt.Client({address!r}, process_id=1, num_processes=2, transfer=False).discover()\n"
            "os._exit(3)\n")
    return subprocess.Popen([sys.executable, "-c", dies], stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a child, killing it by pid if it outlives ``timeout``."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"child {process.pid} did not finish within {timeout}s; stderr:\n{err}") from None
    return process.returncode, out, err


@pytest.fixture
def free_port() -> int:
    """A loopback port that was free a moment ago (for a coordinator started after its clients)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd_installed() -> str:
    """Path of the etcd server; fails (under CI=true) or skips the test when etcd is not installed."""
    from tests.etcd_cluster import skip_without_etcd

    return skip_without_etcd()


@pytest.fixture
def etcd(tmp_path):
    """A real single-member etcd on free loopback ports, stopped afterwards."""
    from tests.etcd_cluster import EtcdCluster, skip_without_etcd

    skip_without_etcd()
    with EtcdCluster.start(1, tmp_path=tmp_path) as cluster:
        yield cluster


@pytest.fixture
def etcd3(tmp_path):
    """A real three-member etcd cluster on free loopback ports, stopped afterwards."""
    from tests.etcd_cluster import EtcdCluster, skip_without_etcd

    skip_without_etcd()
    with EtcdCluster.start(3, tmp_path=tmp_path) as cluster:
        yield cluster
