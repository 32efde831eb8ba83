"""Answers built and not yet read by their callers, bounded in bytes over all calls: a caller that asks for large
answers (KeyValueDir listings, 1 MiB values) and never reads them cannot make the coordinator hold one per call it
opens. Small answers are not counted (each costs a few bytes more than its call already does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from coordinator.core.limits import exhausted

COUNTED_BYTES = 64 << 10
"""Answers from this size on count against ``--max-pending-reply-bytes``."""


class _Call(Protocol):
    def add_done_callback(self, callback: Callable[[object], None]) -> object: ...


class PendingReplies:
    """The bytes of large answers handed to gRPC whose calls have not ended (their callers have not read them)."""

    def __init__(self, most_bytes: int) -> None:
        self.most = most_bytes
        self.held = 0

    def hold(self, answer: bytes, call: _Call, what: str) -> bytes:
        """``answer``, counted until ``call`` ends; ResourceExhausted (nothing counted) when it does not fit."""
        size = len(answer)
        if size < COUNTED_BYTES:
            return answer
        if self.held + size > self.most:
            raise exhausted(f"the answer to {what} ({size} bytes)", self.most, "pending_reply_bytes",
                            "answers not yet read by their callers hold the rest; try again once they are read, "
                            "or raise the flag", self.held)
        self.held += size
        call.add_done_callback(lambda _: self._release(size))
        return answer

    def _release(self, size: int) -> None:
        self.held -= size
