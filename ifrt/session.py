"""The live session of a discovered process: cluster events in, key watches out, reconnecting until closed.

Liveness rides on the session's connection: the coordinator and this process ping each other (gRPC keepalive,
``ClientConfig.channel_options``), and a connection that drops ends the session. The session also sends a small
Heartbeat as often as the coordinator's ``attached`` answer asks (a few times per heartbeat timeout), so that a
process that stops answering (hung, stopped) shows as slow well before its connection is dropped.

After a lost stream the session re-attaches to whichever replica leads, and every wait on the way is bounded: a
stream that a replica neither answers nor refuses (hung, cut off, its host gone without a word) is given up after
``attach_bound`` (half the coordinator's heartbeat timeout, 1 to 10 s) and the next replica is tried, so one silent
replica costs a process at most that much of the grace a new leader gives it to re-attach. Nothing ends the loop but
``close()`` or the coordinator's word that this process was declared failed: an unexpected error is said and the
stream opened again. What the session prints while it is lost goes through ``ifrt.waiting`` (the ``ifrt:`` prefix
without logging set up), each line naming the bound it counts against: the failover window (``IFRT_FAILOVER_WINDOW``),
the attach bound, or the discovery timeout of a re-registration.

A key watch lapses when changes under it may have been missed: the stream ended, or (through an ``ifrt run`` agent)
the agent's own session with the coordinator broke (``watch_lapsed``). Its ``Watch`` is cleared until the prefix is
watched again, and its lapse callbacks are called: a view built on pushes (``ifrt.pushed``) ends and reads instead.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple, Protocol

import grpc

from ifrt import waiting, wholeness, wire
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
from ifrt.waiting import Pacer

log = logging.getLogger("ifrt.client")
HEARTBEAT = pb.SessionRequest(heartbeat=pb.Heartbeat())
ATTACH_BOUND_S = (1.0, 10.0)
"""The least and the most one session stream may wait for the coordinator's ``attached`` answer (``attach_bound``)."""


def attach_bound(heartbeat_timeout_s: float | None) -> float:
    """How long one session stream to a replica may go without the coordinator's ``attached`` answer before the session
    gives it up and tries the next replica: half the coordinator's heartbeat timeout (as its last Attached said), within
    ``ATTACH_BOUND_S``; the most before any answer. A serving replica answers at once; one that neither answers nor
    refuses (hung, cut off) would otherwise hold the session until the connection's keepalive gives up on it."""
    least, most = ATTACH_BOUND_S
    return most if heartbeat_timeout_s is None else min(most, max(least, heartbeat_timeout_s / 2))


