"""An ``ifrt run`` agent's host credential: what binds the host an agent acts for to a secret it cannot make up.

The operator holds an agent key (the coordinator's ``--agent-key-file``). A host's credential is the HMAC-SHA256 of
its name under that key, so the coordinator checks it without keeping a list, and a credential names one host only:
an agent that holds ``node3``'s credential may act for ``node3`` and nothing else, as a kubelet's certificate names
its node. Hand each host its own credential (``ifrt agent-credential --host node3``) for that binding to hold between
hosts; a host given the key itself can make every host's credential (convenient where the key sits on a shared file
system, but then any host's agent can act for any host).

Out of the workers' reach: the agent removes both variables from its workers' environment, makes itself non-dumpable
before it reads either (``hide_this_process``: its ``/proc/<pid>/environ``, ``fd/``, ``maps`` and ``mem`` become
unreadable to processes of its own user that are not root, and ptrace is refused), reads each secret once and keeps
it only in memory, and takes it on a descriptor it closes before any worker starts (``-`` for its stdin,
``/dev/fd/N``). A file that names a secret is still readable by whoever its mode allows: ``reach_warnings`` says so
at start-up for the user the workers run as (``ifrt run --worker-user``). Root workers can read everything.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ifrt.errors import InvalidArgument
from ifrt.protocol import read_secret_file

AGENT_CREDENTIAL_METADATA = "ifrt-agent-credential"
"""Call metadata carrying an agent's host credential (JobAgents calls only)."""
AGENT_KEY_FILE_ENV = "IFRT_AGENT_KEY_FILE"
"""The agent key's file: the coordinator's ``--agent-key-file``, or an agent's, which derives its own host's
credential from it."""
AGENT_CREDENTIAL_FILE_ENV = "IFRT_AGENT_CREDENTIAL_FILE"
"""A file holding this host's credential (``ifrt agent-credential --host H`` printed it)."""
AGENT_ENV = (AGENT_KEY_FILE_ENV, AGENT_CREDENTIAL_FILE_ENV)
"""What an agent removes from its workers' environment."""
MIN_KEY_CHARS = 16
"""The shortest agent key accepted: a key is random text (``openssl rand -hex 32``)."""
_CONTEXT = b"ifrt agent host\x00"
_PR_SET_DUMPABLE = 4
_DESCRIPTOR = re.compile(r"^(?:-|/dev/stdin|/dev/fd/(\d+)|/proc/self/fd/(\d+))$")
"""Secret sources that are descriptors: ``-`` and ``/dev/stdin`` (0), ``/dev/fd/N`` and ``/proc/self/fd/N``."""
MAX_SECRET_BYTES = 64 << 10
"""The most a secret's descriptor is read (a key or credential is a line of hex)."""


def hide_this_process() -> str | None:
    """Makes this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``), so that processes of its user that are not
    root can read neither its environment, descriptors nor memory in ``/proc`` and cannot ptrace it (it also writes no
    core dump). Kept across threads and forks, reset by an exec: its workers are ordinary processes. Returns why not
    (not Linux, or refused), else None."""
    if not sys.platform.startswith("linux"):
        return f"no PR_SET_DUMPABLE on {sys.platform}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        return f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(ctypes.get_errno())}"
    return None


def descriptor_of(path: str) -> int | None:
    """The descriptor ``path`` names as a secret's source (``-``, ``/dev/stdin``, ``/dev/fd/N``); None for a file."""
    match = _DESCRIPTOR.match(path)
    if match is None:
        return None
    return int(match.group(1) or match.group(2) or 0)


def read_secret(path: str, origin: str) -> str:
    """The secret in file ``path``, or on the descriptor it names (``descriptor_of``), read to its end and then closed
    (stdin is left on /dev/null) so that nothing started later inherits it or finds it under ``/proc/<pid>/fd``.
    InvalidArgument naming the source, never the content."""
    fd = descriptor_of(path)
    if fd is None:
        return read_secret_file(path, origin)
    chunks: list[bytes] = []
    try:
        while (chunk := os.read(fd, MAX_SECRET_BYTES)) and sum(map(len, chunks)) <= MAX_SECRET_BYTES:
            chunks.append(chunk)
    except OSError as e:
        raise InvalidArgument(f"cannot read descriptor {fd} ({path!r}, {origin}): {e.strerror}: expected the secret on "
                              "it, e.g. `ifrt run --agent-credential-file - < FILE`") from None
    finally:
        _close(fd)
    try:
        value = b"".join(chunks).decode().strip()
    except UnicodeDecodeError:
        raise InvalidArgument(f"descriptor {fd} ({path!r}, {origin}) holds no text: expected the secret") from None
    if not value or len(value) > MAX_SECRET_BYTES:
        raise InvalidArgument(f"descriptor {fd} ({path!r}, {origin}) held {len(value)} characters: expected a secret "
                              f"of 1 to {MAX_SECRET_BYTES}")
    return value


