"""Shared fixtures: a real ifrt-coordinator daemon on loopback, worker processes, ``ifrt run`` agents, real etcd
servers, certificates and a token file (the helpers they and the tests share are in tests/helpers.py); and two checks
every test gets: the state machines it drove replay to themselves, and it leaves no client session running.

What the suite needs from the machine (etcd, network namespaces, jax) is checked by tests/requirements.py's
``require``: a failure under CI=true, a skip that says why elsewhere.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ifrt
from coordinator.local import LocalCoordinator
from tests import helpers
from tests.replay_check import Recorder
from tests.run_agents import RunAgent, agents_started
from tests.tls import make_certs
from tests.workers import COORDINATION_WORKER, Worker

# Bytecode caching for this checkout's modules, in this process and every process the suite starts (xdist's workers,
# daemons, workers, agents): a machine whose environment sets PYTHONDONTWRITEBYTECODE would otherwise have each of
# those hundreds of processes compile ifrt and coordinator from source anew, ~0.13 s of CPU apiece. Installed
# packages already come with theirs; nothing here depends on bytecode being written or not.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture
def start_coordinator() -> Iterator[Callable[..., LocalCoordinator]]:
    """Starts `ifrt-coordinator` through its console script; every one started is stopped afterwards, and fails the
    test if its journal, replayed when it stops (``--check-replay``), gives another state than its live one."""
    started: list[LocalCoordinator] = []

    def start(*args: str, num_processes: int, **kwargs) -> LocalCoordinator:
        coordinator = LocalCoordinator("--check-replay", *args, num_processes=num_processes, **kwargs)
        started.append(coordinator)
        return coordinator

    yield start
    helpers.close_checking_replays(started)


@pytest.fixture
def free_port() -> int:
    """A loopback port that was free a moment ago (for a coordinator started after its clients)."""
    return helpers.free_port()


@pytest.fixture
def workers() -> Iterator[Callable[..., Worker]]:
    """Starts worker processes (tests/workers.py), each stopped afterwards; a process id keeps its transfer port
    across restarts, as a job's fixed port would (unless ``transfer_port`` is given, or the id is assigned)."""
    started: list[Worker] = []
    ports: dict[int, int] = {}

    def start(address: str, process_id: int | None, *args, **kwargs) -> Worker:
        if "transfer_port" not in kwargs and process_id is not None:
            kwargs["transfer_port"] = ports.setdefault(process_id, helpers.free_port())
        started.append(Worker(address, process_id, *args, **kwargs))
        return started[-1]

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def coordination_workers(workers) -> Callable[..., Worker]:
    """Starts tests/coordination_worker.py processes (one device, no transfer endpoint, ``env`` added to their IFRT_*
    settings), each stopped afterwards."""
    def start(address: str, process_id: int, num_processes: int, *args: str, **env: str) -> Worker:
        return workers(address, process_id, num_processes, *args, devices=1, transfer_port=None,
                       script=COORDINATION_WORKER, env=env)

    return start


@pytest.fixture
def children() -> Iterator[list]:
    """Child processes (Popen or Worker) to kill by pid at the end, whatever state they are in."""
    started: list = []
    yield started
    for child in started:
        process = child.process if isinstance(child, Worker) else child
        if process.poll() is None:
            process.kill()
            process.wait()


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


@pytest.fixture
def agents() -> Iterator[Callable[..., RunAgent]]:
    """Starts ``ifrt run`` agents (tests/run_agents.py's RunAgent), each stopped afterwards."""
    yield from agents_started()


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """A CA and a server certificate for 127.0.0.1 and localhost (tests/tls.py), made once per test process."""
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def token_file(tmp_path) -> Path:
    """The cluster token ``helpers.TOKEN`` in a file only its owner reads, as ``--token-file`` expects."""
    return helpers.secret_file(tmp_path / "token", helpers.TOKEN)


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A temporary directory with a short path, removed afterwards: for Unix sockets under it (the kernel takes 107
    bytes at most, and pytest's own directories grow past that under pytest-xdist)."""
    path = Path(tempfile.mkdtemp(prefix="ifrt-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def live_and_replayed_agree() -> Iterator[None]:
    """Every ClusterState the test drove, replayed from what it journaled, is the same state (tests/replay_check.py)."""
    recorder = Recorder()
    recorder.install()
    try:
        yield
    finally:
        recorder.uninstall()
    differences = recorder.differences()
    assert not differences, "a replay of the journal differs from the live state: " + "; ".join(differences)


@pytest.fixture
def default_client_closed() -> Iterator[None]:
    """For a test that calls ``ifrt.discover()``: the default client the process keeps until exit is closed when the
    test ends (each test stands for a process)."""
    yield
    ifrt._close_default_client()


class SessionLeft(UserWarning):
    """A test ended with an ifrt client session of its own still running: a Client it never closed."""


@pytest.fixture(autouse=True)
def no_client_session_left() -> Iterator[None]:
    """Warns (in pytest's summary, naming the test) when the test leaves a client's session thread running: it would
    go on re-attaching to a coordinator long gone, and write about it into later tests' output."""
    before = set(_sessions())
    yield
    deadline = time.monotonic() + 2.0
    while (left := set(_sessions()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        warnings.warn(f"{len(left)} ifrt client session(s) this test opened still run: close each Client it made",
                      SessionLeft, stacklevel=1)


def _sessions() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ifrt-session" and t.is_alive()]
