"""The answers of increments and swaps, kept per client and request id, so that a retried call is answered as its
first call was instead of being applied twice. No I/O."""

from __future__ import annotations

ANSWERS_REMEMBERED = 64
"""Increments and swaps remembered per client for its retries (a client retries only its calls in flight)."""
AGENTS_REMEMBERED = 1024
"""Callers that are no process (torchrun's agents) whose increments and swaps are remembered for retries (the oldest
is forgotten past this)."""


class RetryAnswers:
    """Each client's last ``ANSWERS_REMEMBERED`` answers by request id; of callers that are no process, only the
    ``AGENTS_REMEMBERED`` most recently answered are kept (any number of them could come)."""

    def __init__(self) -> None:
        self.answers: dict[str, dict[str, int | bytes]] = {}  # client uid -> request id -> its answer (sum, value)
        self._agents: dict[str, None] = {}  # callers that are no process, least recently answered first

    def get(self, client_uid: str, request_id: str) -> int | bytes | None:
        """The answer given to this request before, None if none is remembered."""
        return self.answers.get(client_uid, {}).get(request_id)

    def remember(self, client_uid: str, request_id: str, answer: int | bytes, *, agent: bool) -> None:
        """Keeps ``answer`` for retries of ``request_id`` (nothing without one); ``agent``: the caller is no process."""
        if not request_id:
            return
        done = self.answers.setdefault(client_uid, {})
        done[request_id] = answer
        if len(done) > ANSWERS_REMEMBERED:
            del done[next(iter(done))]  # the oldest: its caller has long moved on
        if agent:
            self._agents.pop(client_uid, None)
            self._agents[client_uid] = None
            if len(self._agents) > AGENTS_REMEMBERED:
                oldest = next(iter(self._agents))
                del self._agents[oldest]
                self.answers.pop(oldest, None)
