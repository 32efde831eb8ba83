"""What a waiting process says about its wait: through the program's logging where it set any up, else on stderr.

A program that configures no logging still hears within seconds what it waits for (Python's own fallback shows
only warnings); one that does gets each line once, through its own handlers and levels.
"""

from __future__ import annotations

import logging
import sys
import time

from ifrt.safe_text import safe

log = logging.getLogger("ifrt.wait")
"""Every line about a wait: a coordinator out of reach or standing by, peers not registered, a runtime's start-up."""


def say(level: int, message: str, *args: object) -> None:
    """One line about a wait: logged where the program has a handler for it, else written to stderr."""
    if log.hasHandlers():
        log.log(level, message, *args)
        return
    try:
        sys.stderr.write(f"ifrt: {safe(message % args if args else message)}\n")  # peers' hosts: one line
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: nobody to tell
        pass


class Pacer:
    """When the next line about one wait is due: ``first_s`` after it began, then every ``every_s``."""

    def __init__(self, first_s: float, every_s: float, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self.every_s = every_s
        self._next = self.start + first_s

    def due(self, now: float | None = None) -> bool:
        """Whether a line is due now (and if so, the next one is ``every_s`` away)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return False
        self._next = now + self.every_s
        return True

    def waited(self, now: float | None = None) -> float:
        """Seconds since the wait began."""
        return (time.monotonic() if now is None else now) - self.start
