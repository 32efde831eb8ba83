"""The host's live session (``HostSession``): one stream from the agent to the coordinator that vouches for every
worker attached on it, and fans the coordinator's events out to the workers' own sessions with the agent.

It opens once the host's first registration is published, from that answer's event position, run and attempt, and
opens again from a later answer of another run or attempt. It reconnects (the next replica) from the last job event
it received, attaching every attached worker again: the workers see no break. What the agent reports (an exit, a
hang) is kept until the coordinator acknowledged it and sent again on every new stream until then; a worker whose
watched prefix may have missed changes while the stream was down is told so (``watch_lapsed``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt.connection import Connection
from ifrt.errors import (
    ERROR_CLASSES,
    IfrtError,
    InvalidArgument,
    StaleSession,
    UnknownClient,
    from_rpc_error,
)
from ifrt.run.host_rules import OWN_KINDS, EventBuffer, Exits, Silence, Watches, not_its_own
from ifrt.run.worker_stream import Ended, WorkerStream

log = logging.getLogger("ifrt.run")

METHOD = "/ifrt.topology.v1.Coordinator/HostSession"
CHECK_S = 0.1
"""How often the silence of the workers' sessions is checked."""
_END = object()
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_FINAL = ("ProcessDeclaredFailed", "UnknownClient", "PermissionDenied")
"""A worker's session ended with one of these: the coordinator has its verdict on that worker, an exit report
included (its process failed, or the report can never be taken)."""


def newer(found: tuple[int, int], held: tuple[int, int]) -> bool:
    """Whether a registration answer's ``(run, attempt)`` is a later one than the open stream's (0, 0: not said)."""
    return found != (0, 0) and found > held


STOPPED = ("stopped answering: its process is stopped (SIGSTOP or SIGTSTP: state T in /proc), and its connection to "
           "its agent dropped")
"""Why a worker whose process its agent sees stopped is failed."""


