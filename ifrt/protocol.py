"""What the coordinator and its clients agree on beside the proto: the call metadata names, how a process secret
is proved, and how a secret file is read. Both sides import it; it imports no client code."""

from __future__ import annotations

import hashlib
import logging
import os

from ifrt.errors import InvalidArgument

log = logging.getLogger("ifrt.settings")  # the name this warning has always been logged under

MAX_TOPOLOGY_BYTES = 1 << 30
"""The largest topology either side handles: a client receives messages this large, and nobody inflates a
compressed topology past it."""
TOKEN_METADATA = "ifrt-token"
"""Call metadata carrying the cluster's shared token (compared in constant time by the coordinator)."""
SECRET_METADATA = "ifrt-process-secret"
"""Call metadata carrying this process's own secret: only the process that registered may act for it."""
SLOW_SHARE = 1 / 3
"""A process whose session sent no Heartbeat for this share of the heartbeat timeout is shown as slow (``ifrt
status``, the status page, metrics): it stopped answering, and is declared failed if it stays so."""
NO_HEARTBEATS_MS = 3_600_000
"""``Attached.heartbeat_interval_ms`` of a coordinator that asks for no Heartbeat (an hour, not 0, which a client
could take as "without pause")."""


def attempt_ended(ended: int, started: int) -> str:
    """Why the coordinator ends every session when the job's next attempt starts (said to people: clients read the
    Shutdown's typed fields, never this text)."""
    return f"attempt {ended} of the job ended; attempt {started} starts (its processes register anew)"


def proof_of(secret: str) -> str:
    """What the coordinator keeps and compares: the secret's sha256, never the secret itself."""
    return hashlib.sha256(secret.encode()).hexdigest() if secret else ""


def read_secret_file(path: str, origin: str) -> str:
    """The secret held by ``path`` (surrounding whitespace removed); InvalidArgument naming the file, never its
    content."""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
            mode = os.fstat(f.fileno()).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read {path!r} ({origin}): {e}") from None
    if not value:
        raise InvalidArgument(f"{path!r} ({origin}) is empty: expected a secret")
    if mode & 0o077:
        log.warning("the secret in %s (%s) is readable by other users (mode %o): chmod 600 %s", path, origin,
                    mode & 0o777, path)
    return value
