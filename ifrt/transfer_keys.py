"""Transfer identities: the pair keys a transfer connection proves its sender with (Kerberos-like, no new dependency).

Every process incarnation has its own random secret (``ifrt.security.new_process_secret``); the coordinator keeps its
sha256 (``ifrt.protocol.proof_of``) with the registration, and counts the incarnations of each process id (0 for the
id's first process, one more for each restart or replacement). The key of the directed pair (i -> j), for i's
incarnation n, is

    K(i -> j, n) = HMAC-SHA256(key = sha256-hex of j's secret, msg = b"ifrt transfer" + i + j + n)
                   (ids as signed 64-bit, n as unsigned 32-bit)

Process j derives it from its own secret for the incarnation a connection names; process i asks the coordinator for
it (the ``TransferKey`` RPC, answered only to a caller proving it is the current incarnation of process i with its own
secret, for a peer j of the same run: the answer names n), once per pair, then caches it (``TransferKeys``). A
connection to j's endpoint then names n and answers j's random challenge with ``hello_proof(K(i -> j, n), ...)``:
only incarnation n of process i (and the coordinator) can. So a key binds both processes' incarnations: j's through
its secret, i's through n, which j checks against the latest incarnation of i it knows (``ifrt.transfer.handshake``):
an old incarnation of i, replaced or declared failed, cannot pass for the current one with the key it cached. The
cluster token proves nothing about which process a connection speaks for. A restarted process j has a new secret, so
keys toward it change, and a sender whose cached key is refused fetches it again (``forget``). Shared by the
coordinator and the client: it imports neither grpc nor numpy.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple

from ifrt.protocol import proof_of

LABEL = b"ifrt transfer"
"""What a pair key's HMAC message starts with (no other HMAC of a secret's hash starts so)."""
HELLO_LABEL = b"ifrt transfer hello"
KEY_BYTES = 32
_IDS = struct.Struct("!qq")
INCARNATION = struct.Struct("!I")
"""A sender's incarnation as a pair key binds it, and as its keyed hello names it."""


class PairKey(NamedTuple):
    """K(this process -> a peer) as the coordinator hands it: the key, and this process's incarnation it binds."""

    key: bytes
    incarnation: int


def pair_key(secret_hash: str, src_process: int, dst_process: int, incarnation: int) -> bytes:
    """K(src -> dst, incarnation): what incarnation ``incarnation`` of ``src_process`` proves itself with to
    ``dst_process``, whose secret's sha256 (hex, as the coordinator stores it) is ``secret_hash``."""
    if not 0 <= incarnation < 1 << 32:
        raise ValueError(f"incarnation {incarnation} of process {src_process}: expected 0 <= incarnation < 2**32")
    return hmac.new(secret_hash.encode(), LABEL + _IDS.pack(src_process, dst_process) + INCARNATION.pack(incarnation),
                    hashlib.sha256).digest()


def hello_proof(key: bytes, challenge: bytes, src_process: int, dst_process: int) -> bytes:
    """What answers an endpoint's ``challenge`` for a connection from ``src_process`` to ``dst_process``."""
    return hmac.new(key, HELLO_LABEL + challenge + _IDS.pack(src_process, dst_process), hashlib.sha256).digest()


class TransferKeys:
    """One process's transfer keys: those toward it derived from its own secret, those toward its peers fetched
    (``fetch(peer) -> PairKey``, one coordinator call) and cached until ``forget``."""

    def __init__(self, process_secret: str, fetch: Callable[[int], PairKey]) -> None:
        self._secret_hash = proof_of(process_secret)
        self._fetch = fetch
        self._lock = threading.Lock()
        self._toward: dict[int, PairKey] = {}

    def incoming(self, src_process: int, own_process: int, incarnation: int) -> bytes:
        """K(src -> this process, incarnation): what a connection that says it comes from incarnation
        ``incarnation`` of ``src_process`` must prove."""
        return pair_key(self._secret_hash, src_process, own_process, incarnation)

    def outgoing(self, dst_process: int) -> PairKey:
        """K(this process -> dst): cached, else asked of the coordinator (its typed error when it refuses)."""
        with self._lock:
            key = self._toward.get(dst_process)
        if key is None:
            key = self._fetch(dst_process)
            with self._lock:
                self._toward[dst_process] = key
        return key

    def forget(self, dst_process: int) -> None:
        """Drops the cached key toward ``dst_process`` (it refused it: it restarted since), so the next is fetched."""
        with self._lock:
            self._toward.pop(dst_process, None)

    @property
    def cached(self) -> int:
        """How many keys toward peers are cached (one coordinator call each)."""
        with self._lock:
            return len(self._toward)
