"""The local workers of ``ifrt run``: their environment, their start (each dies with its agent), their output
(prefixed), their stop."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO

from ifrt.agent_credential import AGENT_ENV, UnixUser
from ifrt.errors import InvalidArgument
from ifrt.hostport import join_host_port
from ifrt.run import child
from ifrt.settings import (
    ATTEMPT_ENV,
    COORDINATOR_ENV,
    LOCAL_RANK_ENV,
    LOCAL_WORLD_SIZE_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    TRANSFER_BIND_ENV,
    TRANSFER_FDS_ENV,
    Settings,
)

READER_JOIN_S = 2.0
"""How long a stop waits for a worker's last output lines after it exited."""
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ifrt-run-spawn")
"""The one thread that forks every worker. A parent-death signal fires when the thread that forked the child ends,
not its process: this thread lives as long as the agent (an idle pool thread never ends), whichever thread starts a
worker."""


@dataclass(frozen=True)
class WorkerUser:
    """The user the workers run as (``ifrt run --worker-user``): its name, home and ids."""

    name: str
    home: str
    ids: UnixUser


def worker_user(spec: str) -> WorkerUser:
    """The user ``spec`` names (a user name or a uid in the password database); InvalidArgument otherwise."""
    try:
        entry = pwd.getpwuid(int(spec)) if spec.isdigit() else pwd.getpwnam(spec)
    except (KeyError, OverflowError):
        raise InvalidArgument(f"--worker-user {spec!r} is no user of this host: expected a user name or uid from its "
                              "password database (getent passwd)") from None
    groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return WorkerUser(entry.pw_name, entry.pw_dir, UnixUser(entry.pw_uid, entry.pw_gid, groups))


