"""Real etcd servers for tests: one or three members on free 127.0.0.1 ports, in a temporary directory.

Usage::

    with EtcdCluster.start(3, tmp_path=tmp_path) as etcd:
        etcd.endpoints        # ["127.0.0.1:41233", "127.0.0.1:38001", "127.0.0.1:45321"]
        etcd.url              # "etcd://127.0.0.1:41233,127.0.0.1:38001,127.0.0.1:45321"
        etcd.kill(etcd.leader())
        etcd.restart(i)

Each member is an ``etcd`` child process (Debian's ``etcd-server`` 3.4 is what ``scripts/test.sh`` installs) with
its data directory and its log file (stdout and stderr, appended to across restarts) under one directory inside
``tmp_path``. Members are only ever signalled by their own pid, never by name. Election timing is shortened
(``--heartbeat-interval 50 --election-timeout 500``; etcd requires the election timeout to be at least five
heartbeats) so that a new leader is elected within about a second after the old one is killed.

Facts this module relies on: a member answers ``GET /health`` with ``{"health":"true"}`` once the cluster has a
leader (about half a second after start); a member without quorum does not answer at all, and may ignore SIGTERM
for more than ten seconds, so ``stop`` escalates to SIGKILL; the well-known ports 2379/2380 may belong to a
packaged etcd, so every port is picked by binding 127.0.0.1:0.

Tests that need etcd use the ``etcd``/``etcd3`` fixtures, ``requires_etcd`` (a mark: ``@requires_etcd`` or
``pytestmark = requires_etcd``) or ``skip_without_etcd()``; without etcd each of them fails under ``CI=true`` and
skips elsewhere, saying how to install it (tests/requirements.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import pytest

from tests.helpers import free_ports
from tests.requirements import require

HOST = "127.0.0.1"
HEARTBEAT_MS = 50
ELECTION_MS = 500  # etcd 3.4 refuses to start unless ELECTION_MS >= 5 * HEARTBEAT_MS
START_TIMEOUT = 15.0  # seconds until every member of a new cluster must be healthy
STOP_GRACE = 3.0  # seconds between SIGTERM and SIGKILL
LOG_TAIL = 40  # log lines quoted in errors

SKIP_REASON = ("no `etcd` on PATH or at /usr/bin/etcd; scripts/test.sh installs Debian's etcd-server as root, "
               "or run: apt-get install -y etcd-server")

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through an http_proxy
_live: weakref.WeakSet[EtcdCluster] = weakref.WeakSet()  # clusters to stop if the interpreter exits early


def etcd_binary() -> str | None:
    """Path of the etcd server binary (`etcd` on PATH, else /usr/bin/etcd), or None when it is not installed."""
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


def skip_without_etcd() -> str:
    """The etcd binary's path; when etcd is not installed, fails (under CI=true) or skips the calling test."""
    binary = etcd_binary()
    if binary is None:
        require("etcd", SKIP_REASON)
    return binary


requires_etcd = pytest.mark.usefixtures("etcd_installed")
"""Marks a test that starts etcd itself: the ``etcd_installed`` fixture (tests/conftest.py) calls skip_without_etcd."""


