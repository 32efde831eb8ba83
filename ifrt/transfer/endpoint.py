"""This process's transfer endpoint: its listener, each connection's handshake and frames checked, the arrays
received held for their receives (see the package's docstring for the whole)."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import numbers
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ifrt.errors import InvalidArgument, OldIncarnation, TransferError
from ifrt.events import JobWhole, ProcessFailed, ProcessRestarted
from ifrt.hostport import check_address, check_host, join_host_port, split_host_port
from ifrt.ids import LOCAL_ID_BITS
from ifrt.ratelimit import Throttled
from ifrt.settings import TRANSFER_FDS_ENV
from ifrt.transfer.arrivals import MAX_HELD_BYTES, Arrivals
from ifrt.transfer.frames import HEADER, read_header, read_payload
from ifrt.transfer.handshake import Admitted, Doorman
from ifrt.transfer_keys import TransferKeys

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



@dataclass(frozen=True)
class Fenced:
    """What an endpoint refused of old incarnations (processes replaced or declared failed) since it was bound."""

    connections: int = 0
    """Admitted connections it closed once it learnt that their incarnation was replaced or had failed."""
    handshakes: int = 0
    """Handshakes it refused that proved an old incarnation's pair key."""
    frames: int = 0
    """Frames it refused from an old incarnation (read before its connection's close took effect)."""


def wait_seconds(timeout: float | None, default: float) -> float:
    """The seconds a receive waits: ``default`` for None; InvalidArgument for a negative or unbounded value."""
    given = default if timeout is None else timeout
    if not (isinstance(given, numbers.Real) and math.isfinite(given) and given >= 0):
        raise InvalidArgument(f"receive timeout {given!r} is not a finite number of seconds: expected "
                              "0 <= timeout < inf (None waits the default)")
    return float(given)


