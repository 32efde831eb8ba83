"""Repeated warnings, counted instead of written: a caller who sends a thousand bad messages costs one log line
per kind and interval, plus a summary of how many were held back, not a thousand lines.

    noisy = Throttled(log, interval=60.0)
    noisy.warning("stranger", "refused a transfer connection from %s: %s", peer, why)

The first record of a kind in an interval is written; the others in that interval are counted, and the next one
written after it says how many were held back ("... (37 more like this in the last 60s)"). ``flush()`` writes the
pending counts (at shutdown, or from a periodic task) so no count is lost when the noise stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 60.0
MAX_KINDS = 256
"""Kinds are the caller's own constants (never text from a peer); past this many, the oldest are forgotten."""


class Throttled:
    """A logger wrapper that writes at most one record per kind and interval and counts the others."""

    def __init__(self, logger: logging.Logger, interval: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # kind -> [time last written, records held back since, level]

    def log(self, level: int, kind: str, msg: str, *args: object) -> bool:
        """Writes the record unless one of the same ``kind`` was written less than ``interval`` ago (then counts
        it); returns whether it was written."""
        now = self._clock()
        with self._lock:
            entry = self._kinds.get(kind)
            if entry is not None and now - entry[0] < self.interval:
                entry[1] += 1
                return False
            held = entry[1] if entry is not None else 0
            self._kinds.pop(kind, None)
            self._kinds[kind] = [now, 0, level]
            while len(self._kinds) > MAX_KINDS:
                del self._kinds[next(iter(self._kinds))]
        if held:
            msg += f" ({held} more like this in the last {self.interval:g}s)"
        self.logger.log(level, msg, *args)
        return True

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """``log(WARNING, ...)``."""
        return self.log(logging.WARNING, kind, msg, *args)

    def held_back(self, kind: str) -> int:
        """How many records of ``kind`` are counted but not yet reported."""
        with self._lock:
            entry = self._kinds.get(kind)
            return entry[1] if entry is not None else 0

    def flush(self) -> None:
        """Writes one summary line per kind with records held back, and resets their counts."""
        with self._lock:
            pending = [(kind, entry[1], entry[2]) for kind, entry in self._kinds.items() if entry[1]]
            for kind, _, _ in pending:
                self._kinds[kind][1] = 0
        for kind, held, level in pending:
            self.logger.log(level, "%d more %s records held back in the last %gs", held, kind, self.interval)
