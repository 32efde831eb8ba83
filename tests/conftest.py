"""Shared fixtures: a real ifrt-coordinator daemon on loopback, worker processes, real etcd servers (the helpers
they and the tests share are in tests/helpers.py).

What the suite needs from the machine (etcd, network namespaces, jax) is checked by tests/requirements.py's
``require``: a failure under CI=true, a skip that says why elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from coordinator.local import LocalCoordinator
from tests import helpers
from tests.workers import COORDINATION_WORKER, Worker


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
