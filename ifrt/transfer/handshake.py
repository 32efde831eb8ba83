"""The first bytes of a transfer connection, on both sides: who the connecting process is, proven before any frame.

The connecting process i sends a HELLO naming itself and the endpoint's process j. Its sequence field says how it
proves it (``ifrt.transfer.frames``):

- KEYED (an endpoint with transfer keys, i.e. made by a ``Client``): j sends a random challenge; i answers with its
  incarnation n (4 bytes) and ``hello_proof(K(i -> j, n), challenge, i, j)`` (``ifrt.transfer_keys``), which only
  incarnation n of process i (and the coordinator) can compute; j checks it in constant time, then checks n against
  the latest incarnation of i it knows (``fence``: from the job's events, and from earlier proven hellos), and answers
  ADMITTED or REFUSED (i then fetches its key again once: j may have restarted with a new secret; an old incarnation
  of i is refused that key by the coordinator). Only such a connection carries frames into an endpoint with keys.
- PLAIN (an endpoint without keys: a bare ``Endpoint``/``Channels`` used without a client; and pre-flight probes):
  with the cluster's token, j challenges i to prove it holds the token; without one, i must connect from the address
  process i advertised. Into an endpoint with keys such a connection is a probe: admitted, but any frame on it closes
  it (the token, or the shared loopback address, says nothing about which process is speaking).

Either way the hello must name a process of j's topology and j itself, all within the handshake timeout.
"""

from __future__ import annotations

import hmac
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ifrt.errors import TransferError
from ifrt.hostport import split_host_port
from ifrt.ratelimit import Throttled
from ifrt.transfer.frames import (
    ADMITTED,
    CHALLENGE_BYTES,
    HELLO,
    KEYED,
    PLAIN,
    REFUSED,
    addresses_of,
    encode_header,
    ip_of,
    read_header,
    recv_exactly,
    token_proof,
)
from ifrt.transfer_keys import INCARNATION, PairKey, TransferKeys, hello_proof

if TYPE_CHECKING:
    from ifrt.topology import Topology


class Admitted(NamedTuple):
    """A connection past its handshake: the process it speaks for, and whether it may carry frames."""

    process: int
    carries_frames: bool
    proven: bool
    """Whether it proved the process's own pair key (not only the token or an address)."""
    incarnation: int | None = None
    """The incarnation of the process its pair key proved (None: not proven by a key)."""