def _close(fd: int) -> None:
    """Closes ``fd``; stdin is put on /dev/null instead, so that no later open takes descriptor 0."""
    try:
        if fd == 0:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
        else:
            os.close(fd)
    except OSError:
        pass


def read_agent_key(path: str, origin: str) -> str:
    """The agent key in ``path`` (or on the descriptor it names); InvalidArgument naming the source (never its
    content) when it is too short."""
    key = read_secret(path, origin)
    if len(key) < MIN_KEY_CHARS:
        raise InvalidArgument(f"the agent key in {path!r} ({origin}) is {len(key)} characters long: expected at least "
                              f"{MIN_KEY_CHARS} random characters (openssl rand -hex 32)")
    return key


def host_credential(key: str, host: str) -> str:
    """``host``'s credential under the agent key ``key`` (hex)."""
    return hmac.new(key.encode(), _CONTEXT + host.encode(), hashlib.sha256).hexdigest()


def credential_holds(key: str, host: str, given: str | None) -> bool:
    """Whether ``given`` is ``host``'s credential under ``key`` (constant-time)."""
    return given is not None and hmac.compare_digest(host_credential(key, host).encode(), given.encode())


def agent_credential(host: str, *, credential_file: str | None = None, key_file: str | None = None,
                     env: Mapping[str, str] = os.environ) -> str | None:
    """The credential an agent on ``host`` presents: from ``credential_file`` (else IFRT_AGENT_CREDENTIAL_FILE), or
    derived from the key in ``key_file`` (else IFRT_AGENT_KEY_FILE); None when neither is given."""
    credential_file = credential_file or env.get(AGENT_CREDENTIAL_FILE_ENV, "").strip() or None
    if credential_file:
        return read_secret(credential_file, "the agent's credential file")
    key_file = key_file or env.get(AGENT_KEY_FILE_ENV, "").strip() or None
    if key_file:
        return host_credential(read_agent_key(key_file, "the agent key file"), host)
    return None


@dataclass(frozen=True)
class UnixUser:
    """Who a process runs as: uid, primary gid, supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def current(cls) -> UnixUser:
        return cls(os.geteuid(), os.getegid(), tuple(os.getgroups()))

    def may(self, st: os.stat_result, bit: int) -> bool:
        """Whether this user's mode bits allow ``bit`` (4 read, 1 search) on ``st`` (root may always)."""
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid == self.gid or st.st_gid in self.groups:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)


def readable_by(path: str, user: UnixUser) -> os.stat_result | None:
    """The file's status where ``user`` can read it by its path (every directory above it searchable, the file
    readable, by mode bits: an ACL may allow more); None where it cannot, or the path cannot be examined."""
    real = os.path.realpath(path)
    try:
        parent = os.path.dirname(real)
        while True:
            if not user.may(os.stat(parent), 1):
                return None
            if parent == os.path.dirname(parent):
                break
            parent = os.path.dirname(parent)
        st = os.stat(real)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) and user.may(st, 4) else None


def reach_warnings(sources: Mapping[str, str | None], workers: UnixUser) -> list[str]:
    """One line per secret source (``sources``: what it is -> its path, or None when not given) that the workers,
    running as ``workers``, could read: a file their user may read, or any when they run as root. Descriptor sources
    (``read_secret`` closes them) are not files the workers can name."""
    given = {what: path for what, path in sources.items() if path and descriptor_of(path) is None}
    if not given:
        return []
    if workers.uid == 0:
        return [f"the workers run as root: they can read {' and '.join(f'{w} {p}' for w, p in given.items())} and this "
                "agent's memory; run them as another user (ifrt run --worker-user, see docs/security.md)"]
    lines = []
    for what, path in given.items():
        if (st := readable_by(path, workers)) is not None:
            lines.append(f"{what} {path} (mode {stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}:{st.st_gid}) is "
                         f"readable by the user the workers run as (uid {workers.uid}): a worker can read it and act "
                         f"as this host's agent; make it owned by another user with mode 0400 and run the workers as "
                         f"another user (--worker-user), or hand it on a descriptor (-), see docs/security.md")
    return lines
