"""The host's registrations: the workers' Register calls to their agent, sent to the coordinator together as one
``RegisterHost`` (retried on the next replica as every call of the agent), each worker answered as its own Register
would have been: the same bytes every process of the generation gets, behind its process id."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from ifrt._generated import coordinator_pb2 as pb
from ifrt.connection import Connection
from ifrt.errors import ERROR_CLASSES, CoordinatorUnavailable, IfrtError
from ifrt.run.host_rules import Batcher, Ranks, Ticket, batch_window

log = logging.getLogger("ifrt.run")

ANSWER_MARGIN_S = 0.1
"""Kept of a worker's call for the agent's answer after the coordinator's."""
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


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


@dataclass
class _Outcome:
    done: threading.Event = field(default_factory=threading.Event)
    answers: dict[str, bytes | Refused] = field(default_factory=dict)
    error: IfrtError | None = None


class HostRegistrar:
    """Gathers the workers' registrations and sends them as ``RegisterHost`` calls of at most ``per_call`` (the
    workers the agent runs), each in a thread of its own. ``expected()``: how many workers the agent runs now (the
    registrations go once each has asked); ``published(generation, position, run, attempt)``: called when an answer
    carries the topology, before any worker hears it; ``ids_known``: with the process ids by local rank it carried
    (the agent needs no Status to learn them). ``workers`` bounds what may be pending (spares included)."""

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

    def register(self, request: pb.RegisterRequest, proof: str, deadline: float) -> bytes:
        """The worker's answer: ``RegisterResponse`` bytes; ``Refused`` as its own Register would have been."""
        with self._cond:
            try:
                ticket = self._batcher.join(request.client_uid, pb.HostProcess(request=request, proof=proof),
                                            self._clock())
            except IfrtError as e:
                raise Refused(e, e.code) from None
            ticket.deadline = max(ticket.deadline, deadline)
            self._cond.notify_all()
            while ticket.round is None:
                now = self._clock()
                if self._batcher.due(now, self._expected()):
                    outcome = _Outcome()
                    taken = self._batcher.take(self._per_call, outcome)
                    threading.Thread(target=self._send, args=(taken, outcome), daemon=True,
                                     name="ifrt-run-register-host").start()
                    continue
                if now >= deadline:
                    raise _late()
                self._cond.wait(min(self._batcher.wait(now), deadline - now))
            outcome = ticket.round
        if not outcome.done.wait(max(0.0, deadline - self._clock())):
            raise _late()
        if outcome.error is not None:
            raise Refused(outcome.error, outcome.error.code)
        answer = outcome.answers[request.client_uid]
        if isinstance(answer, Refused):
            raise answer
        return answer

    def _send(self, taken: list[Ticket[pb.HostProcess]], outcome: _Outcome) -> None:
        entries = [t.entry for t in taken]
        deadline, wait_ms = batch_window((t.deadline, t.entry.request.wait_ms) for t in taken)
        request = pb.RegisterHostRequest(agent_uid=self.agent_uid, processes=entries)
        slack = max(ANSWER_MARGIN_S, (deadline - self._clock()) - wait_ms / 1000)

        def attempt(remaining: float) -> pb.RegisterHostRequest:
            request.wait_ms = max(0, min(wait_ms, int((remaining - ANSWER_MARGIN_S) * 1000)))
            return request

        try:
            response = self._connection.call("RegisterHost", attempt, deadline - ANSWER_MARGIN_S,
                                              timeout=lambda r: min(r, wait_ms / 1000 + slack), wait_for_ready=False)
            self._answered(entries, response, outcome)
        except IfrtError as e:
            outcome.error = e
        except Exception as e:  # a bug: the workers must hear of it, not hang
            log.exception("registering this host's workers failed")
            outcome.error = IfrtError(f"this host's agent failed to register its workers: {type(e).__name__}: {e}")
        finally:
            with self._cond:
                self._batcher.answered(taken)
                self._cond.notify_all()
            outcome.done.set()

    def _answered(self, entries: list[pb.HostProcess], response: pb.RegisterHostResponse, outcome: _Outcome) -> None:
        if len(response.processes) != len(entries):
            raise IfrtError(f"the coordinator answered {len(response.processes)} results for this host's "
                            f"{len(entries)} registrations: expected one each")
        answer = pb.RegisterResponse.FromString(response.answer)
        with self._cond:
            for entry, result in zip(entries, response.processes, strict=True):
                uid = entry.request.client_uid
                if result.code:
                    cls = ERROR_CLASSES.get(result.error, IfrtError)
                    outcome.answers[uid] = Refused(cls(result.message), _STATUS.get(result.code,
                                                                                    grpc.StatusCode.UNKNOWN))
                    continue
                self.registered[uid] = Registered(entry.proof, entry.request.local_rank, result.process_id)
                self._ranks.registered(entry.request.local_rank, uid)
                outcome.answers[uid] = pb.RegisterResponse(process_id=result.process_id).SerializeToString() \
                    + response.answer
        if answer.topology:
            self._published(answer.generation, answer.event_position, answer.run, answer.attempt)
            self._ids_known({entry.request.local_rank: result.process_id
                             for entry, result in zip(entries, response.processes, strict=True) if not result.code})

    def started(self, local_rank: int) -> int:
        """A worker starts (or a spare takes over) for ``local_rank``: its serial, which its exit names."""
        with self._cond:
            return self._ranks.started(local_rank)

    def exited(self, local_rank: int, serial: int) -> tuple[str, str] | None:
        """The client uid and proof of the registration of ``local_rank``'s worker ``serial``, once (it exited)."""
        with self._cond:
            uid = self._ranks.exited(local_rank, serial)
            registered = None if uid is None else self.registered.get(uid)
        return None if uid is None or registered is None else (uid, registered.proof)
