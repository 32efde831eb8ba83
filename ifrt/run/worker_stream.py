"""One worker's session with its agent, as the agent's local server writes it: event bytes in order, then maybe its
end (with the error the worker's own session with the coordinator would have ended with)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc

from ifrt.errors import IfrtError, ResourceExhausted

WORKER_BACKLOG_BYTES = 16 << 20
"""What one worker's session may leave unread before the agent ends it (it attaches again and catches up)."""


class Ended(Exception):
    """How a worker's session with the agent ends: with ``error`` (None: without one, as the coordinator's ending
    of a session after its ``shutdown``)."""

    def __init__(self, error: IfrtError | None, code: grpc.StatusCode = grpc.StatusCode.OK) -> None:
        super().__init__(str(error) if error is not None else "")
        self.error, self.code = error, (error.code if error is not None and code is grpc.StatusCode.OK else code)


class WorkerStream:
    """One worker's session with the agent: what goes out to it, in order (event bytes, then maybe its end)."""

    def __init__(self, uid: str, proof: str, since: int) -> None:
        self.uid, self.proof, self.since = uid, proof, since
        self.live = False
        """The coordinator attached it: job events flow to it."""
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, raw: bytes) -> None:
        with self._lock:
            self._bytes += len(raw)
            over = self._bytes > WORKER_BACKLOG_BYTES
        if over:
            self.end(Ended(ResourceExhausted(f"this worker left more than {WORKER_BACKLOG_BYTES} bytes of events "
                                             "unread on its session with its agent; attach again")))
        else:
            self.out.put(raw)

    def taken(self, raw: bytes) -> None:
        with self._lock:
            self._bytes -= len(raw)

    def end(self, ended: Ended) -> None:
        self.out.put(ended)

    def items(self) -> Iterator[bytes]:
        """What to write to the worker; raises ``Ended`` with an error for an end that has one."""
        while True:
            item = self.out.get()
            if isinstance(item, Ended):
                if item.error is not None:
                    raise item
                return
            self.taken(item)
            yield item
