"""The live session of a discovered process: cluster events in, key watches out, reconnecting until closed.

Liveness rides on the session's connection: the coordinator and this process ping each other (gRPC keepalive,
``ClientConfig.channel_options``), and a connection that drops ends the session. The session also sends a small
Heartbeat as often as the coordinator's ``attached`` answer asks (a few times per heartbeat timeout), so that a
process that stops answering (hung, stopped) shows as slow well before its connection is dropped.

A key watch lapses when changes under it may have been missed: the stream ended, or (through an ``ifrt run`` agent)
the agent's own session with the coordinator broke (``watch_lapsed``). Its ``Watch`` is cleared until the prefix is
watched again, and its lapse callbacks are called: a view built on pushes (``ifrt.pushed``) ends and reads instead.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc

from ifrt import wholeness, wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.connection import Connection
from ifrt.errors import IfrtError, ProcessDeclaredFailed, StaleSession, UnknownClient
from ifrt.events import (
    CoordinatorLost,
    CoordinatorRestored,
    Event,
    ProcessFailed,
    ProcessLeft,
    ProcessRestarted,
    TopologyChanged,
)
from ifrt.protocol import NO_HEARTBEATS_MS
from ifrt.settings import session_gate
from ifrt.topology import Topology

log = logging.getLogger("ifrt.client")
HEARTBEAT = pb.SessionRequest(heartbeat=pb.Heartbeat())


class SessionOwner(Protocol):
    """What a session acts for: the process's registration, the topology it holds, where its events go."""

    client_uid: str
    topology: Topology | None
    topology_position: int
    """The number of the job event that published the held topology."""
    topology_run: int
    topology_attempt: int
    """The job run and attempt of the held topology's registration answer (0: not said)."""

    @property
    def process_id(self) -> int: ...

    def adopt(self, topology: Topology) -> bool:
        """Takes ``topology`` if it is another generation than the one held; returns whether it was."""
        ...

    def register_again(self) -> Topology:
        """Re-sends the registration (after the coordinator lost its state); returns the topology."""
        ...

    def key_changed(self, key: str, value: bytes | None) -> None: ...

    def preemption_noticed(self, process_id: int) -> None: ...


class Watch(threading.Event):
    """One watched key prefix of a session: set while the coordinator watches it for this process; each lapse (changes
    may have been missed) clears it and calls every ``on_lapse`` callback, from the session thread."""

    def __init__(self) -> None:
        super().__init__()
        self._lapse_callbacks: list[Callable[[], None]] = []

    def on_lapse(self, callback: Callable[[], None]) -> None:
        self._lapse_callbacks.append(callback)

    def lapse(self) -> None:
        if not self.is_set():  # not watched yet: nothing pushed to miss
            return
        self.clear()
        for callback in list(self._lapse_callbacks):
            try:
                callback()
            except Exception:
                log.exception("a watch's lapse callback %r failed", callback)