class Endpoint:
    """This process's transfer listener; incoming arrays wait per (source, destination) device
    (``ifrt.transfer.arrivals``)."""

    _bound: ClassVar[dict[str, Endpoint]] = {}  # address -> endpoint, so Channels(topology) finds its own
    _bound_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, bind: str = "127.0.0.1:0", advertise_host: str | None = None,
                 token: str | None = None, handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 keys: TransferKeys | None = None, max_held_bytes: int = MAX_HELD_BYTES) -> None:
        """With ``keys`` (a ``Client``'s), a connecting peer proves which process it is with its pair key before any
        frame, and this process proves itself so to the peers it connects to. Without keys, with ``token`` (the
        cluster's) a peer must prove it holds the same token; without either, it must connect from the address of the
        process it says it is (see ``expect``). ``max_held_bytes`` bounds what is held for receives not made yet."""
        check_address(bind, "the transfer endpoint's bind address", bind=True)
        if advertise_host is not None:
            check_host(advertise_host, "the transfer endpoint's advertised host")
        self.auth_key = token.encode() if token else None
        self.keys = keys
        self.handshake_timeout = handshake_timeout
        host, port = split_host_port(bind)
        with Endpoint._bound_lock:
            adopted = None if bind in Endpoint._bound else adopted_listener(bind, int(port))
        self._adopted = adopted is not None
        """Whether the listener is a socket ``ifrt run``'s agent handed this process (it keeps it listening)."""
        try:
            self._listener = adopted or socket.create_server((host, int(port)), backlog=128)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot bind the transfer endpoint to {bind!r}: {e}") from e
        self.address = join_host_port(advertise_host or host, self._listener.getsockname()[1])
        self._arrivals = Arrivals(max_held_bytes)
        self._lock = threading.Lock()
        self._topology_known = threading.Condition(self._lock)
        self._topology: Topology | None = None
        self._local: frozenset[int] = frozenset()  # this process's device ids in that topology
        self._peers: dict[socket.socket, Admitted] = {}  # admitted connections; each leaves when it closes
        self._floor: dict[int, int] = {}  # process -> the oldest incarnation accepted from it (absent: any)
        self._heard: dict[int, int] = {}  # process -> its incarnation as the job's events told it (absent: 0)
        self._fences: dict[int, int] = {}  # process -> how often its floor rose (a sender's connection is older)
        self._fenced = Fenced()
        self.declared_failed: str | None = None
        """Why the coordinator declared this process failed, once it was told (then it sends no more frames)."""
        self._handshaking: dict[socket.socket, None] = {}  # connections in their handshake, oldest first
        self._max_handshakes = MAX_HANDSHAKES
        self._noisy = Throttled(log)
        self._doorman = Doorman(auth_key=self.auth_key, keys=keys, timeout=handshake_timeout, noisy=self._noisy,
                                topology=self._wait_topology, hung_up=self._hung_up, fenced=self._old)
        self._closed = False
        threading.Thread(target=self._accept, name=f"ifrt-transfer-accept-{self.address}", daemon=True).start()
        with Endpoint._bound_lock:
            Endpoint._bound[self.address] = self

    @property
    def max_held_bytes(self) -> int:
        """The most this endpoint holds in frames no receive has taken yet, over all pairs
        (``ifrt.transfer.arrivals``)."""
        return self._arrivals.max_bytes

    @max_held_bytes.setter
    def max_held_bytes(self, value: int) -> None:
        self._arrivals.max_bytes = value

    @property
    def held_bytes(self) -> int:
        """What it holds now for receives not made yet (with each frame's overhead)."""
        return self._arrivals.held_bytes

    def expect(self, topology: Topology) -> None:
        """Takes ``topology`` as the one whose processes may connect (a newer generation replaces it)."""
        with self._topology_known:
            if self._topology is not None and topology.generation < self._topology.generation:
                return
            first, self._topology = self._topology is None, topology
            self._local = frozenset(d.id for d in topology.local_devices)
            self._topology_known.notify_all()
            members = {p.process_id for p in topology.processes}
            gone = [conn for conn, a in self._peers.items() if a.process not in members]
        for conn in gone:  # a process the new generation dropped sends nothing more
            _hang_up(conn)
        # Said once the endpoint serves a job, not by a discovery that failed; INFO: the coordinator, which has no
        # token either (else this process could not have registered), warns the operator once for the whole job.
        if first and self.auth_key is None and self.keys is None:
            log.info("transfers to %s are unauthenticated (no cluster token): any process that can reach this "
                        "port from a member's address can send to this process; set IFRT_TOKEN (the coordinator's "
                        "--token-file) to require the token", self.address)

    @property
    def topology(self) -> Topology | None:
        """The newest topology this endpoint serves (None before the first)."""
        with self._lock:
            return self._topology

    def heard(self, event: object) -> None:
        """Fences what a job event says is gone (a ``Client`` hands it every event): a process restarted or replaced
        (its older incarnations), a process declared failed (the incarnation the events last named, so a replacement
        that proved itself first is kept); this process itself declared failed: it sends no more frames."""
        if isinstance(event, JobWhole):
            for restarted in event.replaced:
                self.heard(restarted)
        elif isinstance(event, ProcessRestarted):
            with self._lock:
                self._heard[event.process_id] = max(self._heard.get(event.process_id, 0), event.incarnation)
            self.fence(event.process_id, event.incarnation, f"it was replaced by its incarnation {event.incarnation}")
        elif isinstance(event, ProcessFailed):
            with self._lock:
                own = self._topology is not None and event.process_id == self._topology.process_id
                failed = self._heard.get(event.process_id, 0)
                if own:
                    self.declared_failed = event.reason or "declared failed"
            if not own:
                self.fence(event.process_id, failed + 1, f"its incarnation {failed} was declared failed")

    def fence(self, process: int, incarnation: int, why: str) -> None:
        """Accepts nothing more from incarnations of ``process`` older than ``incarnation``: their connections are
        closed now (counted in ``fenced``, logged), their handshakes and frames refused from now on."""
        with self._lock:
            if incarnation <= self._floor.get(process, 0):
                return
            self._floor[process] = incarnation
            self._fences[process] = self._fences.get(process, 0) + 1
            old = [conn for conn, a in self._peers.items()
                   if a.process == process and a.incarnation is not None and a.incarnation < incarnation]
            self._fenced = replace(self._fenced, connections=self._fenced.connections + len(old))
        for conn in old:
            _hang_up(conn)
        if old:
            self._noisy.warning("old incarnation", "closed %d transfer connection(s) from an old incarnation of "
                                "process %d (older than %d): %s", len(old), process, incarnation, why)

    @property
    def fenced(self) -> Fenced:
        """What this endpoint refused of old incarnations so far."""
        with self._lock:
            return self._fenced

    def fences_of(self, process: int) -> int:
        """How often the oldest incarnation accepted from ``process`` rose: a connection to it made before is
        older than the process it reaches (``Channels`` drops it)."""
        return self._fences.get(process, 0)

    def _old(self, process: int, incarnation: int) -> str | None:
        """Why a hello proving ``incarnation`` of ``process`` is refused (an older one than accepted), or None (a
        later one than known raises the floor: the coordinator hands its key only to an id's current incarnation)."""
        floor = self._floor.get(process, 0)
        if incarnation < floor:
            with self._lock:
                self._fenced = replace(self._fenced, handshakes=self._fenced.handshakes + 1)
            return (f"process {process} is at incarnation {floor} or later here (it was replaced or declared "
                    "failed)")
        if incarnation > floor:
            self.fence(process, incarnation, f"its incarnation {incarnation} proved itself")
        return None

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
        """The next array sent from device ``src`` to device ``dst``; TransferTimeout after ``timeout`` seconds, and
        at once the failure of ``src_process``'s latest connection while nothing is queued for the pair."""
        return self._arrivals.take(src, dst, src_process, wait_seconds(timeout, RECV_TIMEOUT_S))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            peers, self._peers = [*self._peers, *self._handshaking], {}
            self._handshaking = {}
            self._topology_known.notify_all()  # a handshake waiting for the topology ends now
        self._noisy.flush()
        with Endpoint._bound_lock:
            Endpoint._bound.pop(self.address, None)
        with contextlib.suppress(OSError):  # wakes the accepting thread; close alone leaves the port accepting once
            if self._adopted:  # shared with the agent, which keeps it for the next worker: woken by a connection
                host, port = self._listener.getsockname()[:2]
                here = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard bind: its loopback
                socket.create_connection((here, port), timeout=1).close()
            else:
                self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for peer in peers:
            with contextlib.suppress(OSError):  # wakes its reading thread, which closes it
                peer.shutdown(socket.SHUT_RDWR)

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
        admitted = None
        try:
            admitted = self._doorman.admit(conn, peer)
            with self._lock:
                if admitted is None or conn not in self._handshaking:  # refused, or closed meanwhile as the oldest
                    return
                del self._handshaking[conn]
                if admitted.incarnation is not None and admitted.incarnation < self._floor.get(admitted.process, 0):
                    self._fenced = replace(self._fenced, connections=self._fenced.connections + 1)
                    return  # fenced while its handshake ended
                self._peers[conn] = admitted
            if admitted.carries_frames:
                self._arrivals.admitted(admitted.process, conn, lambda: _hang_up(conn))
            self._read(conn, admitted)
        except Exception as e:  # nothing a peer sends may end this thread unrecorded
            if not self._closed:
                self._failed(conn, peer, admitted, e)
        finally:
            if admitted is not None:
                self._arrivals.closed(admitted.process, conn)
            with self._lock:
                self._handshaking.pop(conn, None)
                self._peers.pop(conn, None)
            conn.close()

    def _read(self, conn: socket.socket, admitted: Admitted) -> None:
        """Frames from an admitted connection until it closes cleanly; TransferError at the first bad one."""
        process, incarnation, expected = admitted.process, admitted.incarnation, {}
        floors = self._floor
        while True:
            if not conn.recv(HEADER.size, socket.MSG_PEEK):
                return  # a clean close between frames
            header = read_header(conn, hello=False)
            if incarnation is not None and incarnation < floors.get(process, 0):
                with self._lock:
                    self._fenced = replace(self._fenced, frames=self._fenced.frames + 1)
                raise OldIncarnation(f"frame {header.seq} from an old incarnation of process {process} (incarnation "
                                     f"{incarnation}; it was replaced or declared failed): refused, connection closed")
            if not admitted.carries_frames:
                raise TransferError(f"a frame on a connection that did not prove process {process}'s transfer key "
                                    "(a token or address hello, as a pre-flight probe sends): closed")
            src, dst, seq = header.src, header.dst, header.seq
            if src >> LOCAL_ID_BITS != process:
                raise TransferError(f"frame {seq} says it comes from device {src}, which is not a device of process "
                                    f"{process}, the process this connection proved")
            if dst not in self._local:
                raise TransferError(f"frame {seq} from device {src} is for device {dst}, which is not a device of "
                                    "this process")
            want = expected.get((src, dst), 0)
            if seq != want:
                raise TransferError(f"frame {seq} from device {src} to device {dst}: expected frame {want} "
                                    "(a frame was lost, repeated or reordered)")
            self._arrivals.reserve(process, conn, src, dst, seq, header.nbytes)
            try:
                array = read_payload(conn, header)
            except BaseException:
                self._arrivals.release(process, header.nbytes)
                raise
            expected[(src, dst)] = seq + 1
            self._arrivals.put(process, src, dst, array)

    def _failed(self, conn: socket.socket, peer: tuple, admitted: Admitted | None, e: Exception) -> None:
        """Records (for its process's receives) and logs, rate-limited, why a connection ended badly."""
        if isinstance(e, TransferError):
            why = str(e)
        elif isinstance(e, OSError):
            why = f"connection error: {e}"
        else:  # a bug, not the peer's doing: said as such, still confined to this connection
            why = f"unexpected {type(e).__name__} reading its frames: {e}"
        if admitted is None:
            if not self._hung_up(conn):  # closed as the oldest in its handshake: logged then
                self._noisy.warning("handshake", "closed a transfer connection from %s in its handshake: %s", peer,
                                    why)
            return
        if isinstance(e, OldIncarnation):  # not its process's failure: the current incarnation may be sending
            self._noisy.warning("old incarnation", "closed a transfer connection from %s: %s", peer, e)
            return
        prefix = f"transfer from process {admitted.process} failed: "
        error = e if isinstance(e, TransferError) and why.startswith(prefix) else TransferError(prefix + why)
        if admitted.carries_frames:
            self._arrivals.fail(admitted.process, conn, error)
        self._noisy.warning("failed", "closed a transfer connection from %s (process %d%s): %s", peer,
                            admitted.process, "" if admitted.proven else ", not proven by its key", error)

    def _wait_topology(self, deadline: float) -> Topology | None:
        """The topology this endpoint serves, waiting until ``deadline`` (monotonic) for one; None if none came."""
        with self._topology_known:
            self._topology_known.wait_for(lambda: self._topology is not None or self._closed,
                                          max(0.0, deadline - time.monotonic()))
            return self._topology

    def _hung_up(self, conn: socket.socket) -> bool:
        """Whether this endpoint closed ``conn`` during its handshake (as the oldest, or closing itself)."""
        with self._lock:
            return self._closed or conn not in self._handshaking


