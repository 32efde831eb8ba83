"""The answers of the key-value calls that change the store (increments, swaps, sets, deletions), kept per caller,
request id and key, so that a retried call (its reply lost in a failover) is answered as its first call was instead
of being applied twice. No I/O.

Bounded two ways, both decided by the order calls were answered, so that a replay of the journal (whole, or compacted
to the entries ``coordinator.core.compaction`` keeps) remembers exactly the same answers:

- in bytes over all callers (``--max-answer-bytes``): the calls remembered are the newest whose costs (``cost``) fit,
  the oldest forgotten first;
- per caller (``--max-answers-per-caller``): of those, a caller's newest answers are kept; an older call of the
  caller stays only as a mark (its cost still counted), so that its retry is refused instead of applied again.

A call forgotten by either bound is never applied again: its retry is refused. The bytes forget a call entirely, so
each caller keeps a record of what it forgot (``Record``, ``CALLER_OVERHEAD_BYTES`` and its uid, counted from its
first remembered call until the run ends): request ids that are increasing decimal numbers per caller (``ordered``,
as ``ifrt.Client`` makes them) are refused at or below the newest one forgotten; once a call with any other request
id is forgotten, every later call of that caller with such an id that is not remembered is refused (it cannot be told
from a retry). A call arriving first after a newer call of its caller was forgotten is refused too: safe, as it
changed nothing. Records are never forgotten: a new call for which they leave no room is refused with
RESOURCE_EXHAUSTED (``check_room``). Each record that changes is journaled (``journal.AnswersForgotten``), so that a
compacted journal, which no longer holds the calls forgotten, rebuilds the same records.

A swap's or a set's answer is the value it stored, which its retry carries again: only that value's digest is kept
in memory. Its journal entry keeps the value, which a compaction keeps while the call is remembered: the value's
bytes count.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from coordinator.core.limits import (
    ANSWER_OVERHEAD_BYTES,
    CALLER_OVERHEAD_BYTES,
    DEFAULT_LIMITS,
    FLAGS,
    Limits,
    exhausted,
    shown,
)

_ORDERED = re.compile(r"[1-9][0-9]{0,18}")


def ordered(request_id: str) -> int | None:
    """The number an ordered request id names (a decimal number from 1, no leading zero, at most 19 digits: a
    caller's calls in the order it made them); None for any other request id."""
    return int(request_id) if _ORDERED.fullmatch(request_id) else None


@dataclass(frozen=True)
class Stored:
    """A swap's or a set's answer: the digest of the value it stored (a retry carries the value)."""

    digest: bytes

    @classmethod
    def of(cls, value: bytes) -> Stored:
        return cls(hashlib.sha256(value).digest())


@dataclass(frozen=True)
class Forgotten:
    """Why a call's answer is no longer kept, so that its retry is refused: ``per_caller`` (a mark past
    ``--max-answers-per-caller``), or pushed out of ``--max-answer-bytes`` (``through``: the newest ordered request
    id of the caller forgotten; 0 for a request id that is not ordered)."""

    per_caller: bool
    through: int = 0

    def __repr__(self) -> str:
        return "FORGOTTEN" if self.per_caller else f"Forgotten(through={self.through})"


@dataclass(frozen=True)
class Deleted:
    """A deletion's answer: how many keys it deleted."""

    count: int


@dataclass
class Record:
    """What a caller's retries may no longer be answered: its ordered request ids up to ``through`` (0: none), and
    (``unordered``) every request id that is not ordered, once one such call was forgotten."""

    through: int = 0
    unordered: bool = False


FORGOTTEN = Forgotten(per_caller=True)
Answer = int | Stored | Deleted
"""An increment's sum, a swap's or a set's digest, a deletion's count."""
Call = tuple[str, str, str]
"""(client uid, request id, key): a request id names a call on one key; the same id on another key is another call."""


def cost(call: Call, stored: int) -> int:
    """What remembering a call counts against ``--max-answer-bytes`` (``stored``: the bytes of the value its journal
    entry keeps)."""
    return sum(len(part.encode()) for part in call) + stored + ANSWER_OVERHEAD_BYTES


def record_cost(client_uid: str) -> int:
    """What a caller's ``Record`` counts against ``--max-answer-bytes``."""
    return len(client_uid.encode()) + CALLER_OVERHEAD_BYTES


class RetryAnswers:
    """The answers of the newest calls within ``answer_bytes``; of each caller, the newest ``answers_per_caller``;
    of every caller, the record of what it forgot (see the module)."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.answers: dict[str, dict[tuple[str, str], Answer]] = {}
        """Client uid -> (request id, key) -> its answer, oldest first."""
        self.records: dict[str, Record] = {}
        """Client uid -> what it forgot: every caller that had a call remembered, in the order they came."""
        self._calls: dict[Call, int] = {}  # every call remembered, answered or marked, oldest first -> its cost
        self.held = 0
        """Bytes remembered, as ``--max-answer-bytes`` counts them: the calls' costs and the records'."""
        self.records_held = 0
        """The records' share of ``held``."""

    def get(self, client_uid: str, request_id: str, key: str) -> Answer | Forgotten | None:
        """The answer given to this call before; ``Forgotten`` (saying why) when its answer is no longer kept and it
        may have been applied; None for a new call (and for any call without a request id: none retries it)."""
        if not request_id:
            return None
        answer = self.answers.get(client_uid, {}).get((request_id, key))
        if answer is not None:
            return answer
        if (client_uid, request_id, key) in self._calls:
            return FORGOTTEN
        record = self.records.get(client_uid)
        if record is None:
            return None
        number = ordered(request_id)
        if number is None:
            return Forgotten(per_caller=False) if record.unordered else None
        return Forgotten(per_caller=False, through=record.through) if number <= record.through else None

    def check_room(self, client_uid: str, request_id: str, key: str, stored: int) -> None:
        """ResourceExhausted, before a new call is applied, when the records of what callers forgot leave no room
        for it even with every other answer forgotten (records are never forgotten within a run)."""
        if not request_id:
            return
        records = self.records_held + (0 if client_uid in self.records else record_cost(client_uid))
        spent = cost((client_uid, request_id, key), stored)
        if records + spent > self.limits.answer_bytes:
            raise exhausted(f"remembering the answer of request_id {shown(request_id)} on key {shown(key)} ({spent} "
                            f"bytes) beside the records of what {len(self.records)} callers' retries may no longer "
                            f"be answered ({self.records_held} bytes)", self.limits.answer_bytes, "answer_bytes",
                            "make the call without a request_id (it is then not retried safely), or raise the flag")

    def remember(self, client_uid: str, request_id: str, key: str, answer: Answer, stored: int) -> list[str]:
        """Keeps ``answer`` for retries of ``request_id`` on ``key`` (nothing without a request id; ``stored``: the
        bytes of the value its journal entry keeps), forgetting the oldest answers past the bounds. Returns the
        callers whose records changed (each to be journaled, ``journal.AnswersForgotten``)."""
        if not request_id:
            return []
        call = (client_uid, request_id, key)
        if call in self._calls:  # only a journal written before calls were refused this: the newest counts
            self._unlink(call)
        self._record(client_uid)
        done = self.answers.setdefault(client_uid, {})
        done[(request_id, key)] = answer
        self._calls[call] = spent = cost(call, stored)
        self.held += spent
        if len(done) > self.limits.answers_per_caller:
            del done[next(iter(done))]  # a mark now: its cost stays counted
        return self._fit()

    def forgot(self, client_uid: str, through: int, unordered: bool) -> list[str]:
        """Applies a journaled record (``journal.AnswersForgotten``): the caller's retries up to ordered request id
        ``through`` (and, if ``unordered``, of every other request id) are refused. Returns what ``remember``
        does."""
        record = self._record(client_uid)
        record.through, record.unordered = max(record.through, through), record.unordered or unordered
        return self._fit()

    def _record(self, client_uid: str) -> Record:
        record = self.records.get(client_uid)
        if record is None:
            record = self.records[client_uid] = Record()
            self.records_held += record_cost(client_uid)
            self.held += record_cost(client_uid)
        return record

    def _fit(self) -> list[str]:
        """Forgets the oldest calls while the bytes pass ``answer_bytes`` (the newest call always stays), each
        leaving its mark in its caller's record; returns the callers whose records changed, in order."""
        changed: dict[str, None] = {}
        while self.held > self.limits.answer_bytes and len(self._calls) > 1:
            call = next(iter(self._calls))
            client_uid, request_id = call[0], call[1]
            self._unlink(call)
            record = self.records[client_uid]
            number = ordered(request_id)
            if number is None and not record.unordered:
                record.unordered = True
                changed[client_uid] = None
            elif number is not None and number > record.through:
                record.through = number
                changed[client_uid] = None
        return list(changed)

    def _unlink(self, call: Call) -> None:
        self.held -= self._calls.pop(call)
        client_uid, request_id, key = call
        done = self.answers.get(client_uid, {})
        done.pop((request_id, key), None)
        if not done:
            self.answers.pop(client_uid, None)

    def calls(self) -> list[Call]:
        """Every call remembered (answered or marked), oldest first."""
        return list(self._calls)


def refusal(forgotten: Forgotten, request_id: str, key: str, limits: Limits) -> str:
    """Why a retry of a call whose answer is no longer kept is refused, and what its caller does next."""
    call = f"request_id {shown(request_id)} on key {shown(key)}"
    then = ("read the key to see whether it took effect, and if not call again with a new request_id")
    if forgotten.per_caller:
        return (f"{call} was answered before this client's last {limits.answers_per_caller} calls, and its answer is "
                f"no longer kept (the coordinator's {FLAGS['answers_per_caller']}): it may have been applied, so it "
                f"is not applied again; {then}")
    bytes_bound = f"the coordinator's {FLAGS['answer_bytes']} of {limits.answer_bytes} bytes over all callers"
    if forgotten.through:
        return (f"{call}: the answers of this client's calls up to request_id {forgotten.through} were pushed out "
                f"of {bytes_bound}, so this call may have been applied and is not applied again; {then}")
    return (f"{call}: an answer of this client's calls with request_ids that are not increasing numbers was pushed "
            f"out of {bytes_bound}, and none of them can be told from a retry of that call any more, so this call is "
            f"not applied; {then}, numbered 1, 2, 3, ... per client as ifrt.Client does")
