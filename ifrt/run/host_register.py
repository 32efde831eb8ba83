"""The host's registrations: the workers' Register calls to their agent, sent to the coordinator together as one
``RegisterHost`` (retried on the next replica as every call of the agent), each worker answered as its own Register
would have been: the same bytes every process of the generation gets, behind its process id."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt.connection import Connection
from ifrt.errors import ERROR_CLASSES, CoordinatorUnavailable, IfrtError, ProcessIdTaken
from ifrt.run.host_rules import Batcher, Ranks, Ticket

log = logging.getLogger("ifrt.run")

ANSWER_MARGIN_S = 0.1
"""Kept of a worker's call for the agent's answer after the coordinator's."""
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_PROGRESS = pb.RegisterResponse(process_id=-1).SerializeToString()
"""What precedes the shared bytes of a progress answer in each worker's (no id is an answer until every one is)."""


class Refused(Exception):
    """A worker's registration the coordinator (or the agent) refused: ``error`` as its own Register would carry it."""

    def __init__(self, error: IfrtError, code: grpc.StatusCode) -> None:
        super().__init__(str(error))
        self.error, self.code = error, code


def _late() -> Refused:
    return Refused(CoordinatorUnavailable("the coordinator's answer to this host's registrations did not come within "
                                          "this call's time"), grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class Registered:
    """A worker's admitted registration: what proves its sessions, and where its exit is seen."""

    proof: str
    local_rank: int
    process_id: int


class HostRegistrar:
    """Gathers the workers' registrations and sends them as ``RegisterHost`` calls of at most ``per_call`` (the
    workers the agent runs), each in a thread of its own. ``expected()``: how many workers the agent runs now (the
    registrations go once each has asked); ``published(generation, position, run, attempt)``: called when an answer
    carries the topology, before any worker hears it; ``ids_known``: with the process ids by local rank it carried
    (the agent needs no Status to learn them). ``workers`` bounds what may be pending (spares included).

    A worker's re-poll that a call in flight carries sends nothing: every call carries each registration still asking
    within its wait, and each ask is answered by the first call carrying it that comes back, with what the coordinator
    said of that registration in it (so a refused, failed or replaced worker hears its own answer, never another's),
    or, once its own wait is over, with the host's latest progress answer. A registration nothing in flight carries
    (news, or a re-poll after its calls came back) is sent as before. Every ask waits at most until its deadline."""

    def __init__(self, connection: Connection, agent_uid: str, workers: int, per_call: int,
                 expected: Callable[[], int], published: Callable[[int, int, int, int], None],
                 ids_known: Callable[[dict[int, int]], None] = lambda ids: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._connection, self.agent_uid, self._per_call = connection, agent_uid, per_call
        self._expected, self._published, self._clock = expected, published, clock
        self._ids_known = ids_known
        self._batcher: Batcher[pb.HostProcess] = Batcher(workers)
        self._cond = threading.Condition()
        self.registered: dict[str, Registered] = {}
        """Admitted registrations by client uid."""
        self._ranks = Ranks()
        self.clashes: dict[int, str] = {}
        """By local rank: why the coordinator refused this host's worker as a second claim on its local rank (another
        agent on this machine runs the same job without --host-rank), in one line for the agent to report."""

    def register(self, request: pb.RegisterRequest, proof: str, deadline: float) -> bytes:
        """The worker's answer: ``RegisterResponse`` bytes; ``Refused`` as its own Register would have been."""
        now = self._clock()
        answer_by = deadline - ANSWER_MARGIN_S
        wait_until = min(answer_by, now + request.wait_ms / 1000)
        with self._cond:
            try:
                ticket = self._batcher.join(request.client_uid, pb.HostProcess(request=request, proof=proof), now,
                                            wait_until, deadline, proof)
            except IfrtError as e:
                raise Refused(e, e.code) from None
            self._cond.notify_all()
            try:
                while ticket.answer is None:
                    now = self._clock()
                    if self._batcher.due(now, self._awaited()):
                        self._start(now)
                        continue
                    if now >= wait_until and (kept := self._batcher.kept(ticket, now)) is not None:
                        return kept  # its call rides on with the host's next one
                    if now >= deadline:
                        raise _late()
                    wake = deadline if now >= wait_until else wait_until
                    self._cond.wait(min(self._batcher.wait(now), wake - now))
            finally:
                self._batcher.leave(ticket)
        answer = ticket.answer
        if isinstance(answer, Refused):
            raise answer
        if isinstance(answer, IfrtError):
            raise Refused(answer, answer.code)
        return answer

    def _start(self, now: float) -> None:
        """Takes the due registrations, and every other still asking, as one call sent in a thread of its own (the
        caller holds the lock)."""
        call = object()
        taken = self._batcher.take(self._per_call, call, now)
        deadline, wait_s = self._batcher.window(taken, now)
        threading.Thread(target=self._send, args=(taken, deadline, wait_s, self._batcher.epoch), daemon=True,
                         name="ifrt-run-register-host").start()

    def _send(self, taken: list[Ticket[pb.HostProcess]], deadline: float, wait_s: float, epoch: int) -> None:
        entries = [t.entry for t in taken]
        request = pb.RegisterHostRequest(agent_uid=self.agent_uid, processes=entries)
        slack = max(ANSWER_MARGIN_S, (deadline - self._clock()) - wait_s)

        def attempt(remaining: float) -> pb.RegisterHostRequest:
            request.wait_ms = max(0, int(min(wait_s, remaining - ANSWER_MARGIN_S) * 1000))
            return request

        answers: dict[str, bytes | Refused] | None = None
        progress: bytes | None = None
        failed: IfrtError | None = None
        try:
            response = self._connection.call("RegisterHost", attempt, deadline - ANSWER_MARGIN_S,
                                              timeout=lambda r: min(r, wait_s + slack), wait_for_ready=False)
            answers, progress = self._answered(entries, response)
        except IfrtError as e:
            failed = e
        except Exception as e:  # a bug: the workers must hear of it, not hang
            log.exception("registering this host's workers failed")
            failed = IfrtError(f"this host's agent failed to register its workers: {type(e).__name__}: {e}")
        finally:
            with self._cond:
                if progress is not None:
                    self._batcher.keep(progress, self._clock(), epoch)
                elif answers is not None:  # a topology: the progress kept so far is over
                    self._batcher.forget()
                self._batcher.answered(taken, answers, failed)
                self._cond.notify_all()

    def _answered(self, entries: list[pb.HostProcess], response: pb.RegisterHostResponse
                  ) -> tuple[dict[str, bytes | Refused], bytes | None]:
        """Each registration's answer by client uid, as its own Register would have had it; and a progress answer's
        bytes as a worker gets them (None: the answer carries the topology)."""
        if len(response.processes) != len(entries):
            raise IfrtError(f"the coordinator answered {len(response.processes)} results for this host's "
                            f"{len(entries)} registrations: expected one each")
        answer = pb.RegisterResponse.FromString(response.answer)
        answers: dict[str, bytes | Refused] = {}
        with self._cond:
            for entry, result in zip(entries, response.processes, strict=True):
                uid = entry.request.client_uid
                if result.code:
                    cls = ERROR_CLASSES.get(result.error, IfrtError)
                    if issubclass(cls, ProcessIdTaken) and not entry.request.HasField("process_id"):
                        self._clash(entry.request)
                    answers[uid] = Refused(cls(result.message), _STATUS.get(result.code, grpc.StatusCode.UNKNOWN))
                    continue
                self.registered[uid] = Registered(entry.proof, entry.request.local_rank, result.process_id)
                self._ranks.registered(entry.request.local_rank, uid)
                answers[uid] = pb.RegisterResponse(process_id=result.process_id).SerializeToString() + response.answer
        if not answer.topology:
            return answers, _PROGRESS + response.answer
        self._published(answer.generation, answer.event_position, answer.run, answer.attempt)
        self._ids_known({entry.request.local_rank: result.process_id
                         for entry, result in zip(entries, response.processes, strict=True) if not result.code})
        return answers, None

    def _clash(self, request: pb.RegisterRequest) -> None:
        """Notes (and says once) that another process of this machine holds ``request``'s local rank: a worker of
        this agent never competes with another of its own, so the holder is another agent's (or process's)."""
        rank = request.local_rank
        if rank in self.clashes:
            return
        self.clashes[rank] = line = (
            f"local rank {rank} of this machine ({request.hostname}) is already "
            "run by another `ifrt run` agent (or process) of this job: to run several agents on one machine, give "
            "each --host-rank R --num-hosts H (R from 0 to H-1), or run each on a host of its own (its own hostname)")
        log.error("%s", line)

    def _awaited(self) -> int:
        """The live workers whose registration the host still awaits: all but those admitted and not asking again,
        so that a lone replacement among running workers goes at once."""
        return self._expected() - sum(1 for uid in self._ranks.current() if not self._batcher.asks(uid))

    def started(self, local_rank: int) -> int:
        """A worker starts (or a spare takes over) for ``local_rank``: its serial, which its exit names. Its answers,
        and from now on every worker's, come from the coordinator (no progress answer kept so far is handed out)."""
        with self._cond:
            self._batcher.forget()
            return self._ranks.started(local_rank)

    def exited(self, local_rank: int, serial: int) -> tuple[str, str] | None:
        """The client uid and proof of the registration of ``local_rank``'s worker ``serial``, once (it exited)."""
        with self._cond:
            uid = self._ranks.exited(local_rank, serial)
            registered = None if uid is None else self.registered.get(uid)
            if uid is not None:
                self._batcher.drop(uid)  # no call carries it any more
        return None if uid is None or registered is None else (uid, registered.proof)
