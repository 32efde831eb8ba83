"""Coordinator replicas of one cluster on a real etcd: one leads and serves, the others stand by."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

import ifrt
from coordinator.local import LocalCoordinator
from tests.helpers import close_checking_replays, poll_until
from tests.workers import Worker

LEADER_TTL = "2"
"""Seconds a dead leader's lease lives on: a standby takes over that long after a kill."""
NUM = 3
"""The processes of a Replicas cluster by default."""


def serving(*coordinators: LocalCoordinator, timeout: float = 30) -> LocalCoordinator:
    """The one of ``coordinators`` that leads, once it serves."""
    def leader() -> LocalCoordinator | None:
        return next((c for c in coordinators if c.process.poll() is None and "serving:" in c.log), None)

    try:
        return poll_until(leader, timeout=timeout, what="a replica to serve")  # type: ignore[return-value]
    except AssertionError:
        raise AssertionError("no replica serves:\n" + "\n---\n".join(c.log for c in coordinators)) from None


class Replicas:
    """``count`` replicas of cluster ``cluster_id`` (``num_processes``, ``flags`` added) on ``etcd``: ``leader``
    serves, the others stand by; all are closed on ``close``."""

    def __init__(self, etcd, *flags: str, num_processes: int = 3, cluster_id: str = "job", heartbeat: str = "3",
                 count: int = 2) -> None:
        args = ("--store", etcd.url, "--leader-ttl", LEADER_TTL, "--heartbeat-timeout", heartbeat,
                "--cluster-id", cluster_id, "--check-replay", *flags)
        self.all = [LocalCoordinator(*args, num_processes=num_processes) for _ in range(count)]
        self.addresses = ",".join(c.address for c in self.all)
        try:
            self.leader = serving(*self.all)
        except BaseException:
            self.close()
            raise

    def kill_leader(self) -> LocalCoordinator:
        """Kills the leader by pid with SIGKILL; returns it once another replica serves (the new ``leader``)."""
        dead = self.leader
        dead.stop(signal.SIGKILL)
        self.leader = serving(*(c for c in self.all if c is not dead))
        return dead

    def close(self, check: bool = False) -> None:
        """Closes every replica; ``check``: fails if the leader's journal, replayed as it stops, gives another state
        than its live one."""
        close_checking_replays(self.all, check)

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, kind: type | None, *exc: object) -> None:
        self.close(check=kind is None)


def kill_the_leader_midway(replicas: Replicas, process_id: int, num_processes: int,
                           progressed: Callable[[ifrt.Client], bool], what: str) -> ifrt.Client:
    """Process ``process_id`` as a Client here, discovered; once ``progressed(client)`` holds (polled, not a guess
    of time) the leader is killed and another replica serves. The caller closes the client."""
    client = ifrt.Client(replicas.addresses, process_id=process_id, num_processes=num_processes, timeout=90)
    client.discover()
    poll_until(lambda: progressed(client), timeout=120, what=what)
    replicas.kill_leader()
    return client


@contextlib.contextmanager
def leader_and_standby(etcd, *flags: str, num_processes: int,
                       cluster_id: str) -> Iterator[tuple[LocalCoordinator, LocalCoordinator]]:
    """A replica of ``cluster_id`` on ``etcd`` that serves, and a second one once it stands by behind the first;
    both closed afterwards."""
    args = ("--store", etcd.url, "--leader-ttl", LEADER_TTL, "--cluster-id", cluster_id, *flags)
    with LocalCoordinator(*args, num_processes=num_processes) as first:
        first.wait_for_log("serving:")
        with LocalCoordinator(*args, num_processes=num_processes) as second:
            second.wait_for_log(f"standing by: the coordinator at {first.address} leads")
            yield first, second


def start_worker(replicas: Replicas, pid: int, ports: dict[int, int], *args: str) -> Worker:
    """Process ``pid`` of a NUM-process job on ``replicas``, as a worker on its fixed transfer port."""
    return Worker(replicas.addresses, pid, NUM, *args, transfer_port=ports[pid])


def client0(replicas: Replicas, ports: dict[int, int]) -> ifrt.Client:
    """Process 0 of a NUM-process job on ``replicas``, as a Client in this test on its fixed transfer port."""
    return ifrt.Client(replicas.addresses, process_id=0, num_processes=NUM, timeout=90,
                       transfer_bind=f"127.0.0.1:{ports[0]}")
