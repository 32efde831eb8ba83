"""Moving numpy arrays between devices of different processes over the topology's transfer endpoints.

Each process binds an ``Endpoint`` before it registers and advertises its address in the topology.
``Channels(topology)`` then sends to and receives from any device: a socket to a peer process is opened on
first use and reused; a transfer between two devices of the same process never touches a socket.

A frame (its bytes: ``ifrt.frames``) is a fixed header (magic, version, sequence number, source and destination
device, dtype, shape, payload length) followed by the raw array bytes. Sequence numbers run per (source,
destination) pair, so a lost, repeated or reordered frame is an error, as is a bad header or a peer that goes
away mid-frame. A sender numbers and writes a frame in one step under the lock of its destination process, so
threads sending on the same pair put frames on the wire in sequence order. Every receive waits a finite time.

With the cluster's token, a new connection is challenged before its first frame: the endpoint sends a random
nonce and the connecting process answers with an HMAC of it under the token; a stranger is logged and closed.
Without a token, the hello is bound to the topology instead: a connection that says it comes from process P must
come from the address P advertised (each process connects from its own endpoint's host), so a stranger elsewhere
cannot speak for a member. Either way a peer has ``HANDSHAKE_TIMEOUT_S`` from its connection to its first frame,
at most ``MAX_HANDSHAKES`` connections wait in their handshake (a newer one closes the oldest), and running out of
descriptors pauses accepting instead of ending it. Repeated refusals are counted, not each logged.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import math
import numbers
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ifrt.errors import InvalidArgument, TransferError, TransferTimeout
from ifrt.frames import (
    ALLOWED_KINDS,
    ARRAY,
    CHALLENGE_BYTES,
    HEADER,
    HELLO,
    addresses_of,
    connect,
    encode_header,
    ip_of,
    read_frame,
    recv_exactly,
    token_proof,
)
from ifrt.hostport import check_address, check_host, join_host_port, split_host_port
from ifrt.ids import LOCAL_ID_BITS
from ifrt.ratelimit import Throttled

if TYPE_CHECKING:
    from ifrt.topology import Topology

log = logging.getLogger("ifrt.transfer")

HANDSHAKE_TIMEOUT_S = 10.0
"""From a connection's accept to the end of its handshake (hello, topology check, token challenge): then it closes."""
MAX_HANDSHAKES = 64
"""Connections in their handshake at once; a newer one closes the oldest (a member's hello comes at once)."""
ACCEPT_BACKOFF_S = (0.01, 1.0)
"""First and longest pause of the accepting thread when the process is out of descriptors (doubling between)."""
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
RECV_TIMEOUT_S = 60.0
"""How long a receive waits when not told (``timeout=None``): no wait is unbounded."""



def wait_seconds(timeout: float | None, default: float) -> float:
    """The seconds a receive waits: ``default`` for None; InvalidArgument for a negative or unbounded value."""
    given = default if timeout is None else timeout
    if not (isinstance(given, numbers.Real) and math.isfinite(given) and given >= 0):
        raise InvalidArgument(f"receive timeout {given!r} is not a finite number of seconds: expected "
                              "0 <= timeout < inf (None waits the default)")
    return float(given)


