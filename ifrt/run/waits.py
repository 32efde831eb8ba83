"""What a survivor's agent waits for with ``--recover replace``: the failed processes of other hosts, until they are
replaced, taken over by a spare host, or their agent comes back; it says every ``WAIT_SAID_S`` which hosts it waits
for, and gives up after ``--replace-timeout`` (the agent then asks the coordinator to shrink the job to its
survivors, and where it refuses, the job ends as without replace). No clock here: ``now`` comes in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

WAIT_SAID_S = 2.0
"""How often an agent says which host it waits for."""


class _Failure(Protocol):
    @property
    def attempt(self) -> int: ...
    @property
    def process_id(self) -> int: ...
    @property
    def host(self) -> str: ...


Failure = TypeVar("Failure", bound=_Failure)


@dataclass
class HostWaits(Generic[Failure]):
    """Other hosts' failed processes by id, each with when its wait began."""

    timeout: float
    _waits: dict[int, tuple[Failure, float]] = field(default_factory=dict)
    _said_at: float = 0.0

    def add(self, failure: Failure, now: float) -> None:
        self._waits.setdefault(failure.process_id, (failure, now))

    def done(self, process_ids: set[int]) -> None:
        """These ids are replaced or taken over: no longer waited for."""
        for pid in process_ids:
            self._waits.pop(pid, None)

    def back(self, host: str) -> bool:
        """``host``'s agent came back: its processes are no longer waited for; whether any were."""
        gone = {pid for pid, (f, _) in self._waits.items() if f.host == host}
        self.done(gone)
        return bool(gone)

    def check(self, attempt: int | None, now: float) -> tuple[str | None, list[Failure]]:
        """What to say now (None: nothing), and once the timeout passed the failures given up on, the first one
        first (empty: none)."""
        self._waits = {pid: w for pid, w in self._waits.items() if w[0].attempt == attempt}
        if not self._waits:
            return None, []
        first, since = min(self._waits.values(), key=lambda w: w[1])
        hosts: dict[str, list[int]] = {}
        for pid, (f, _) in sorted(self._waits.items()):
            hosts.setdefault(f.host or "an unknown host", []).append(pid)
        waited = ", ".join(f"host {host} (processes {', '.join(map(str, pids))})" for host, pids in hosts.items())
        if now - since >= self.timeout:
            given_up = [first, *(f for pid, (f, _) in sorted(self._waits.items()) if f is not first)]
            self._waits.clear()
            return (f"waited {self.timeout:g}s for {waited}: no replacement, no spare host, its agent did not come "
                    "back (--replace-timeout)"), given_up
        if now - since < WAIT_SAID_S or now - self._said_at < WAIT_SAID_S:
            return None, []
        self._said_at = now
        return (f"waiting for {waited}: its replacement, a spare host (ifrt run --spare-host) or its agent's return, "
                f"for {self.timeout - (now - since):.0f}s more (--replace-timeout)"), []