class HostSession:
    """The host's session and its workers' sessions with the agent (``attach``, ``detach``, ``exited``);
    ``cpu(uid)``: the CPU seconds a worker's process used so far (None where the agent cannot see them);
    ``stopped(uid)``: whether its process is stopped (SIGSTOP, SIGTSTP), so that its dropped session is reported as
    a worker that stopped answering, not as one that lost its connection."""

    def __init__(self, connection: Connection, agent_uid: str, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[str], float | None] = lambda uid: None,
                 stopped: Callable[[str], bool] = lambda uid: False) -> None:
        self._connection, self.agent_uid, self._clock, self._cpu = connection, agent_uid, clock, cpu
        self._stopped = stopped
        self._lock = threading.Lock()
        self._streams: dict[str, WorkerStream] = {}
        self._attached: dict[str, str] = {}  # uid -> proof: sent again on every new stream
        self._exits: Exits[pb.WorkerExit] = Exits()  # sent again on every new stream until acknowledged
        self._outbox: queue.SimpleQueue | None = None
        self._buffer: EventBuffer | None = None
        self._generation = 0
        self._run_attempt = (0, 0)  # of the registration answer the stream opened from
        self._watches = Watches()
        self._silence = Silence()
        self._closed = threading.Event()
        self._opened = threading.Event()  # set while the stream is to be held (from a published registration)
        self._epoch = 0  # one more at each restart: what an older stream sends is no longer news
        self._call: grpc.Future | None = None
        self._refusal = "-"  # the last refusal logged ("-": before the first attach)
        self._held = False  # attached since the stream last broke
        self.attached = threading.Event()
        """Set while the coordinator has acknowledged the host's session."""
        self._threads: list[threading.Thread] = []

    # The host's stream.
    def open(self, generation: int, position: int, run: int = 0, attempt: int = 0) -> None:
        """Opens the host's session from job event ``position`` of ``run`` and ``attempt`` (a registration of its
        workers was published; 0: not said). While it is open, a publication of the same run and attempt changes
        nothing; one of a later run or attempt restarts it from that answer."""
        with self._lock:
            if self._closed.is_set():
                return
            ending: tuple[list[WorkerStream], grpc.Future | None] = ([], None)
            if self._opened.is_set():
                if not newer((run, attempt), self._run_attempt):
                    return
                log.info("this host's workers registered in run %d, attempt %d of the job: its session opens again "
                         "from their answer", run, attempt)
                ending = self._reset()
            self._buffer, self._generation, self._run_attempt = EventBuffer(position), generation, (run, attempt)
            self._opened.set()
            if not self._threads:
                for target, name in ((self._run, "ifrt-run-host-session"), (self._check, "ifrt-run-host-silence")):
                    thread = threading.Thread(target=target, name=name, daemon=True)
                    thread.start()
                    self._threads.append(thread)
        self._end(*ending, Ended(StaleSession(f"run {run}, attempt {attempt} of the job started: this session's "
                                              "registration belongs to an ended one; register again")))

    def restart(self, ended: Ended | None = None) -> None:
        """A new attempt of the job starts, or the coordinator refused the host's session (``ended``: how the
        workers' sessions end, so that they register again): the stream ends, with every worker's session, and
        opens again from the workers' next published registration."""
        with self._lock:
            self._opened.clear()
            self._buffer = None
            ending = self._reset()
        self._end(*ending, ended or Ended(None))

    def _reset(self) -> tuple[list[WorkerStream], grpc.Future | None]:
        """Forgets the stream and its workers (caller holds the lock); returns their streams and the call to end."""
        self._epoch += 1
        streams = list(self._streams.values())
        self._streams.clear()
        self._attached.clear()
        self._exits = Exits()
        self._watches, self._silence = Watches(), Silence()
        if self._outbox is not None:
            self._outbox.put(_END)
        return streams, self._call

    @staticmethod
    def _end(streams: list[WorkerStream], call: grpc.Future | None, ended: Ended) -> None:
        if call is not None:
            call.cancel()
        for stream in streams:
            stream.end(ended)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._outbox is not None:
                self._outbox.put(_END)
            streams = list(self._streams.values())
        self._end(streams, None, Ended(None))

    def _run(self) -> None:
        while not self._closed.is_set():
            if not self._opened.wait(CHECK_S):
                continue
            with self._lock:
                epoch = self._epoch
            target = self._connection.current()
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            try:
                call = self._call = self._connection.channel(target).stream_stream(
                    METHOD, request_serializer=pb.HostSessionRequest.SerializeToString,
                    response_deserializer=None)(self._requests(outbox))
                for raw in call:
                    self._handle(raw, target, epoch)
                error: IfrtError | None = None
            except grpc.RpcError as e:
                error = from_rpc_error(e, target)
            except IfrtError as e:
                error = e
            finally:
                self._broke(outbox, epoch)
            if self._closed.is_set():
                return
            if self._epoch != epoch or not self._opened.is_set():
                continue  # a new attempt or run, or the attempt ended: opened again from the next registration
            if isinstance(error, StaleSession):  # the next registration's answer opens it for the current one
                log.info("the coordinator refused this host's session (%s); it opens again from its workers' next "
                         "registration", error)
                self.restart(Ended(StaleSession(f"this session's registration belongs to an ended run or attempt of "
                                                f"the job ({error}): register again")))
            elif isinstance(error, InvalidArgument | UnknownClient):  # it lost the events (restarted without a store)
                log.warning("the coordinator refused this host's session (%s); its workers register again", error)
                self.restart(Ended(UnknownClient(f"the coordinator refused this host's session ({error}): register "
                                                 "again")))
            elif error is not None and not error.retryable:  # e.g. this agent not joined yet: tried again
                if str(error) != self._refusal:
                    log.warning("the coordinator refused this host's session: %s: %s; trying again",
                                type(error).__name__, error)
                self._refusal = str(error)
            elif self._held:  # said once per loss; the next `attached` says it is back
                log.warning("lost this host's session with %s (%s); reconnecting", target, error or "it ended")
            self._held = False
            self._connection.rotate(target)
            self._closed.wait(self._connection.backoff.next())

    def _broke(self, outbox: queue.SimpleQueue, epoch: int) -> None:
        """The stream ended: nothing more goes to it, and each worker whose watch was in place hears it lapsed (a
        change made before the next stream watches again is never pushed: its reads go to the coordinator)."""
        with self._lock:
            self._outbox = None
            lapsed = self._watches.lapse() if epoch == self._epoch else {}
            for prefix, uids in lapsed.items():
                raw = pb.SessionEvent(watch_lapsed=pb.WatchKeys(prefix=prefix)).SerializeToString()
                for uid in uids:
                    if (stream := self._streams.get(uid)) is not None:
                        stream.put(raw)
        outbox.put(_END)
        self.attached.clear()

    def _requests(self, outbox: queue.SimpleQueue) -> Iterator[pb.HostSessionRequest]:
        with self._lock:  # from now on what is sent goes to this outbox; what was sent before is sent below
            if self._buffer is None:  # restarted meanwhile
                return
            self._outbox = outbox
            run, attempt = self._run_attempt
            opening = pb.HostSessionOpen(agent_uid=self.agent_uid, generation=self._generation,
                                         since_event=self._buffer.head, run=run, attempt=attempt)
            exits = self._exits.pending()
            attached = [pb.WorkerSession(client_uid=uid, proof=proof) for uid, proof in self._attached.items()]
            prefixes = self._watches.reopened()
        yield pb.HostSessionRequest(open=opening)
        for exit_ in exits:  # before the attaches: a reported worker is never vouched for again
            yield pb.HostSessionRequest(exited=exit_)
        for worker in attached:
            yield pb.HostSessionRequest(attach=worker)
        for prefix in prefixes:
            yield pb.HostSessionRequest(watch=pb.WatchKeys(prefix=prefix))
        while (message := outbox.get()) is not _END and not self._closed.is_set():
            yield message

    def _send(self, message: pb.HostSessionRequest) -> None:
        """Sends on the open stream (caller holds the lock); without one, a new stream re-sends what it needs."""
        if self._outbox is not None:
            self._outbox.put(message)

    def _handle(self, raw: bytes, target: str, epoch: int) -> None:
        event = pb.SessionEvent.FromString(raw)
        kind = event.WhichOneof("kind")
        with self._lock:
            if epoch != self._epoch:
                return
            if number := event.event_number:  # a job event: kept, and to every attached worker that lacks it
                assert self._buffer is not None
                if self._buffer.add(number, raw):
                    for stream in self._streams.values():
                        if stream.live and stream.since < number:
                            stream.put(raw)
                            stream.since = number
                if kind == "topology_changed":
                    self._generation = max(self._generation, event.topology_changed.generation)
            elif kind == "attached":
                if not event.attached.client_uid:
                    self._connection.answered(target)
                    self.attached.set()
                    if not self._held and self._refusal != "-":
                        log.warning("this host's session is back, through %s", target)
                    self._held, self._refusal = True, ""
                else:
                    self._worker_attached(event.attached)
            elif kind == "worker_ended":
                self._worker_ended(event.worker_ended)
            elif kind == "exit_noted":
                self._exits.acknowledged(event.exit_noted.client_uid)
            elif kind == "key_changed":
                for uid in self._watches.for_key(event.key_changed.key):
                    if (stream := self._streams.get(uid)) is not None and stream.live:
                        stream.put(raw)
            elif kind == "watching":
                for uid in self._watches.acknowledge(event.watching.prefix):
                    if (stream := self._streams.get(uid)) is not None:
                        stream.put(raw)
            elif kind == "shutdown":  # as the coordinator does: every session hears why, then ends
                for stream in self._streams.values():
                    stream.put(raw)
                    stream.end(Ended(None))
                if event.shutdown.next_attempt:
                    self._opened.clear()  # the attempt ended: wait for the next attempt's workers' registration
            else:  # events for every session that carry no number
                for stream in self._streams.values():
                    if stream.live:
                        stream.put(raw)

    def _worker_attached(self, attached: pb.Attached) -> None:
        stream = self._streams.get(attached.client_uid)
        if stream is None or stream.live:
            return  # gone meanwhile, or attached again after the host's stream reconnected: no news to the worker
        stream.put(pb.SessionEvent(attached=attached).SerializeToString())
        assert self._buffer is not None
        missed = self._buffer.since(stream.since)
        if missed is None:
            stream.end(Ended(UnknownClient(
                f"this worker's session asked for the job events after event {stream.since}, which its agent no "
                f"longer keeps (it keeps those after event {self._buffer.floor}): register again")))
            return
        events = {number: (raw, pb.SessionEvent.FromString(raw)) for number, raw in missed}
        about = [(n, kind, getattr(e, kind).process_id if kind in OWN_KINDS else -1)
                 for n, (_, e) in events.items() for kind in (e.WhichOneof("kind"),)]
        for number in not_its_own(about, attached.process_id):
            stream.put(events[number][0])
        if missed:
            stream.since = missed[-1][0]
        stream.live = True
        self._silence.start(attached.client_uid, self._clock(), attached.hung_after_ms / 1000)

    def _worker_ended(self, ended: pb.WorkerSessionEnded) -> None:
        uid = ended.client_uid
        if ended.error in _FINAL:
            self._exits.acknowledged(uid)
        if (proof := self._attached.pop(uid, None)) is not None:  # the host's session carries it no longer
            self._send(pb.HostSessionRequest(detach=pb.WorkerSession(client_uid=uid, proof=proof)))
        self._silence.stop(uid)
        stream = self._streams.pop(uid, None)
        if stream is None:
            return
        self._unwatch(uid)
        cls = ERROR_CLASSES.get(ended.error, IfrtError)
        stream.end(Ended(cls(ended.message), _STATUS.get(ended.code, grpc.StatusCode.UNKNOWN)))

    def _unwatch(self, uid: str) -> None:
        """``uid``'s session is gone: the prefixes no other worker watches are no longer watched (caller holds the
        lock)."""
        for prefix in self._watches.drop([uid]):
            self._send(pb.HostSessionRequest(unwatch=pb.WatchKeys(prefix=prefix)))

    # The workers' sessions with the agent.
    def attach(self, stream: WorkerStream) -> None:
        """A worker's session opened with the agent: the host's session vouches for it once the coordinator
        attaches it (its older session with the agent, if any, ends)."""
        with self._lock:
            if not self._opened.is_set():  # no registration of this attempt's was published since: register again
                stream.end(Ended(UnknownClient("this host's session with the coordinator is not open (a new attempt, "
                                               "or the coordinator refused it): register again")))
                return
            older = self._streams.get(stream.uid)
            self._streams[stream.uid] = stream
            if stream.uid not in self._exits:  # a reported worker is never vouched for again
                self._attached[stream.uid] = stream.proof
                self._send(pb.HostSessionRequest(attach=pb.WorkerSession(client_uid=stream.uid, proof=stream.proof)))
        if older is not None:
            older.end(Ended(None))

    def detach(self, stream: WorkerStream) -> None:
        """A worker's session with the agent ended (its connection dropped, or it closed it). A worker whose process
        is stopped is reported as one that stopped answering (the coordinator fails it at once), as the coordinator
        itself would say of a stopped process it serves directly."""
        stopped = self._stopped(stream.uid)  # reads /proc: outside the lock
        with self._lock:
            if self._streams.get(stream.uid) is not stream:
                return
            del self._streams[stream.uid]
            was_attached = self._attached.pop(stream.uid, None) is not None
            self._silence.stop(stream.uid)
            self._unwatch(stream.uid)
            message = pb.WorkerExit(client_uid=stream.uid, proof=stream.proof, reason=STOPPED)
            if stopped and was_attached and self._exits.add(stream.uid, message):
                log.info("a worker's session (client %s) dropped while its process is stopped: reporting it",
                         stream.uid[:8])
                self._send(pb.HostSessionRequest(exited=message))
                return
            self._send(pb.HostSessionRequest(detach=pb.WorkerSession(client_uid=stream.uid, proof=stream.proof)))

    def exited(self, uid: str, proof: str, reason: str) -> None:
        """A worker exited, or stopped answering: the coordinator fails it at once. The report is kept until the
        coordinator acknowledges it (sent again on every new stream until then), and the worker is not attached
        again meanwhile."""
        message = pb.WorkerExit(client_uid=uid, proof=proof, reason=reason)
        with self._lock:
            if self._exits.add(uid, message):
                self._attached.pop(uid, None)
                self._send(pb.HostSessionRequest(exited=message))

    def heard(self, uid: str) -> None:
        """A Heartbeat from ``uid``'s session."""
        with self._lock:
            self._silence.heard(uid, self._clock())

    def watch(self, stream: WorkerStream, prefix: str) -> None:
        """A worker's key watch: asked for once on the host's session; the worker hears ``watching`` once the
        coordinator watches the prefix."""
        with self._lock:
            if self._streams.get(stream.uid) is not stream:
                return
            if self._watches.add(stream.uid, prefix):
                self._send(pb.HostSessionRequest(watch=pb.WatchKeys(prefix=prefix)))
            elif self._watches.watching(stream.uid, prefix):
                stream.put(pb.SessionEvent(watching=pb.WatchKeys(prefix=prefix)).SerializeToString())

    def _check(self) -> None:
        while not self._closed.wait(CHECK_S):
            with self._lock:
                hung, busy = self._silence.check(self._clock(), self._cpu)
                proofs = {uid: self._attached.get(uid) or getattr(self._streams.get(uid), "proof", "")
                          for uid, _ in hung}
            for uid, seconds in busy:
                log.info("a worker's session (client %s) sent no heartbeat for longer than its hung limit, but its "
                         "process used %.1fs of CPU meanwhile: busy, not hung (one long call holding the GIL)",
                         uid[:8], seconds)
            for uid, why in hung:
                log.info("a worker's session (client %s) %s: reporting it", uid[:8], why)
                self.exited(uid, proofs[uid], why)
