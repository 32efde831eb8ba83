"""Transfer identities: the pair keys a transfer connection proves its sender with (Kerberos-like, no new dependency).

Every process incarnation has its own random secret (``ifrt.security.new_process_secret``); the coordinator keeps its
sha256 (``ifrt.protocol.proof_of``) with the registration. The key of the directed pair (i -> j) is

    K(i -> j) = HMAC-SHA256(key = sha256-hex of j's secret, msg = b"ifrt transfer" + i + j)   (ids as signed 64-bit)

Process j derives it from its own secret; process i asks the coordinator for it (the ``TransferKey`` RPC, answered
only to a caller proving it is process i with i's own secret, for a peer j of the same run), once per pair, then
caches it (``TransferKeys``). A connection to j's endpoint then answers j's random challenge with
``hello_proof(K(i -> j), challenge, i, j)``: only process i (and the coordinator) can. The cluster token proves
nothing about which process a connection speaks for. Process ids are stable across generations and runs; a
restarted process has a new secret, so keys toward it change, and a sender whose cached key is refused fetches it
again (``forget``). Shared by the coordinator and the client: it imports neither grpc nor numpy.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections.abc import Callable

from ifrt.protocol import proof_of

LABEL = b"ifrt transfer"
"""What a pair key's HMAC message starts with (no other HMAC of a secret's hash starts so)."""
HELLO_LABEL = b"ifrt transfer hello"
KEY_BYTES = 32
_IDS = struct.Struct("!qq")


def pair_key(secret_hash: str, src_process: int, dst_process: int) -> bytes:
    """K(src -> dst): what ``src_process`` proves itself with to ``dst_process``, whose secret's sha256 (hex, as the
    coordinator stores it) is ``secret_hash``."""
    return hmac.new(secret_hash.encode(), LABEL + _IDS.pack(src_process, dst_process), hashlib.sha256).digest()


def hello_proof(key: bytes, challenge: bytes, src_process: int, dst_process: int) -> bytes:
    """What answers an endpoint's ``challenge`` for a connection from ``src_process`` to ``dst_process``."""
    return hmac.new(key, HELLO_LABEL + challenge + _IDS.pack(src_process, dst_process), hashlib.sha256).digest()


class TransferKeys:
    """One process's transfer keys: those toward it derived from its own secret, those toward its peers fetched
    (``fetch(peer) -> key``, one coordinator call) and cached until ``forget``."""

    def __init__(self, process_secret: str, fetch: Callable[[int], bytes]) -> None:
        self._secret_hash = proof_of(process_secret)
        self._fetch = fetch
        self._lock = threading.Lock()
        self._toward: dict[int, bytes] = {}

    def incoming(self, src_process: int, own_process: int) -> bytes:
        """K(src -> this process): what a connection that says it comes from ``src_process`` must prove."""
        return pair_key(self._secret_hash, src_process, own_process)

    def outgoing(self, dst_process: int) -> bytes:
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
