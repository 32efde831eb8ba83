"""The answers of the key-value calls that change the store (increments, swaps, sets, deletions), kept per caller,
request id and key, so that a retried call (its reply lost in a failover) is answered as its first call was instead
of being applied twice. No I/O.

Bounded two ways, both decided by the order calls were answered, so that a replay of the journal (whole, or compacted
to the entries ``coordinator.compaction`` keeps) remembers exactly the same answers:

- in bytes over all callers (``--max-answer-bytes``): the calls remembered are the newest whose costs (``cost``) fit,
  the oldest forgotten first;
- per caller (``--max-answers-per-caller``): of those, a caller's newest answers are kept; an older call of the
  caller stays only as a mark (its cost still counted), so that its retry is refused instead of applied again.

A swap's or a set's answer is the value it stored, which its retry carries again: only that value's digest is kept
in memory. Its journal entry keeps the value, which a compaction keeps while the call is remembered: the value's
bytes count.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from coordinator.limits import ANSWER_OVERHEAD_BYTES, DEFAULT_LIMITS, Limits


@dataclass(frozen=True)
class Stored:
    """A swap's or a set's answer: the digest of the value it stored (a retry carries the value)."""

    digest: bytes

    @classmethod
    def of(cls, value: bytes) -> Stored:
        return cls(hashlib.sha256(value).digest())


class _Forgotten:
    """The answer of a call remembered only as a mark (past ``--max-answers-per-caller``)."""

    def __repr__(self) -> str:
        return "FORGOTTEN"


@dataclass(frozen=True)
class Deleted:
    """A deletion's answer: how many keys it deleted."""

    count: int


FORGOTTEN = _Forgotten()
Answer = int | Stored | Deleted
"""An increment's sum, a swap's or a set's digest, a deletion's count."""
Call = tuple[str, str, str]
"""(client uid, request id, key): a request id names a call on one key; the same id on another key is another call."""


def cost(call: Call, stored: int) -> int:
    """What remembering a call counts against ``--max-answer-bytes`` (``stored``: the bytes of the value its journal
    entry keeps)."""
    return sum(len(part.encode()) for part in call) + stored + ANSWER_OVERHEAD_BYTES


class RetryAnswers:
    """The answers of the newest calls within ``answer_bytes``; of each caller, the newest ``answers_per_caller``."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.answers: dict[str, dict[tuple[str, str], Answer]] = {}
        """Client uid -> (request id, key) -> its answer, oldest first."""
        self._calls: dict[Call, int] = {}  # every call remembered, answered or marked, oldest first -> its cost
        self.held = 0
        """Bytes remembered, as ``--max-answer-bytes`` counts them."""

    def get(self, client_uid: str, request_id: str, key: str) -> Answer | _Forgotten | None:
        """The answer given to this call before; FORGOTTEN when the call is remembered only as a mark; None if it is
        not remembered at all (a new call, or one older than every call the bytes allow)."""
        answer = self.answers.get(client_uid, {}).get((request_id, key))
        if answer is None and (client_uid, request_id, key) in self._calls:
            return FORGOTTEN
        return answer

    def remember(self, client_uid: str, request_id: str, key: str, answer: Answer, stored: int) -> None:
        """Keeps ``answer`` for retries of ``request_id`` on ``key`` (nothing without a request id; ``stored``: the
        bytes of the value its journal entry keeps), forgetting the oldest answers past the bounds."""
        if not request_id:
            return
        call = (client_uid, request_id, key)
        if call in self._calls:  # only a journal written before calls were refused this: the newest counts
            self._drop(call)
        done = self.answers.setdefault(client_uid, {})
        done[(request_id, key)] = answer
        self._calls[call] = spent = cost(call, stored)
        self.held += spent
        if len(done) > self.limits.answers_per_caller:
            del done[next(iter(done))]  # a mark now: its cost stays counted
        while self.held > self.limits.answer_bytes and len(self._calls) > 1:
            self._drop(next(iter(self._calls)))

    def _drop(self, call: Call) -> None:
        self.held -= self._calls.pop(call)
        client_uid, request_id, key = call
        done = self.answers.get(client_uid, {})
        done.pop((request_id, key), None)
        if not done:
            self.answers.pop(client_uid, None)

    def calls(self) -> list[Call]:
        """Every call remembered (answered or marked), oldest first."""
        return list(self._calls)
