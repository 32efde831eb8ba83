"""How an ``ifrt run`` agent links its workers to the coordinator (``--worker-link``): ``direct``, each worker on its
own connection, registration and session; or ``agent``, each worker through its agent's local server, the host on
one registration call and one session, and every other call of its workers on the agent's connection
(``ifrt.run.local_server``)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError
from ifrt.run.agent import exit_reason
from ifrt.run.host_register import HostRegistrar
from ifrt.run.host_session import HostSession
from ifrt.run.job import JobLink
from ifrt.run.local_server import LocalServer

log = logging.getLogger("ifrt.run")

AGENT, DIRECT = "agent", "direct"
WORKER_LINKS = (AGENT, DIRECT)
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
"""The heartbeat timeout assumed when the coordinator's cannot be read (the coordinator's default)."""
STATUS_TIMEOUT_S = 5.0


class AgentLink:
    """The agent's side of ``--worker-link agent``: the local server, the host's registrations and session.
    ``pid_of(local_rank)``: the pid of that rank's current worker (None: none runs), which lets the agent tell a busy
    worker from a hung one by its CPU time."""

    def __init__(self, link: JobLink, workers: int, expected: Callable[[], int],
                 ids_known: Callable[[dict[int, int]], None],
                 pid_of: Callable[[int], int | None] = lambda local_rank: None) -> None:
        self._pid_of = pid_of
        self.host = HostSession(link.connection, link.agent_uid, cpu=self._cpu, stopped=self._stopped)
        self.registrar = HostRegistrar(link.connection, link.agent_uid, workers, link.workers, expected,
                                       self.host.open, ids_known)
        self.server = LocalServer(self.registrar, self.host, workers, heartbeat_timeout(link), link.connection)
        self._attempt: int | None = None
        log.info("serving this host's workers on %s", self.server.path)

    def new_attempt(self, attempt: int) -> None:
        """The workers of ``attempt`` start: the host's session of an earlier attempt ends (its events are no
        longer numbered so), and opens again once they registered."""
        if self._attempt is not None and attempt != self._attempt:
            self.host.restart()
        self._attempt = attempt

    @property
    def socket(self) -> str:
        return self.server.path

    def worker_started(self, local_rank: int) -> int:
        """A worker starts for ``local_rank`` (or a spare takes it over): the serial its exit is reported with."""
        return self.registrar.started(local_rank)

    def worker_exited(self, local_rank: int, serial: int, returncode: int) -> None:
        """Local rank ``local_rank``'s worker ``serial`` exited (seen by waitpid): the coordinator hears it at once,
        before its peers' keepalives could tell. A worker that exits 0 left (or will be seen leaving) on its own."""
        if returncode == 0 or (found := self.registrar.exited(local_rank, serial)) is None:
            return
        self.host.exited(*found, exit_reason(returncode))

    def close(self) -> None:
        self.host.close()
        self.server.close()

    def _cpu(self, uid: str) -> float | None:
        """The CPU seconds used so far by the process of registration ``uid`` (None where it cannot be seen)."""
        registered = self.registrar.registered.get(uid)
        pid = None if registered is None else self._pid_of(registered.local_rank)
        return None if pid is None else cpu_seconds(pid)


    def _stopped(self, uid: str) -> bool:
        """Whether the process of registration ``uid`` is stopped (SIGSTOP, SIGTSTP)."""
        registered = self.registrar.registered.get(uid)
        pid = None if registered is None else self._pid_of(registered.local_rank)
        return pid is not None and process_stopped(pid)


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T or t in ``/proc/<pid>/stat``); False where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def cpu_seconds(pid: int) -> float | None:
    """Process ``pid``'s user and system CPU time in seconds (``/proc/<pid>/stat``), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def heartbeat_timeout(link: JobLink) -> float:
    """The coordinator's heartbeat timeout in seconds (its operator status), the default when it cannot be read."""
    try:
        status = link.connection.call("Status", lambda _: pb.StatusRequest(), time.monotonic() + STATUS_TIMEOUT_S)
    except IfrtError as e:
        log.info("cannot read the coordinator's heartbeat timeout (%s): assuming %gs", e, DEFAULT_HEARTBEAT_TIMEOUT_S)
        return DEFAULT_HEARTBEAT_TIMEOUT_S
    return status.heartbeat_timeout_seconds or DEFAULT_HEARTBEAT_TIMEOUT_S