class Doorman:
    """An endpoint's side of the handshake (see the module): admits a new connection or says why not (logged,
    counted when repeated)."""

    def __init__(self, *, auth_key: bytes | None, keys: TransferKeys | None, timeout: float, noisy: Throttled,
                 topology: Callable[[float], Topology | None], hung_up: Callable[[socket.socket], bool],
                 fenced: Callable[[int, int], str | None] = lambda process, incarnation: None) -> None:
        self.auth_key, self.keys, self.timeout, self._noisy = auth_key, keys, timeout, noisy
        self._topology = topology  # waits until the deadline (monotonic) for the endpoint's topology
        self._hung_up = hung_up  # whether the endpoint closed the connection meanwhile (then nothing is logged)
        self._fenced = fenced  # why a proven incarnation of a process is an old one (refused), or None

    def admit(self, conn: socket.socket, peer: tuple) -> Admitted | None:
        """The process a new connection speaks for, once admitted within the handshake timeout; None if refused."""
        deadline = time.monotonic() + self.timeout
        try:
            hello = read_header(conn, hello=True, deadline=deadline)
        except (TransferError, OSError) as e:
            if not self._hung_up(conn):
                self._noisy.warning("hello", "closed a transfer connection from %s: no valid hello within %gs: %s",
                                    peer, self.timeout, e)
            return None
        topology = self._topology(deadline)
        why = self._not_a_member(topology, peer, hello.src, hello.dst, keyed=hello.seq == KEYED)
        if why is None and hello.seq not in (PLAIN, KEYED):
            why = f"its hello says proof kind {hello.seq}: expected {PLAIN} (token or address) or {KEYED} (pair key)"
        if why is None and hello.seq == KEYED and self.keys is None:
            why = ("it proves itself with a pair key, but this endpoint has no transfer keys (it was made without a "
                   "client)")
        if why is not None:
            self._refused(conn, peer, hello.src, why)
            return None
        assert topology is not None
        if hello.seq == KEYED:
            return self._challenge(conn, peer, hello.src, topology.process_id, deadline, None, keyed=True)
        if self.auth_key is not None:
            return self._challenge(conn, peer, hello.src, topology.process_id, deadline, self.auth_key, keyed=False)
        conn.settimeout(None)
        return Admitted(hello.src, self.keys is None, False)

    def _not_a_member(self, topology: Topology | None, peer: tuple, src: int, dst: int, keyed: bool) -> str | None:
        """Why a hello from ``peer`` that says it is process ``src`` (to ``dst``) is not believed, or None."""
        if topology is None:
            return f"this endpoint learnt no topology within {self.timeout:g}s"
        if dst != topology.process_id:
            return (f"it is addressed to process {dst}, this is process {topology.process_id} of topology generation "
                    f"{topology.generation}")
        try:
            claimed = topology.process(src)
        except KeyError:
            return f"topology generation {topology.generation} has no process {src}"
        if keyed or self.auth_key is not None:
            return None  # the challenge decides
        host = split_host_port(claimed.address)[0]
        if not host:
            return f"process {src} advertised no transfer endpoint"
        if ip_of(str(peer[0])) not in addresses_of(host):
            return (f"it connects from {peer[0]}, but process {src} is at {host} in topology generation "
                    f"{topology.generation}")
        return None

    def _challenge(self, conn: socket.socket, peer: tuple, src: int, own: int, deadline: float, key: bytes | None,
                   keyed: bool) -> Admitted | None:
        """Challenges a new connection to prove the pair key of the incarnation it names (``keyed``: ``key`` None)
        or the cluster's token (``key``)."""
        what = f"process {src}'s transfer key" if keyed else "the cluster's token"
        challenge = os.urandom(CHALLENGE_BYTES)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            conn.sendall(challenge)
            answer = bytearray((INCARNATION.size if keyed else 0) + CHALLENGE_BYTES)
            recv_exactly(conn, memoryview(answer), f"the answer to the challenge for {what}", deadline)
        except (OSError, TransferError) as e:
            kind = "token " if not keyed else ""
            self._refused(conn, peer, src, f"no answer to the {kind}challenge: {e}")
            return None
        incarnation = None
        if keyed:
            assert self.keys is not None
            (incarnation,), answer = INCARNATION.unpack_from(answer), answer[INCARNATION.size:]
            expected = hello_proof(self.keys.incoming(src, own, incarnation), challenge, src, own)
        else:
            assert key is not None
            expected = token_proof(key, challenge)
        if not hmac.compare_digest(bytes(answer), expected):
            if keyed:
                _say(conn, REFUSED)
            self._refused(conn, peer, src, f"it does not hold {what}" if keyed else "it does not hold the cluster's "
                                                                                    "token")
            return None
        if incarnation is not None and (why := self._fenced(src, incarnation)) is not None:
            _say(conn, REFUSED)
            if not self._hung_up(conn):
                self._noisy.warning("old incarnation", "refused a transfer connection from %s: it proves incarnation "
                                    "%d of process %d, an old incarnation: %s", peer, incarnation, src, why)
            return None
        if keyed and not _say(conn, ADMITTED):
            return None
        conn.settimeout(None)
        return Admitted(src, keyed or self.keys is None, keyed, incarnation)

    def _refused(self, conn: socket.socket, peer: tuple, src: int, why: str) -> None:
        if not self._hung_up(conn):
            self._noisy.warning("stranger", "refused a transfer connection from %s (says process %d): %s", peer, src,
                                why)


def _say(conn: socket.socket, verdict: bytes) -> bool:
    try:
        conn.sendall(verdict)
    except OSError:
        return False
    return True


def introduce(sock: socket.socket, src: int, dst: int, *, key: PairKey | None, token: bytes | None,
              what: str) -> bool:
    """The connecting side: says who this process (``src``) is to process ``dst``'s endpoint and proves it with the
    pair ``key`` and the incarnation it binds (KEYED) or the cluster's ``token`` (PLAIN; neither: the address it
    connects from). Returns False when the endpoint refused the pair key (fetch it again), True once admitted;
    TransferError (or OSError) if the endpoint fails or closes the handshake (``what`` names it)."""
    sock.sendall(encode_header(HELLO, KEYED if key is not None else PLAIN, src, dst))
    if key is None and token is None:
        return True
    challenge = bytearray(CHALLENGE_BYTES)
    recv_exactly(sock, memoryview(challenge), f"{what}'s challenge")
    if key is None:
        assert token is not None
        sock.sendall(token_proof(token, bytes(challenge)))
        return True
    sock.sendall(INCARNATION.pack(key.incarnation) + hello_proof(key.key, bytes(challenge), src, dst))
    verdict = sock.recv(1)
    if verdict == ADMITTED:
        return True
    if verdict == REFUSED:
        return False
    raise TransferError(f"{what} closed the connection instead of answering its pair-key handshake")