class JobMoved(NamedTuple):
    """What a Shutdown says when the job's attempt or run ended: not a lost coordinator."""

    what: Literal["attempt", "run"]
    ended: int
    next: int


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

    def __init__(self, owner: SessionOwner, connection: Connection, emit: Callable[[Event], None], *,
                 bound_attach: bool = True) -> None:
        """``bound_attach``: give up a stream not answered within ``attach_bound`` (a direct link to the coordinator;
        not through an ``ifrt run`` agent, which holds a worker's stream open while its own reconnects)."""
        self._owner = owner
        self._connection = connection
        self._bound_attach = bound_attach
        self._emit = wholeness.assembling(emit, lambda: owner.topology)  # JobWhole after a replacement
        self._closed = threading.Event()
        self._call: grpc.Future | None = None
        self._lost = False
        self._lost_since: float | None = None  # when the session was lost (monotonic), until it is attached again
        self._lost_reason = ""  # the latest reason a stream ended or was refused while lost
        self._said: Pacer | None = None  # when the next line about a lasting loss is due
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
            unanswered = threading.Event()  # set when the attach bound gave this stream up
            outbox: queue.Queue = queue.Queue()
            timer: threading.Timer | None = None
            try:
                call = self._call = self._connection.stub(target).Session(self._requests(stream_done, outbox))
                if self._bound_attach:
                    bound = attach_bound(self.heartbeat_timeout_s)
                    timer = threading.Timer(bound, self._give_up_unanswered, (call, stream_done, unanswered))
                    timer.daemon = True
                    timer.start()
                for event in call:  # type: ignore[attr-defined]
                    self._handle(event, target)
                if not self._closed.is_set():
                    self._lose("the coordinator closed the session")
            except (grpc.RpcError, IfrtError) as e:
                if self._closed.is_set():
                    break
                error = e if isinstance(e, IfrtError) else self._connection.error_of(e, target)
                if unanswered.is_set():
                    reason = (f"coordinator {target} did not answer the session within {bound:g} s (the attach bound: "
                              f"half the coordinator's heartbeat timeout, {ATTACH_BOUND_S[0]:g} to "
                              f"{ATTACH_BOUND_S[1]:g} s)")
                    if self._lost:  # else the loss itself says it
                        waiting.say(logging.INFO, "%s: trying the next replica", reason)
                    self._lose(reason)
                elif isinstance(error, UnknownClient | StaleSession):
                    self._lapse()
                    within = f" (within the discovery timeout, {self._connection.settings.timeout:g} s)"
                    if isinstance(error, StaleSession):
                        log.info("this process's registration belongs to an ended run or attempt of the job (%s): "
                                 "registering again%s", error, within)
                    else:
                        waiting.say(logging.WARNING, "coordinator %s does not know this process (restarted?): "
                                    "registering again%s", target, within)
                    self._rejoin()
                    continue
                elif isinstance(error, ProcessDeclaredFailed):
                    self._emit(ProcessFailed(self._owner.process_id, str(error)))
                    break
                else:
                    self._lose(str(error))
            except Exception as e:  # never the end of the session: said, and the stream opened again
                if self._closed.is_set():
                    break
                if not self._lost:  # the traceback once per loss; the line below says it each time it is due
                    log.exception("the session with coordinator %s failed unexpectedly", target)
                self._lose(f"the session with coordinator {target} failed unexpectedly: {type(e).__name__}: {e}")
            finally:
                if timer is not None:
                    timer.cancel()
                stream_done.set()
                outbox.put(None)  # ends the request stream at once
                self.attached.clear()
                self._lapse()
            if self._lost and not self._closed.is_set():
                self._connection.rotate(target)
                self._say_still_lost()
                self._closed.wait(self._connection.backoff.next())

    def _give_up_unanswered(self, call: grpc.Future, stream_done: threading.Event, unanswered: threading.Event) -> None:
        """The attach bound passed: a stream still without the coordinator's answer is cancelled, and the loop moves on
        to the next replica."""
        if not stream_done.is_set() and not self.attached.is_set() and not self._closed.is_set():
            unanswered.set()
            call.cancel()

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
                if self._lost_since is not None:  # not after an ended attempt: that said so itself
                    waited = time.monotonic() - self._lost_since
                    window = self._connection.failover_window_s
                    waiting.say(logging.WARNING, "session re-attached to coordinator %s after %.1f s, %s %s", target,
                                waited, "within" if waited <= window else "past", self._connection.window)
                self._lost_since, self._said = None, None
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
            if shutdown.next_attempt:
                self._lose(shutdown.reason, JobMoved("attempt", shutdown.ended_attempt, shutdown.next_attempt))
            elif shutdown.next_run:
                self._lose(shutdown.reason, JobMoved("run", shutdown.ended_run, shutdown.next_run))
            else:
                self._lose(shutdown.reason)
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
        waiting.say(logging.WARNING, "the coordinator's event history no longer reaches back to the last event this "
                    "process received: catching up from each process's state as of event %d", self.position)
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

    def _lose(self, reason: str, moved: JobMoved | None = None) -> None:
        """The coordinator is lost, or (``moved``) the job's attempt or run ended and the next starts, as its
        Shutdown said."""
        self.attached.clear()
        if not self._lost:
            self._lost = True
            self._lapse()  # before anyone hears of the loss: a view that hears it answers nothing more
            if moved is not None and moved.what == "attempt":  # not a lost coordinator: ifrt run restarts us
                log.info("attempt %d of the job ended and attempt %d starts: this process's agent (ifrt run) "
                         "stops it and starts it again", moved.ended, moved.next)
            elif moved is not None:  # not a lost coordinator: the session, found stale, registers again
                log.info("run %d of the job is over (every process of it left or failed) and run %d starts: this "
                         "process registers again to take part", moved.ended, moved.next)
            else:
                self._lost_since = time.monotonic()
                config = self._connection.config
                self._said = Pacer(config.unreachable_report_every_s, config.unreachable_report_every_s)
                waiting.say(logging.WARNING, "lost the coordinator: %s; re-attaching to the replica of %s that "
                            "leads, for a takeover as long as %s", reason, self._connection.where,
                            self._connection.window)
            self._emit(CoordinatorLost(reason))
        self._lost_reason = reason

    def _say_still_lost(self) -> None:
        """While the session stays lost, a line every few seconds: how long, against the failover window, and why the
        last try failed (a refusal repeated on every try is said, not retried in silence)."""
        if self._said is None or self._lost_since is None or not self._said.due():
            return
        waited = time.monotonic() - self._lost_since
        window = self._connection.failover_window_s
        if waited <= window:
            waiting.say(logging.INFO, "the session is not re-attached yet after %.0f s of %s; trying %s; last: %s",
                        waited, self._connection.window, self._connection.where, self._lost_reason)
        else:
            waiting.say(logging.WARNING, "the session is not re-attached after %.0f s, past %s: no replica of %s has "
                        "taken it back; still trying, about once a second; last: %s", waited, self._connection.window,
                        self._connection.where, self._lost_reason)

    def _rejoin(self) -> None:
        try:
            topology = self._owner.register_again()
        except Exception as e:  # the loop keeps trying; the reason reaches the watchers
            self._lose(f"registering again failed: {e}")
            return
        self.position = self._owner.topology_position  # the new coordinator's numbers
        if self._owner.adopt(topology):
            self._emit(TopologyChanged(topology))