def guarded(argv: Sequence[str], user: UnixUser | None = None) -> list[str]:
    """``argv`` started through ``ifrt.run.child``: the worker becomes ``user`` (None: stays this process's), asks for
    SIGKILL when this process (its agent) dies, then becomes ``argv`` itself. Unchanged where there is no such signal
    (not Linux) or no interpreter to run it."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return list(argv)
    who = "" if user is None else f":{user.uid}:{user.gid}:{','.join(map(str, user.groups))}"
    return [sys.executable, "-I", "-S", child.__file__, f"{os.getpid()}{who}", *argv]


def check_command(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """The OSError Popen raises for a command that cannot be run (``env``'s PATH): through ``ifrt.run.child`` the
    start itself succeeds and only the exec fails, after the fork."""
    program = argv[0]
    if shutil.which(program, path=os.pathsep.join(os.get_exec_path(dict(env)))) is not None:
        return
    if os.sep in program and os.path.exists(program):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


_HELD: dict[str, socket.socket] = {}
"""The listening sockets ``transfer_binds`` made, by address: held by the agent for as long as it lives."""
_HELD_LOCK = threading.Lock()


def transfer_binds(address: str, count: int) -> list[str]:
    """``count`` ``address:port``, one per local worker, kept for every attempt. Each port stays bound and listening in
    this agent (never accepting) for as long as it lives, and each worker started with one of them as its
    ``IFRT_TRANSFER_BIND`` is handed that very socket (``Worker``, ``IFRT_TRANSFER_FDS``) and accepts on it: no other
    socket can take the port between the pick and the worker's endpoint, nor between a worker and its restart."""
    listeners = [socket.create_server((address, 0), backlog=128) for _ in range(count)]
    binds = [join_host_port(address, s.getsockname()[1]) for s in listeners]
    with _HELD_LOCK:
        _HELD.update(zip(binds, listeners, strict=True))
    return binds


def held_listeners(env: Mapping[str, str], spare: bool) -> dict[str, int]:
    """The held listening sockets (address -> descriptor) a worker with ``env`` adopts: the one of its
    ``IFRT_TRANSFER_BIND``; every one for a ``spare``, which learns its bind only when handed a rank."""
    with _HELD_LOCK:
        if spare:
            return {address: s.fileno() for address, s in _HELD.items()}
        held = _HELD.get(env.get(TRANSFER_BIND_ENV, ""))
        return {} if held is None else {env[TRANSFER_BIND_ENV]: held.fileno()}


def worker_env(base: Mapping[str, str], settings: Settings, *, attempt: int, local_rank: int, nproc: int,
               host_rank: int | None, num_hosts: int | None, token_file: str | None,
               launcher_variables: Sequence[str] = (), transfer_bind: str | None = None,
               user: WorkerUser | None = None) -> dict[str, str]:
    """The environment of local worker ``local_rank``: the agent's, without its launcher's per-task variables (which
    describe the agent, not the worker), with the resolved settings as ``IFRT_*``. The process id is
    ``host_rank * nproc + local_rank`` when the host rank is known, else the coordinator assigns it (by host, then
    local rank: the same in every attempt). ``transfer_bind`` (unless the agent's environment sets one for every
    worker) keeps the worker's transfer endpoint at one address in every attempt, so the topology is identical. The
agent's credential and key (``ifrt.agent_credential``) stay with the agent. Run as ``user``, the worker gets its HOME,
USER and LOGNAME, as ``runuser`` gives them."""
    env = {k: v for k, v in base.items() if k not in launcher_variables and k not in AGENT_ENV}  # no agent powers
    if user is not None:
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
    if transfer_bind is not None and not env.get(TRANSFER_BIND_ENV):
        env[TRANSFER_BIND_ENV] = transfer_bind
    env.update({COORDINATOR_ENV: ",".join(settings.coordinators), LOCAL_RANK_ENV: str(local_rank),
                LOCAL_WORLD_SIZE_ENV: str(nproc), ATTEMPT_ENV: str(attempt)})
    for var, value in ((PROCESS_ID_ENV, None if host_rank is None else host_rank * nproc + local_rank),
                       (NUM_PROCESSES_ENV, None if num_hosts is None else num_hosts * nproc)):
        if value is None:
            env.pop(var, None)
        else:
            env[var] = str(value)
    if token_file is not None:  # the agent's --token-file: the workers read the same file
        env.pop(TOKEN_ENV, None)
        env[TOKEN_FILE_ENV] = token_file
    for var, value in ((TLS_CA_ENV, settings.tls_ca), (TLS_CERT_ENV, settings.tls_cert),
                       (TLS_KEY_ENV, settings.tls_key)):
        if value:
            env[var] = value
    return env


class Prefixer:
    """Copies a worker's output lines to the agent's, each behind ``[<process id>] `` (``[local <rank>] `` until the
    id is known); lines of several workers never mix."""

    _lock = threading.Lock()

    def __init__(self, label: Callable[[], str]) -> None:
        self._label = label
        self.threads: list[threading.Thread] = []

    def follow(self, source: BinaryIO, sink: BinaryIO) -> None:
        thread = threading.Thread(target=self._copy, args=(source, sink), name="ifrt-run-output", daemon=True)
        thread.start()
        self.threads.append(thread)

    def _copy(self, source: BinaryIO, sink: BinaryIO) -> None:
        with source:
            for line in iter(source.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    sink.write(f"[{self._label()}] ".encode() + line)
                    sink.flush()


class Worker:
    """One local worker of one attempt (``incarnation``: 0 for the rank's first, one more for each replacement)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, attempt: int, local_rank: int,
                 label: Callable[[], str] | None, incarnation: int = 0, spare: bool = False,
                 user: UnixUser | None = None) -> None:
        """``label`` (None: no prefix, the worker writes to the agent's own stdout and stderr) names the worker
        in front of each of its output lines. A ``spare`` (``local_rank`` -1 until ``hand_off``) reads its stdin
        from the agent. ``user``: whom the worker runs as (None: this process's user)."""
        self.attempt, self.local_rank, self.incarnation = attempt, local_rank, incarnation
        self.lock = threading.Lock()
        """Held while a spare is handed a process, so that its exit is reported as the role it had."""
        piped = subprocess.PIPE if label is not None else None
        # Its own process group (its id is the worker's pid): a terminal's Ctrl-C reaches the agent, which passes it
        # on once, and a stop reaches the worker's own children too (a `bash -c` wrapper's, DataLoader workers).
        # Started through ifrt.run.child, by the spawning thread: the worker dies with its agent.
        check_command(argv, env)
        fds = held_listeners(env, spare)  # its endpoint accepts on the socket the agent holds (transfer_binds)
        env = {k: v for k, v in env.items() if k != TRANSFER_FDS_ENV}
        if fds:
            env[TRANSFER_FDS_ENV] = ",".join(f"{address}={fd}" for address, fd in fds.items())
        command = guarded(argv, user)
        switch = {} if user is None or command != list(argv) else {  # no wrapper to switch: Popen does
            "user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}
        self.process: subprocess.Popen = _SPAWNER.submit(
            subprocess.Popen, command, env=env, stdout=piped, stderr=piped, pass_fds=tuple(fds.values()),
            stdin=subprocess.PIPE if spare else subprocess.DEVNULL, process_group=0, **switch).result()
        self.prefixer: Prefixer | None = None
        if label is not None:
            self.prefixer = Prefixer(label)
            self.prefixer.follow(self.process.stdout, sys.stdout.buffer)  # type: ignore[arg-type]
            self.prefixer.follow(self.process.stderr, sys.stderr.buffer)  # type: ignore[arg-type]

    @property
    def pid(self) -> int:
        return self.process.pid

    def hand_off(self, line: bytes, *, attempt: int, local_rank: int, incarnation: int) -> str | None:
        """Makes this spare the worker of ``local_rank``: writes ``line`` (``ifrt.spare.hand_off_line``) on its stdin,
        then closes it, as a worker's. Returns why it could not (it exited), or None."""
        with self.lock:
            if (code := self.process.poll()) is not None:
                return f"it exited with {code}"
            stdin = self.process.stdin
            assert stdin is not None
            try:
                stdin.write(line)
                stdin.close()
            except OSError as e:  # BrokenPipeError: it exited meanwhile
                return f"its stdin failed: {e}"
            self.attempt, self.local_rank, self.incarnation = attempt, local_rank, incarnation
            return None

    def wait(self) -> int:
        """Waits until the worker exits and its output is copied; its return code."""
        code = self.process.wait()
        if self.prefixer is not None:
            for thread in self.prefixer.threads:
                thread.join(READER_JOIN_S)
        return code

    def stopped(self) -> bool:
        """Whether the worker is stopped (SIGSTOP, SIGTSTP): it cannot act on SIGTERM."""
        try:
            with open(f"/proc/{self.pid}/stat", encoding="ascii") as f:
                return f.read().rpartition(")")[2].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return False

    def signal(self, signum: int) -> None:
        """Sends ``signum`` to the worker's process group: the worker and every child it started that stayed in it.
        Once the worker itself was reaped its id may be reused, so its group is signalled only while members of it
        remain (the kernel does not hand out an id that still names a process group)."""
        if self.process.poll() is not None and not _group_members(self.pid):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)


def _group_members(pgid: int) -> bool:
    """Whether any process is in process group ``pgid`` (read from /proc)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            return True
    return False


def stop_all(workers: Sequence[Worker], grace_s: float, signum: int = signal.SIGTERM) -> list[int]:
    """Sends ``signum`` to every worker's process group (SIGKILL to a stopped worker's), waits up to ``grace_s`` for
    the workers, then SIGKILLs the rest, and whatever their groups still hold (children that outlived the worker);
    returns every worker's return code."""
    for worker in workers:
        worker.signal(signal.SIGKILL if worker.stopped() else signum)
    deadline = time.monotonic() + grace_s
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(max(0.0, deadline - time.monotonic()))
        worker.signal(signal.SIGKILL)  # the worker if it outlived the grace period, and its group's leftovers
    return [worker.wait() for worker in workers]