class Session:
    """Runs in its own daemon thread; hands every event to ``emit`` and topology changes to its owner."""

    def __init__(self, owner: SessionOwner, connection: Connection, emit: Callable[[Event], None]) -> None:
        self._owner = owner
        self._connection = connection
        self._emit = wholeness.assembling(emit, lambda: owner.topology)  # JobWhole after a replacement
        self._closed = threading.Event()
        self._call: grpc.Future | None = None
        self._lost = False
        self.attached = threading.Event()
        """Set while the coordinator has acknowledged this session."""
        self._watch_lock = threading.Lock()
        self._prefixes: set[str] = set()  # key prefixes watched, sent again on every new stream
        self._acks: dict[str, Watch] = {}  # prefix -> set while the coordinator watches it for us
        self._outbox: queue.Queue | None = None  # messages for the current stream (key watches)
        self._heartbeat_s: float | None = None  # how often the coordinator asks for a Heartbeat (None: never)
        self.heartbeat_timeout_s: float | None = None
        """The coordinator's heartbeat timeout, as its last ``attached`` answer said (None before one)."""
        self.position = owner.topology_position
        """The number of the last job event received (at first, that of the held topology's publication)."""
        self._gate = session_gate()
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

    def watch(self, prefix: str) -> Watch:
        """Asks the coordinator for every change of keys under ``prefix`` (on this stream and every later one);
        the Watch returned is set once the coordinator watches it, and cleared while it lapsed."""
        with self._watch_lock:
            self._prefixes.add(prefix)
            ack = self._acks.setdefault(prefix, Watch())
            if self._outbox is not None:
                self._outbox.put(pb.SessionRequest(watch=pb.WatchKeys(prefix=prefix)))
        return ack

    def _run(self) -> None:
        while not self._closed.is_set():
            while self._gate and not os.path.exists(self._gate) and not self._closed.wait(0.01):
                pass
            target = self._connection.current()
            stream_done = threading.Event()
            outbox: queue.Queue = queue.Queue()
            try:
                self._call = self._connection.stub(target).Session(self._requests(stream_done, outbox))
                for event in self._call:  # type: ignore[attr-defined]
                    self._handle(event, target)
                if not self._closed.is_set():
                    self._lose("the coordinator closed the session")
            except (grpc.RpcError, IfrtError) as e:
                if self._closed.is_set():
                    break
                error = e if isinstance(e, IfrtError) else self._connection.error_of(e, target)
                if isinstance(error, UnknownClient | StaleSession):
                    self._lapse()
                    if isinstance(error, StaleSession):
                        log.info("this process's registration belongs to an ended run or attempt of the job (%s): "
                                 "registering again", error)
                    else:
                        log.warning("coordinator %s does not know this process (restarted?): registering again",
                                    target)
                    self._rejoin()
                    continue
                if isinstance(error, ProcessDeclaredFailed):
                    self._emit(ProcessFailed(self._owner.process_id, str(error)))
                    break
                self._lose(str(error))
            finally:
                stream_done.set()
                outbox.put(None)  # ends the request stream at once
                self.attached.clear()
                self._lapse()
            if self._lost:
                self._connection.rotate(target)
                self._closed.wait(self._connection.backoff.next())

    def _requests(self, stream_done: threading.Event, outbox: queue.Queue) -> Iterator[pb.SessionRequest]:
        generation = self._owner.topology.generation if self._owner.topology else 0
        with self._watch_lock:  # a watch asked for from now on goes to this outbox; earlier ones are sent below
            self._outbox = outbox
            prefixes = sorted(self._prefixes)
        yield pb.SessionRequest(open=pb.SessionOpen(client_uid=self._owner.client_uid, generation=generation,
                                                    since_event=self.position, run=self._owner.topology_run,
                                                    attempt=self._owner.topology_attempt))
        for prefix in prefixes:
            yield pb.SessionRequest(watch=pb.WatchKeys(prefix=prefix))
        while not stream_done.is_set() and not self._closed.is_set():
            try:  # None: the stream ended or the session closes
                message = outbox.get(timeout=self._heartbeat_s)
            except queue.Empty:
                message = HEARTBEAT
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
            interval_ms = event.attached.heartbeat_interval_ms
            self._heartbeat_s = interval_ms / 1000 if 0 < interval_ms < NO_HEARTBEATS_MS else None
            self.heartbeat_timeout_s = event.attached.heartbeat_timeout_ms / 1000 or None
            with self._watch_lock:  # the request stream waits without a timeout until now: wake it
                if self._outbox is not None and self._heartbeat_s is not None:
                    self._outbox.put(HEARTBEAT)
            self.attached.set()
            self._connection.answered(target)
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
            topology = Topology(canonical, self._owner.process_id, expected_fingerprint=shared.fingerprint)
            if self._owner.adopt(topology):
                self._emit(TopologyChanged(topology))
        elif kind == "shutdown":
            shutdown = event.shutdown
            self._lose(shutdown.reason, (shutdown.ended_attempt, shutdown.next_attempt) if shutdown.next_attempt
                       else None)
        elif kind == "key_changed":
            change = event.key_changed
            self._owner.key_changed(change.key, None if change.deleted else change.value)
        elif kind == "watching":
            with self._watch_lock:
                ack = self._acks.get(event.watching.prefix)
            if ack is not None:
                ack.set()
        elif kind == "watch_lapsed":  # from this process's agent: its own session with the coordinator broke
            with self._watch_lock:
                ack = self._acks.get(event.watch_lapsed.prefix)
            if ack is not None:
                ack.lapse()
        elif kind == "preemption_notice":
            self._owner.preemption_noticed(event.preemption_notice.process_id)
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
            self._owner.preemption_noticed(snapshot.preemption_notice.process_id)

    def _lapse(self) -> None:
        """Every watch lapses: the stream that carried its changes ended."""
        with self._watch_lock:
            watches = list(self._acks.values())
        for watch in watches:
            watch.lapse()

    def _lose(self, reason: str, attempts: tuple[int, int] | None = None) -> None:
        """The coordinator is lost (``attempts``: the job's attempt ended and the next starts, as its Shutdown
        said)."""
        self.attached.clear()
        if not self._lost:
            self._lost = True
            self._lapse()  # before anyone hears of the loss: a view that hears it answers nothing more
            if attempts is not None:  # not a lost coordinator: ifrt run restarts us
                log.info("attempt %d of the job ended and attempt %d starts: this process's agent (ifrt run) "
                         "stops it and starts it again", *attempts)
            else:
                log.warning("lost the coordinator: %s; reconnecting", reason)
            self._emit(CoordinatorLost(reason))

    def _rejoin(self) -> None:
        try:
            topology = self._owner.register_again()
        except Exception as e:  # the loop keeps trying; the reason reaches the watchers
            self._lose(f"registering again failed: {e}")
            return
        self.position = self._owner.topology_position  # the new coordinator's numbers
        if self._owner.adopt(topology):
            self._emit(TopologyChanged(topology))
