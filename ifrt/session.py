"""The live session of a discovered process: heartbeats out, cluster events in, reconnecting until closed."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc

from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError, ProcessDeclaredFailed, UnknownClient, from_rpc_error
from ifrt.events import (
    CoordinatorLost,
    CoordinatorRestored,
    Event,
    ProcessFailed,
    ProcessLeft,
    ProcessRestarted,
    TopologyChanged,
)
from ifrt.topology import Topology

if TYPE_CHECKING:
    from ifrt.client import Client

log = logging.getLogger("ifrt.client")

FIRST_HEARTBEAT_INTERVAL_S = 0.5
"""Until the coordinator says how often it wants heartbeats."""
GATE_ENV = "IFRT_TEST_SESSION_GATE"
"""For tests: the path of a file; while it does not exist, the session does not open (nor reopen), so a test can make
events happen before a process attaches, without timing."""


class Session:
    """Runs in its own daemon thread; hands every event to ``emit`` and topology changes to the client."""

    def __init__(self, client: Client, emit: Callable[[Event], None]) -> None:
        self._client = client
        self._emit = emit
        self._closed = threading.Event()
        self._interval_s = FIRST_HEARTBEAT_INTERVAL_S
        self._call: grpc.Future | None = None
        self._lost = False
        self.attached = threading.Event()
        """Set while the coordinator has acknowledged this session."""
        self._watch_lock = threading.Lock()
        self._prefixes: set[str] = set()  # key prefixes watched, sent again on every new stream
        self._acks: dict[str, threading.Event] = {}  # prefix -> set once the coordinator watches it for us
        self._outbox: queue.Queue | None = None  # messages for the current stream besides heartbeats
        self.position = client.topology_position
        """The number of the last job event received (at first, that of the held topology's publication)."""
        self._gate = os.environ.get(GATE_ENV, "")
        self._thread = threading.Thread(target=self._run, name="ifrt-session", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Ends the session (without telling peers; the client sends Leave for that)."""
        self._closed.set()
        with self._watch_lock:
            if self._outbox is not None:
                self._outbox.put(None)
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout)

    def watch(self, prefix: str) -> threading.Event:
        """Asks the coordinator for every change of keys under ``prefix`` (on this stream and every later one);
        the event returned is set once the coordinator watches it."""
        with self._watch_lock:
            self._prefixes.add(prefix)
            ack = self._acks.setdefault(prefix, threading.Event())
            if self._outbox is not None:
                self._outbox.put(pb.SessionRequest(watch=pb.WatchKeys(prefix=prefix)))
        return ack

    def _run(self) -> None:
        while not self._closed.is_set():
            while self._gate and not os.path.exists(self._gate) and not self._closed.wait(0.01):
                pass
            target = self._client.current_coordinator()
            stream_done = threading.Event()
            outbox: queue.Queue = queue.Queue()
            try:
                self._call = self._client.stub(target).Session(self._requests(stream_done, outbox))
                for event in self._call:  # type: ignore[attr-defined]
                    self._handle(event, target)
                if not self._closed.is_set():
                    self._lose("the coordinator closed the session")
            except (grpc.RpcError, IfrtError) as e:
                if self._closed.is_set():
                    break
                error = e if isinstance(e, IfrtError) else from_rpc_error(e, target)
                if isinstance(error, UnknownClient):
                    log.warning("coordinator %s does not know this process (restarted?): registering again", target)
                    self._rejoin()
                    continue
                if isinstance(error, ProcessDeclaredFailed):
                    self._emit(ProcessFailed(self._client.process_id, str(error)))
                    break
                self._lose(str(error))
            finally:
                stream_done.set()
                outbox.put(None)  # ends the request stream at once
                self.attached.clear()
            if self._lost:
                self._client.rotate(target)
                self._closed.wait(self._client.backoff.next())

    def _requests(self, stream_done: threading.Event, outbox: queue.Queue) -> Iterator[pb.SessionRequest]:
        generation = self._client.topology.generation if self._client.topology else 0
        with self._watch_lock:  # a watch asked for from now on goes to this outbox; earlier ones are sent below
            self._outbox = outbox
            prefixes = sorted(self._prefixes)
        yield pb.SessionRequest(open=pb.SessionOpen(client_uid=self._client.client_uid, generation=generation,
                                                    since_event=self.position))
        for prefix in prefixes:
            yield pb.SessionRequest(watch=pb.WatchKeys(prefix=prefix))
        while not stream_done.is_set() and not self._closed.is_set():
            try:
                message = outbox.get(timeout=self._interval_s)
            except queue.Empty:
                message = pb.SessionRequest(heartbeat=pb.Heartbeat())
            if message is None or stream_done.is_set() or self._closed.is_set():
                return
            yield message

    def _handle(self, event: pb.SessionEvent, target: str) -> None:
        kind = event.WhichOneof("kind")
        if number := event.event_number:  # a job event: each is handled once, in order
            if number <= self.position:
                return
            self.position = number
        if kind == "attached":
            self.attached.set()
            self._interval_s = event.attached.heartbeat_interval_ms / 1000
            self._client.backoff.reset()
            if self._lost:
                self._lost = False
                log.warning("session with coordinator %s restored", target)
                self._emit(CoordinatorRestored(target))
        elif kind == "process_failed":
            self._emit(ProcessFailed(event.process_failed.process_id, event.process_failed.reason))
        elif kind == "process_restarted":
            self._emit(ProcessRestarted(event.process_restarted.process_id, event.process_restarted.incarnation))
        elif kind == "process_left":
            self._emit(ProcessLeft(event.process_left.process_id))
        elif kind == "topology_changed":
            shared = event.topology_changed
            canonical = wire.decompress(shared.encoding, shared.topology)
            topology = Topology(canonical, self._client.process_id, expected_fingerprint=shared.fingerprint)
            if self._client.adopt(topology):
                self._emit(TopologyChanged(topology))
        elif kind == "shutdown":
            self._lose(event.shutdown.reason)
        elif kind == "key_changed":
            change = event.key_changed
            self._client.key_changed(change.key, None if change.deleted else change.value)
        elif kind == "watching":
            with self._watch_lock:
                ack = self._acks.get(event.watching.prefix)
            if ack is not None:
                ack.set()
        elif kind == "preemption_notice":
            self._client.preemption_noticed(event.preemption_notice.process_id)
        elif kind == "snapshot":
            self._catch_up(event.snapshot)

    def _catch_up(self, snapshot: pb.EventSnapshot) -> None:
        """The coordinator no longer holds the events this session missed: each process's state stands for them."""
        log.warning("the coordinator's event history no longer reaches back to the last event this process "
                    "received: catching up from each process's state as of event %d", self.position)
        missed: list[Event] = [ProcessFailed(e.process_id, e.reason) for e in snapshot.failed]
        missed += [ProcessLeft(e.process_id) for e in snapshot.left]
        missed += [ProcessRestarted(e.process_id, e.incarnation) for e in snapshot.restarted]
        for e in missed:
            self._emit(e)
        if snapshot.HasField("preemption_notice"):
            self._client.preemption_noticed(snapshot.preemption_notice.process_id)

    def _lose(self, reason: str) -> None:
        self.attached.clear()
        if not self._lost:
            self._lost = True
            log.warning("lost the coordinator: %s; reconnecting", reason)
            self._emit(CoordinatorLost(reason))

    def _rejoin(self) -> None:
        try:
            topology = self._client.register_again()
        except Exception as e:  # the loop keeps trying; the reason reaches the watchers
            self._lose(f"registering again failed: {e}")
            return
        self.position = self._client.topology_position  # the new coordinator's numbers
        if self._client.adopt(topology):
            self._emit(TopologyChanged(topology))
