"""Channels: numpy arrays sent and received between devices of the topology, over this process's endpoint."""

from __future__ import annotations

import logging
import queue
import socket
import threading
from typing import TYPE_CHECKING

import numpy as np

from ifrt.errors import IfrtError, TransferError, TransferTimeout
from ifrt.hostport import split_host_port
from ifrt.ids import LOCAL_ID_BITS
from ifrt.transfer.frames import ALLOWED_KINDS, ARRAY, connect, encode_header
from ifrt.transfer.handshake import introduce
from ifrt.transfer_keys import PairKey, TransferKeys

if TYPE_CHECKING:
    from ifrt.topology import Topology

from ifrt.transfer.endpoint import RECV_TIMEOUT_S, Endpoint, wait_seconds

log = logging.getLogger("ifrt.transfer")


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
        self._out_fences: dict[int, int] = {}  # process -> the endpoint's fences_of(process) when connected
        self._out_locks: dict[int, threading.Lock] = {}  # process -> held while a frame is numbered and written
        self._seq: dict[tuple[int, int], int] = {}
        self._local: dict[tuple[int, int], queue.Queue] = {}
        self._lock = threading.Lock()

    def send(self, array: np.ndarray, dst_device: int, src_device: int | None = None) -> None:
        """Sends ``array`` from ``src_device`` (default: this process's first device) to ``dst_device``. A send that
        fails forgets its connection (the peer closed it): the next one to that process opens a new one."""
        src = self._local_device(src_device)
        dst = self.topology.device(dst_device)
        array = np.asarray(array, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
        if array.dtype.kind not in ALLOWED_KINDS:
            raise TransferError(f"cannot send dtype {array.dtype}: expected a plain numeric type")
        if dst.process_id == self.topology.process_id:
            self._local_queue(src, dst.id).put(array.copy())
            return
        if (why := self.endpoint.declared_failed) is not None:
            raise TransferError(f"not sending to device {dst.id}: the coordinator declared this process (process "
                                f"{self.topology.process_id}) failed, so its peers refuse its frames ({why}); restart "
                                "it")
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
                self._drop(dst.process_id)
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
        fences = self.endpoint.fences_of(process_id)
        if sock is not None:
            if self._out_fences.get(process_id) == fences:
                return sock
            self._drop(process_id)  # made to an incarnation that was replaced or declared failed since
            if self.endpoint.keys is not None:
                self.endpoint.keys.forget(process_id)
        newest = self.endpoint.topology
        topology = newest if newest is not None and newest.generation > self.topology.generation else self.topology
        address = topology.process(process_id).address
        if not address:
            raise TransferError(f"process {process_id} advertised no transfer endpoint")
        keys, token = self.endpoint.keys, self.endpoint.auth_key
        own = split_host_port(self.topology.process(self.topology.process_id).address)[0]
        for attempt in (1, 2):  # a refused key is fetched again once: the peer may have restarted with a new secret
            key = None if keys is None else self._key(keys, process_id)
            try:  # endpoints listen before their process registers: a refusal means the peer is gone
                sock = connect(address, self._connect_timeout, own if keys is None and token is None else None)
            except (OSError, ValueError) as e:
                raise TransferError(f"cannot connect to process {process_id} at {address}: {e}") from e
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                admitted = introduce(sock, self.topology.process_id, process_id, key=key, token=token,
                                     what=f"process {process_id} at {address}")
            except (OSError, TransferError) as e:
                sock.close()
                how = "its pair-key" if key is not None else "the token"
                raise TransferError(f"process {process_id} at {address} did not complete {how} handshake (does it run "
                                    f"in this job, with the same cluster token?): {e}") from e
            if admitted:
                break
            sock.close()
            assert keys is not None
            keys.forget(process_id)
            if attempt == 2:
                raise TransferError(f"process {process_id} at {address} refused this process's transfer key twice, "
                                    "the second one fresh from the coordinator: is it the process the topology names?")
        sock.settimeout(None)
        with self._lock:
            self._out[process_id] = sock
            self._out_fences[process_id] = fences
        return sock

    def _key(self, keys: TransferKeys, process_id: int) -> PairKey:
        """K(this process -> ``process_id``), from the cache or the coordinator."""
        try:
            return keys.outgoing(process_id)
        except IfrtError as e:
            raise TransferError(f"cannot get this process's transfer key toward process {process_id} from the "
                                f"coordinator: {e}") from e

    def _drop(self, process_id: int) -> None:
        """Forgets a connection that failed: the next send opens another, numbering its frames from 0 again."""
        with self._lock:
            sock = self._out.pop(process_id, None)
            for pair in [pair for pair in self._seq if pair[1] >> LOCAL_ID_BITS == process_id]:
                del self._seq[pair]
        if sock is not None:
            sock.close()