class Endpoint:
    """This process's transfer listener; incoming arrays wait in one queue per (source, destination) device."""

    _bound: ClassVar[dict[str, Endpoint]] = {}  # address -> endpoint, so Channels(topology) finds its own
    _bound_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, bind: str = "127.0.0.1:0", advertise_host: str | None = None,
                 token: str | None = None, handshake_timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        """With ``token`` (the cluster's), a connecting peer must prove it holds the same token before any frame
        is accepted, and this process proves it to the peers it connects to. Without one, a peer must connect
        from the address of the process it says it is (see ``expect``)."""
        check_address(bind, "the transfer endpoint's bind address", bind=True)
        if advertise_host is not None:
            check_host(advertise_host, "the transfer endpoint's advertised host")
        self.auth_key = token.encode() if token else None
        self.handshake_timeout = handshake_timeout
        host, port = split_host_port(bind)
        try:
            self._listener = socket.create_server((host, int(port)), backlog=128)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot bind the transfer endpoint to {bind!r}: {e}") from e
        self.address = join_host_port(advertise_host or host, self._listener.getsockname()[1])
        self._queues: dict[tuple[int, int], queue.Queue] = {}
        self._failed: dict[int, TransferError] = {}  # source process -> why its connection ended badly
        self._lock = threading.Lock()
        self._topology_known = threading.Condition(self._lock)
        self._topology: Topology | None = None
        self._peers: set[socket.socket] = set()  # admitted connections; each leaves when it closes
        self._handshaking: dict[socket.socket, None] = {}  # connections in their handshake, oldest first
        self._max_handshakes = MAX_HANDSHAKES
        self._noisy = Throttled(log)
        self._closed = False
        threading.Thread(target=self._accept, name=f"ifrt-transfer-accept-{self.address}", daemon=True).start()
        with Endpoint._bound_lock:
            Endpoint._bound[self.address] = self

    def expect(self, topology: Topology) -> None:
        """Takes ``topology`` as the one whose processes may connect (a newer generation replaces it)."""
        with self._topology_known:
            if self._topology is not None and topology.generation < self._topology.generation:
                return
            first, self._topology = self._topology is None, topology
            self._topology_known.notify_all()
        # Said once the endpoint serves a job, not by a discovery that failed; INFO: the coordinator, which has no
        # token either (else this process could not have registered), warns the operator once for the whole job.
        if first and self.auth_key is None:
            log.info("transfers to %s are unauthenticated (no cluster token): any process that can reach this "
                        "port from a member's address can send to this process; set IFRT_TOKEN (the coordinator's "
                        "--token-file) to require the token", self.address)

    @property
    def open_connections(self) -> int:
        """Connections from peers this endpoint holds now: admitted ones and ones in their handshake."""
        with self._lock:
            return len(self._peers) + len(self._handshaking)

    @classmethod
    def at(cls, address: str) -> Endpoint:
        """The endpoint this process bound at ``address``."""
        with cls._bound_lock:
            endpoint = cls._bound.get(address)
        if endpoint is None:
            raise TransferError(f"this process has no transfer endpoint at {address!r}: was the topology "
                                "discovered by this process, with transfers enabled?")
        return endpoint

    def receive(self, src: int, dst: int, src_process: int, timeout: float) -> np.ndarray:
        """The next array sent from device ``src`` to device ``dst``; TransferTimeout after ``timeout`` seconds."""
        timeout = wait_seconds(timeout, RECV_TIMEOUT_S)
        arrivals = self._queue(src, dst)
        with self._lock:
            failure = self._failed.get(src_process)
        if failure is not None and arrivals.empty():
            raise failure  # the connection failed before this queue existed; later failures land in it
        try:
            item = arrivals.get(timeout=timeout)
        except queue.Empty:
            raise TransferTimeout(f"nothing arrived from device {src} (process {src_process}) for device {dst} "
                                  f"within {timeout}s") from None
        if isinstance(item, TransferError):
            self._queue(src, dst).put(item)  # every later receive from that peer fails the same way
            raise item
        return item

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = [*self._peers, *self._handshaking], set()
            self._handshaking = {}
            self._topology_known.notify_all()  # a handshake waiting for the topology ends now
        self._noisy.flush()
        with Endpoint._bound_lock:
            Endpoint._bound.pop(self.address, None)
        with contextlib.suppress(OSError):  # wakes the accepting thread; close alone leaves the port accepting once
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for peer in peers:
            with contextlib.suppress(OSError):  # wakes its reading thread, which closes it
                peer.shutdown(socket.SHUT_RDWR)

    def _queue(self, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self._queues.setdefault((src, dst), queue.Queue())

    def _accept(self) -> None:
        pause = ACCEPT_BACKOFF_S[0]
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                if e.errno not in _OUT_OF_RESOURCES and e.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    log.error("the transfer endpoint %s stopped accepting connections: %s", self.address, e)
                    return
                if e.errno in _OUT_OF_RESOURCES:
                    self._out_of_descriptors(e, pause)
                    time.sleep(pause)
                    pause = min(2 * pause, ACCEPT_BACKOFF_S[1])
                continue
            pause = ACCEPT_BACKOFF_S[0]
            oldest = None
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._handshaking) >= self._max_handshakes:
                    oldest = next(iter(self._handshaking))
                    del self._handshaking[oldest]
                self._handshaking[conn] = None
            if oldest is not None:
                self._noisy.warning("handshakes", "closed the oldest transfer connection still in its handshake: at "
                                    "most %d may wait", self._max_handshakes)
                _hang_up(oldest)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(conn, peer), name="ifrt-transfer-recv", daemon=True).start()
            except (OSError, RuntimeError) as e:  # the peer already left, or no thread could start
                self._noisy.warning("threads", "dropped a transfer connection from %s: %s", peer, e)
                with self._lock:
                    self._handshaking.pop(conn, None)
                conn.close()

    def _out_of_descriptors(self, error: OSError, pause: float) -> None:
        """Frees descriptors for the process when accepting fails for want of them: the connections still in their
        handshake (the likely cause) are halved, and so is how many may wait from now on."""
        with self._lock:
            self._max_handshakes = max(4, min(self._max_handshakes, len(self._handshaking)) // 2)
            waiting = list(self._handshaking)
            dropped = waiting[:max(0, len(waiting) - self._max_handshakes)]
            for conn in dropped:
                del self._handshaking[conn]
        self._noisy.warning("accept", "the transfer endpoint %s cannot accept connections: %s; %d connections were "
                            "in their handshake, closed %d and allow %d from now on; accepting again in %gs",
                            self.address, error, len(waiting), len(dropped), self._max_handshakes, pause)
        for conn in dropped:
            _hang_up(conn)

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        src_process = -1
        expected: dict[tuple[int, int], int] = {}
        try:
            admitted = self._handshake(conn, peer)
            with self._lock:
                if admitted is None or conn not in self._handshaking:  # refused, or closed meanwhile as the oldest
                    return
                del self._handshaking[conn]
                self._peers.add(conn)
            src_process = admitted
            while True:
                header = conn.recv(HEADER.size, socket.MSG_PEEK)
                if not header:
                    return  # a clean close between frames
                _, seq, src, dst, array = read_frame(conn, hello=False)
                want = expected.get((src, dst), 0)
                if seq != want:
                    raise TransferError(f"frame {seq} from device {src} to device {dst}: expected frame {want} "
                                        "(a frame was lost, repeated or reordered)")
                expected[(src, dst)] = seq + 1
                self._queue(src, dst).put(array)
        except (TransferError, OSError) as e:
            if self._closed:
                return
            error = e if isinstance(e, TransferError) else TransferError(f"connection error: {e}")
            error = TransferError(f"transfer from process {src_process} failed: {error}")
            log.warning("%s", error)
            with self._lock:
                self._failed[src_process] = error
                queues = [q for (s, _), q in self._queues.items() if s >> LOCAL_ID_BITS == src_process]
            for q in queues:
                q.put(error)
        finally:
            with self._lock:
                self._handshaking.pop(conn, None)
                self._peers.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, peer: tuple) -> int | None:
        """The process a new connection speaks for, once its hello is read and it is admitted (topology check or
        token challenge) within the handshake timeout; None for a peer that is silent, malformed or not who it
        says (logged, counted when repeated)."""
        deadline = time.monotonic() + self.handshake_timeout
        try:
            _, _, src_process, dst_process, _ = read_frame(conn, hello=True, deadline=deadline)
        except (TransferError, OSError) as e:
            with self._lock:
                hung_up = self._closed or conn not in self._handshaking  # closed as the oldest: logged then
            if not hung_up:
                self._noisy.warning("hello", "closed a transfer connection from %s: no valid hello within %gs: %s",
                                    peer, self.handshake_timeout, e)
            return None
        why = self._not_a_member(peer, src_process, dst_process, deadline) if self.auth_key is None else None
        if why is not None:
            if not self._closed:
                self._noisy.warning("stranger", "refused a transfer connection from %s (says process %d): %s",
                                    peer, src_process, why)
            return None
        if self.auth_key is not None and not self._admit(conn, peer, src_process, deadline):
            return None
        conn.settimeout(None)
        return src_process

    def _not_a_member(self, peer: tuple, src_process: int, dst_process: int, deadline: float) -> str | None:
        """Why a hello from ``peer`` that says it is process ``src_process`` is not believed, or None."""
        with self._topology_known:
            self._topology_known.wait_for(lambda: self._topology is not None or self._closed,
                                          max(0.0, deadline - time.monotonic()))
            topology = self._topology
        if topology is None:
            return f"this endpoint learnt no topology within {self.handshake_timeout:g}s"
        if dst_process != topology.process_id:
            return (f"it is addressed to process {dst_process}, this is process {topology.process_id} of topology "
                    f"generation {topology.generation}")
        try:
            claimed = topology.process(src_process)
        except KeyError:
            return f"topology generation {topology.generation} has no process {src_process}"
        host = split_host_port(claimed.address)[0]
        if not host:
            return f"process {src_process} advertised no transfer endpoint"
        source = ip_of(str(peer[0]))
        if source not in addresses_of(host):
            return (f"it connects from {peer[0]}, but process {src_process} is at {host} in topology generation "
                    f"{topology.generation}")
        return None

    def _admit(self, conn: socket.socket, peer: object, src_process: int, deadline: float) -> bool:
        """Challenges a new connection to prove it holds the cluster's token; refuses (and logs) it if not."""
        challenge = os.urandom(CHALLENGE_BYTES)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            conn.sendall(challenge)
            answer = bytearray(CHALLENGE_BYTES)
            recv_exactly(conn, memoryview(answer), "the answer to the token challenge", deadline)
        except (OSError, TransferError) as e:
            self._noisy.warning("stranger", "refused a transfer connection from %s (says process %d): no answer to "
                                "the token challenge: %s", peer, src_process, e)
            return False
        if not hmac.compare_digest(bytes(answer), token_proof(self.auth_key, challenge)):  # type: ignore[arg-type]
            self._noisy.warning("stranger", "refused a transfer connection from %s (says process %d): it does not "
                                "hold the cluster's token", peer, src_process)
            return False
        return True

