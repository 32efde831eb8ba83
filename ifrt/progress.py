"""Registration progress: who has registered and who is missing, as the coordinator saw it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Who has registered and who is missing, for logs, progress answers and timeout errors."""

    registered: int
    expected: int
    missing_process_ids: tuple[int, ...]
    registered_hosts: tuple[str, ...]
    waited_seconds: float

    def describe(self, max_listed: int = 8) -> str:
        """``3/4 processes registered; missing process ids [2]; registered hosts: a, b, c; waited 4.0s``."""
        missing = self.expected - self.registered
        parts = [f"{self.registered}/{self.expected} processes registered"]
        if self.missing_process_ids:
            parts.append(f"missing process ids {_listing(self.missing_process_ids, max_listed)}")
        elif missing:
            parts.append(f"{missing} more process{'es' if missing > 1 else ''} expected")
        if self.registered_hosts:
            parts.append(f"registered hosts: {_listing(self.registered_hosts, max_listed)}")
        parts.append(f"waited {self.waited_seconds:.1f}s")
        return "; ".join(parts)


def _listing(items: tuple, max_listed: int) -> str:
    shown = ", ".join(str(i) for i in items[:max_listed])
    more = len(items) - max_listed
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"