def _etcd_env() -> dict[str, str]:
    """The environment for etcd: ours without ETCD_* settings, which etcd 3.4 reads and rejects next to flags."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    if platform.machine() in ("aarch64", "arm64"):
        env["ETCD_UNSUPPORTED_ARCH"] = "arm64"  # etcd 3.4 refuses to start on arm64 without it
    return env


def _tail(path: Path, lines: int = LOG_TAIL) -> str:
    """The last ``lines`` lines of a log file ("" when it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class _Member:
    """One etcd member: its name, ports, files and (while started) its process."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        """Client address as host:port."""
        return f"{HOST}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """Peer URL as advertised in --initial-cluster."""
        return f"http://{HOST}:{self.peer_port}"

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self.process is not None and self.process.poll() is None


class EtcdCluster:
    """A real etcd cluster of 1 or 3 members on loopback; stop it with close() or use it as a context manager."""

    def __init__(self, members: list[_Member], token: str, directory: Path, binary: str) -> None:
        """Use EtcdCluster.start(); this only records the layout."""
        self._members = members
        self.token = token
        self.directory = directory
        self._binary = binary
        _live.add(self)

    # --- creation -------------------------------------------------------------------------------------------

    @classmethod
    def start(cls, members: int = 1, *, tmp_path: Path, timeout: float = START_TIMEOUT) -> EtcdCluster:
        """Starts a new cluster of ``members`` (1 or 3) members under ``tmp_path`` and waits until all are healthy."""
        if members not in (1, 3):
            raise ValueError(f"members must be 1 or 3, not {members}")
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError(SKIP_REASON)
        attempts = 3  # a picked port can be taken by someone else before etcd binds it: start over on new ports
        for attempt in range(1, attempts + 1):
            cluster = cls._create(members, Path(tmp_path), binary)
            try:
                t0 = time.monotonic()
                for i in range(members):
                    cluster._spawn(i, "new")
                    if members > 1:  # one after the other: see _wait_peer_serving
                        cluster._wait_peer_serving(i, timeout - (time.monotonic() - t0))
                cluster.wait_all_healthy(timeout - (time.monotonic() - t0))
                return cluster
            except BaseException as e:
                cluster.close()
                in_use = any("address already in use" in cluster.log(i) for i in range(members))
                if not isinstance(e, (RuntimeError, TimeoutError)) or not in_use or attempt == attempts:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _create(cls, members: int, tmp_path: Path, binary: str) -> EtcdCluster:
        """Lays out members (names, fresh ports, directories) without starting them."""
        tmp_path.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix="etcd-", dir=tmp_path))
        token = f"ifrt-test-{uuid.uuid4().hex[:12]}"
        ports = free_ports(2 * members)
        layout = [
            _Member(name=f"m{i}", client_port=ports[2 * i], peer_port=ports[2 * i + 1],
                    data_dir=directory / f"m{i}.etcd", log_path=directory / f"m{i}.log")
            for i in range(members)
        ]
        return cls(layout, token, directory, binary)

    def _wait_peer_serving(self, i: int, timeout: float) -> None:
        """Waits until new member ``i`` answers on its peer URL, before the next member is started.

        A new member of a multi-member cluster first asks every other member's peer URL whether it is already
        part of a running cluster, giving each one second. A member that was started a moment earlier has bound
        its peer port but does not answer on it yet, so starting all three at once costs two such seconds about
        half the time; a member that answers (or a port that refuses) costs nothing.
        """
        member = self._members[i]
        deadline = time.monotonic() + timeout
        while True:
            if not member.running:
                raise RuntimeError(self._describe(i, "exited"))
            with contextlib.suppress(OSError), _opener.open(f"{member.peer_url}/version", timeout=0.1):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(self._describe(i, f"not answering on its peer URL within {timeout:.1f}s"))
            time.sleep(0.02)

    def _command(self, member: _Member, state: str) -> list[str]:
        """The etcd command line of ``member`` with --initial-cluster-state ``state`` ("new" or "existing")."""
        client_url = f"http://{member.endpoint}"
        initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self._members)
        return [
            self._binary,
            "--name", member.name,
            "--data-dir", str(member.data_dir),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]

    def _spawn(self, i: int, state: str) -> None:
        """Starts member ``i``'s process (logging to its file, appended) without waiting for it."""
        member = self._members[i]
        if member.running:
            raise RuntimeError(f"etcd member {i} is already running (pid {member.process.pid})")
        command = self._command(member, state)
        with member.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(command)}\n".encode())
            log.flush()
            member.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT, env=_etcd_env())

    # --- addresses ------------------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of members (running or not)."""
        return len(self._members)

    @property
    def endpoints(self) -> list[str]:
        """Client addresses "127.0.0.1:PORT" of all members, in member order."""
        return [m.endpoint for m in self._members]

    @property
    def url(self) -> str:
        """The coordinator's --store form: "etcd://127.0.0.1:P1,127.0.0.1:P2,..."."""
        return "etcd://" + ",".join(self.endpoints)

    def endpoint(self, i: int) -> str:
        """Client address of member ``i``."""
        return self._members[i].endpoint

    def pid(self, i: int) -> int | None:
        """Process id of member ``i`` while it runs, else None."""
        member = self._members[i]
        return member.process.pid if member.running else None

    def exit_code(self, i: int) -> int | None:
        """Exit code of member ``i``'s last process once it has exited (-9 after SIGKILL), else None."""
        process = self._members[i].process
        return process.poll() if process is not None else None

    def running(self, i: int) -> bool:
        """Whether member ``i``'s process is alive."""
        return self._members[i].running

    def log(self, i: int) -> str:
        """Everything member ``i`` has logged so far, across restarts."""
        try:
            return self._members[i].log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # --- health ---------------------------------------------------------------------------------------------

    def healthy(self, i: int, timeout: float = 1.0) -> bool:
        """Whether member ``i`` answers GET /health with {"health":"true"} (false when it has no leader)."""
        return self._health(i, timeout)[0]

    def _health(self, i: int, timeout: float) -> tuple[bool, str]:
        """(healthy, what /health said or why it could not be asked) for member ``i``."""
        url = f"http://{self._members[i].endpoint}/health"
        try:
            with _opener.open(url, timeout=timeout) as response:
                body = response.read().decode(errors="replace")
        except urllib.error.HTTPError as e:  # 503 with {"health":"false"} while there is no leader
            return False, f"HTTP {e.code} {e.read().decode(errors='replace')}"
        except (OSError, ValueError) as e:
            return False, repr(e)
        try:
            return json.loads(body).get("health") == "true", body
        except ValueError:
            return False, body

    def wait_healthy(self, i: int, timeout: float = 10.0) -> float:
        """Waits until member ``i`` is healthy and returns the seconds waited; TimeoutError with its log tail."""
        member = self._members[i]
        t0 = time.monotonic()
        deadline = t0 + timeout
        last = "not asked"
        while True:
            if not member.running:
                raise RuntimeError(self._describe(i, "exited" if member.process else "is not started"))
            # A member that is not ready yet accepts the connection and answers nothing, so tries must be short
            # to notice readiness quickly; /health itself is a read through raft (up to 1 s on a slow disk), so
            # each try may take half the time waited so far, between 0.25 s and 2 s.
            now = time.monotonic()
            per_try = min(max(0.25, (now - t0) / 2), 2.0, max(0.05, deadline - now))
            ok, last = self._health(i, timeout=per_try)
            if ok:
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise TimeoutError(self._describe(i, f"not healthy within {timeout}s (last /health: {last})"))
            time.sleep(0.05)

    def wait_all_healthy(self, timeout: float = 10.0) -> float:
        """Waits until every member is healthy (one deadline for all) and returns the seconds waited."""
        t0 = time.monotonic()
        for i in range(self.size):
            self.wait_healthy(i, max(0.0, timeout - (time.monotonic() - t0)))
        return time.monotonic() - t0

    def wait_listening(self, i: int, timeout: float = 10.0) -> float:
        """Waits until member ``i``'s process is up (its client port accepts TCP) and returns the seconds waited."""
        member = self._members[i]
        t0 = time.monotonic()
        while True:
            if not member.running:
                raise RuntimeError(self._describe(i, "exited" if member.process else "is not started"))
            with contextlib.suppress(OSError), socket.create_connection((HOST, member.client_port), timeout=0.2):
                return time.monotonic() - t0
            if time.monotonic() - t0 >= timeout:
                raise TimeoutError(self._describe(i, f"not listening on {member.endpoint} within {timeout}s"))
            time.sleep(0.05)

    def leader(self, timeout: float = 1.0) -> int | None:
        """Index of the member that running members report as raft leader (HTTP /v3/maintenance/status), or None."""
        ids: dict[str, int] = {}
        leaders: set[str] = set()
        for i, member in enumerate(self._members):
            if not member.running:
                continue
            request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}",
                                             headers={"Content-Type": "application/json"})
            try:
                with _opener.open(request, timeout=timeout) as response:
                    status = json.load(response)
            except (OSError, ValueError):
                continue
            ids[str(status["header"]["member_id"])] = i
            if status.get("leader"):
                leaders.add(str(status["leader"]))
        found = [ids[leader] for leader in leaders if leader in ids]
        return found[0] if len(found) == 1 else None

    def _describe(self, i: int, what: str) -> str:
        """An error message about member ``i`` with its exit code, log path and log tail."""
        member = self._members[i]
        code = member.process.poll() if member.process else None
        status = f", exit code {code}" if code is not None else ""
        return (f"etcd member {i} ({member.name}, {member.endpoint}{status}) {what}; "
                f"log {member.log_path}, last lines:\n{_tail(member.log_path)}")

    # --- failures and recovery ------------------------------------------------------------------------------

    def kill(self, i: int) -> None:
        """SIGKILLs member ``i`` (by its pid) and reaps it; nothing happens when it is not running."""
        member = self._members[i]
        if member.running:
            member.process.kill()
        if member.process is not None:
            member.process.wait(timeout=10)

    def stop(self, i: int, grace: float = STOP_GRACE) -> None:
        """SIGTERMs member ``i`` and SIGKILLs it if it has not exited after ``grace`` seconds."""
        self._stop([i], grace)

    def stop_all(self, grace: float = STOP_GRACE) -> None:
        """SIGTERMs every running member (followers first, then the leader), SIGKILLing any still up after ``grace``."""
        self._stop(list(range(self.size)), grace)

    def _stop(self, indices: list[int], grace: float) -> None:
        """SIGTERM, wait up to ``grace`` seconds, SIGKILL the rest; only these members' own pids.

        Followers go first and the leader last, a few heartbeats later: a leader that gets SIGTERM hands
        leadership to a follower it believes connected, and waits (six seconds with our timeouts) when that
        follower is in fact gone.
        """
        indices = [i for i in indices if self._members[i].running]
        leader = self.leader(timeout=0.25) if len(indices) > 1 else None
        for batch in ([i for i in indices if i != leader], [i for i in indices if i == leader]):
            if batch and leader in batch and len(indices) > 1:
                # Deliberately three heartbeats: until the leader's heartbeats find the followers gone, which etcd
                # shows nowhere a test could wait on.
                time.sleep(3 * HEARTBEAT_MS / 1000)
            processes = [self._members[i].process for i in batch]
            for process in processes:
                process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for process in processes:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()  # a member without quorum can ignore SIGTERM for more than ten seconds
                    process.wait(timeout=10)

    def restart(self, i: int, timeout: float = 10.0) -> float:
        """Starts stopped member ``i`` again (same data and ports, --initial-cluster-state existing) and waits.

        With a quorum of members running it waits until member ``i`` is healthy; without one (the others are
        still down) only until its process is up, since no member is healthy before a quorum is back: call
        wait_healthy() once enough members run. Returns the seconds waited.
        """
        self._spawn(i, "existing")
        running = sum(m.running for m in self._members)
        if running > self.size // 2:
            return self.wait_healthy(i, timeout)
        return self.wait_listening(i, timeout)

    def restart_all(self, timeout: float = 10.0) -> float:
        """Starts every stopped member again at once and waits until all are healthy; returns the seconds waited."""
        for i, member in enumerate(self._members):
            if not member.running:
                self._spawn(i, "existing")
        return self.wait_all_healthy(timeout)

    # --- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops every member; files stay in ``directory`` (inside tmp_path) for pytest to keep or remove."""
        self.stop_all()
        _live.discard(self)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdCluster({self.url}, running={[m.running for m in self._members]}, directory={self.directory})"


@atexit.register
def _stop_leftovers() -> None:
    """Kills members of clusters nobody closed (a test interrupted by Ctrl-C), by their pids."""
    for cluster in list(_live):
        with contextlib.suppress(Exception):
            cluster.stop_all(grace=1.0)