class Channels:
    """Send and receive numpy arrays between devices of the topology; close it (or use ``with``) when done."""

    def __init__(self, topology: Topology, endpoint: Endpoint | None = None, connect_timeout: float = 30.0,
                 recv_timeout: float = RECV_TIMEOUT_S) -> None:
        self.topology = topology
        self.endpoint = endpoint or Endpoint.at(topology.process(topology.process_id).address)
        self.endpoint.expect(topology)
        self._connect_timeout = connect_timeout
        self.recv_timeout = wait_seconds(recv_timeout, RECV_TIMEOUT_S)
        """How long ``recv`` waits when called without a timeout."""
        self._out: dict[int, socket.socket] = {}
        self._out_locks: dict[int, threading.Lock] = {}  # process -> held while a frame is numbered and written
        self._seq: dict[tuple[int, int], int] = {}
        self._local: dict[tuple[int, int], queue.Queue] = {}
        self._lock = threading.Lock()

    def send(self, array: np.ndarray, dst_device: int, src_device: int | None = None) -> None:
        """Sends ``array`` from ``src_device`` (default: this process's first device) to ``dst_device``."""
        src = self._local_device(src_device)
        dst = self.topology.device(dst_device)
        array = np.asarray(array, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
        if array.dtype.kind not in ALLOWED_KINDS:
            raise TransferError(f"cannot send dtype {array.dtype}: expected a plain numeric type")
        if dst.process_id == self.topology.process_id:
            self._local_queue(src, dst.id).put(array.copy())
            return
        with self._lock:
            lock = self._out_locks.setdefault(dst.process_id, threading.Lock())
        with lock:  # number and write in one step: a frame numbered later never reaches the wire first
            sock = self._connection(dst.process_id)
            with self._lock:
                seq = self._seq.get((src, dst.id), 0)
                self._seq[(src, dst.id)] = seq + 1
            try:
                sock.sendall(encode_header(ARRAY, seq, src, dst.id, array))
                sock.sendall(memoryview(array.reshape(-1).view(np.uint8)))
            except OSError as e:
                raise TransferError(f"sending to device {dst.id} (process {dst.process_id} at "
                                    f"{self.topology.process(dst.process_id).address}) failed: {e}") from e

    def recv(self, src_device: int, dst_device: int | None = None, timeout: float | None = None) -> np.ndarray:
        """The next array ``src_device`` sent to ``dst_device`` (default: this process's first device).

        Waits at most ``timeout`` seconds (None: ``recv_timeout``, 60 s by default), then raises TransferTimeout
        naming the source device; a wait is never unbounded.
        """
        timeout = wait_seconds(timeout, self.recv_timeout)
        dst = self._local_device(dst_device)
        src = self.topology.device(src_device)
        if src.process_id == self.topology.process_id:
            try:
                return self._local_queue(src.id, dst).get(timeout=timeout)
            except queue.Empty:
                raise TransferTimeout(f"nothing arrived from local device {src.id} within {timeout}s") from None
        return self.endpoint.receive(src.id, dst, src.process_id, timeout)

    def close(self) -> None:
        """Closes the sockets this object opened (the endpoint stays, it belongs to the process)."""
        with self._lock:
            sockets, self._out = list(self._out.values()), {}
        for sock in sockets:
            sock.close()

    def __enter__(self) -> Channels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def open_connections(self) -> int:
        return len(self._out)

    def _local_device(self, device: int | None) -> int:
        local = self.topology.local_devices
        if not local:
            raise TransferError(f"process {self.topology.process_id} has no devices to send from or receive on")
        if device is None:
            return local[0].id
        if self.topology.device(device).process_id != self.topology.process_id:
            raise TransferError(f"device {device} belongs to process {self.topology.device(device).process_id}, "
                                f"not to this process ({self.topology.process_id})")
        return device

    def _local_queue(self, src: int, dst: int) -> queue.Queue:
        with self._lock:
            return self._local.setdefault((src, dst), queue.Queue())

    def _connection(self, process_id: int) -> socket.socket:
        sock = self._out.get(process_id)
        if sock is not None:
            return sock
        address = self.topology.process(process_id).address
        if not address:
            raise TransferError(f"process {process_id} advertised no transfer endpoint")
        own = split_host_port(self.topology.process(self.topology.process_id).address)[0]
        try:  # endpoints listen before their process registers: a refusal means the peer is gone
            sock = connect(address, self._connect_timeout, own if self.endpoint.auth_key is None else None)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot connect to process {process_id} at {address}: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(encode_header(HELLO, 0, self.topology.process_id, process_id))
            if self.endpoint.auth_key is not None:
                challenge = bytearray(CHALLENGE_BYTES)
                recv_exactly(sock, memoryview(challenge), f"process {process_id}'s token challenge")
                sock.sendall(token_proof(self.endpoint.auth_key, bytes(challenge)))
        except (OSError, TransferError) as e:
            sock.close()
            raise TransferError(f"process {process_id} at {address} did not complete the token handshake (does it "
                                f"run with the same cluster token?): {e}") from e
        sock.settimeout(None)
        with self._lock:
            self._out[process_id] = sock
        return sock


def _hang_up(conn: socket.socket) -> None:
    """Ends a connection another thread reads from (that thread closes it: a close alone would not wake it)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def local_address_toward(targets: Sequence[str]) -> str:
    """The IP this host uses to reach the first target (no packet is sent), for advertising an endpoint."""
    host, port = split_host_port(targets[0])
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