def adopted_listener(bind: str, port: int, environ: Mapping[str, str] | None = None) -> socket.socket | None:
    """A duplicate of the listening socket ``ifrt run`` handed this process for ``bind`` (``IFRT_TRANSFER_FDS``:
    ``address=descriptor,...``), or None when it handed none; InvalidArgument for a malformed value. A descriptor that
    is not (or no longer: a launcher in between closed it) a listening TCP socket on ``port`` is skipped, logged."""
    value = (os.environ if environ is None else environ).get(TRANSFER_FDS_ENV, "").strip()
    if not value:
        return None
    handed: dict[str, int] = {}
    for entry in value.split(","):
        address, sep, fd = entry.strip().rpartition("=")
        if not sep or not address or not fd.isdigit():
            raise InvalidArgument(f"{TRANSFER_FDS_ENV}={value!r}: entry {entry!r} is not address=descriptor "
                                  "(expected e.g. '127.0.0.1:34911=5', as `ifrt run` sets it)")
        handed[address] = int(fd)
    if bind not in handed:
        return None
    fd = None
    try:
        fd = os.dup(handed[bind])
        sock = socket.socket(fileno=fd)
    except OSError as e:
        if fd is not None:
            os.close(fd)
        log.warning("%s names descriptor %d for %s, which is not an open socket here (%s): binding %s instead",
                    TRANSFER_FDS_ENV, handed[bind], bind, e, bind)
        return None
    listening = (sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                 and sock.getsockname()[1] == port)
    if not listening:
        sock.close()
        log.warning("%s names descriptor %d for %s, which is not a socket listening on port %d: binding %s instead",
                    TRANSFER_FDS_ENV, handed[bind], bind, port, bind)
        return None
    sock.setblocking(True)
    return sock


def _hang_up(conn: socket.socket) -> None:
    """Ends a connection another thread reads from (that thread closes it: a close alone would not wake it)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
