"""Liveness: which processes something vouches for, which are on the clock, and which are down. No I/O.

A process is alive while it holds a session (its connection's keepalive vouches for it: a silent peer's connection
is dropped, which ends the session) or waits in a Register call; otherwise it is on the clock, and is failed
(forgotten, before publication) once silent beyond its grace. A session that sends Heartbeats and stops for
``hung_after_s`` while its connection stays up (keepalive is answered by gRPC's own threads: a process deadlocked
holding Python's GIL) fails its process too:

    attended (call or session) ──(last one ends)──▶ on the clock ──(silent beyond its grace)──▶ overdue
            ▲                                            │
            └──────────(a call or session arrives)───────┘
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.cluster import ClusterConfig
from coordinator.members import Member, Status


@dataclass(frozen=True)
class Overdue:
    """A live process silent beyond its grace: the router fails it (forgets it, before publication)."""

    member: Member
    silent_s: float
    grace_s: float
    stopped_answering: bool = False
    """Its session had sent no Heartbeat for a while when its connection was dropped: it hung, not its network."""
    hung: bool = False
    """Its session is still connected but sent no Heartbeat for ``silent_s`` (beyond ``grace_s``)."""

    @property
    def why(self) -> str:
        if self.hung:
            return (f"stopped answering: no heartbeat for {self.silent_s:.1f}s while its connection stayed up (more "
                    f"than {self.grace_s:g}s, --hung-timeouts): hung, e.g. deadlocked holding Python's GIL")
        if self.member.status is Status.JOINING:
            return f"went silent for {self.silent_s:.1f}s before the topology was published"
        if self.stopped_answering:
            return (f"stopped answering (no heartbeat for {self.member.quiet_s:.1f}s, then its connection was "
                    f"dropped: hung, or its host cut off) and did not come back within {self.grace_s:g}s")
        return f"lost its connection and did not come back within {self.grace_s:g}s"


class Liveness:
    """The clock of every live process nothing vouches for, and why each unavailable process id is down."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.down: dict[int, str] = {}  # process id -> why it is unavailable (failed or left)
        # Live processes that neither hold a session nor wait in a call, oldest first: the only ones the tick looks
        # at (keepalive vouches for the others), so an idle cluster's tick costs nothing per process.
        self._unattended: dict[str, None] = {}
        self._last_arrival = -math.inf  # when the latest Register call or session arrived
        self._heard: dict[str, None] = {}  # processes whose sessions send Heartbeats, least recently heard first

    def track(self, member: Member) -> None:
        """A new registration or incarnation: on the clock until a call or a session vouches for it."""
        self._start_clock(member, None)

    def call_started(self, member: Member | None, now: float) -> None:
        """A Register call is in flight (its process, when known, is alive while it waits on us)."""
        self._last_arrival = now
        if member is not None:
            member.calls += 1
            self._vouched(member, now)

    def call_ended(self, member: Member, now: float) -> None:
        """The call answered: without a session, the process has the heartbeat timeout to call or attach again."""
        member.calls = max(0, member.calls - 1)
        if member.status is Status.ALIVE and not member.sessions and member.registration.opens_session:
            member.attaching = True  # answered with the topology: its session is on its way
        self._released(member, now, None)

    def attached(self, member: Member, now: float) -> None:
        """A session opened: its connection's keepalive vouches for the process from now on."""
        self._last_arrival = now
        member.sessions += 1
        member.attaching = False
        member.heard_at, member.quiet_s = None, 0.0
        self._vouched(member, now)

    def heard(self, member: Member, now: float) -> None:
        """A session's Heartbeat: the process answers. A quiet session is shown slow, and failed only after
        ``hung_after_s``; a session that never sent one is judged by its connection's keepalive alone."""
        member.heard_at = now
        self._heard.pop(member.uid, None)  # re-added last: the dict stays ordered by when each was last heard
        self._heard[member.uid] = None

    def detached(self, member: Member, now: float) -> None:
        """A session ended: unless another session or a call vouches for it, the reconnect grace starts."""
        member.sessions = max(0, member.sessions - 1)
        if not member.sessions and member.heard_at is not None:
            member.quiet_s = now - member.heard_at
        self._released(member, now, self.config.reconnect_grace_s)

    def _vouched(self, member: Member, now: float) -> None:
        member.last_seen = now
        self._unattended.pop(member.uid, None)

    def _released(self, member: Member, now: float, grace_s: float | None) -> None:
        member.last_seen = now
        if not member.attended:
            self._start_clock(member, grace_s)

    def reset(self, members: Iterable[Member], now: float) -> None:
        """After a replay: nobody is attached yet, and every live process has the grace period from ``now``."""
        self._unattended, self._heard = {}, {}
        for member in members:
            member.calls = member.sessions = 0
            member.attaching = False  # what this coordinator did not answer itself it does not vouch for
            member.last_seen, member.grace_s = now, None
            if member.live:
                self._unattended[member.uid] = None

    def overdue(self, now: float, members: Mapping[str, Member]) -> list[Overdue]:
        """The processes on the clock silent beyond their grace, in the order they went silent (not by hashing).

        While Register calls and sessions keep arriving (a burst: thousands attaching after publication or a
        restart), a late one may be waiting in the coordinator's own queue, so nobody is overdue until the burst
        is over or they have been silent for ``catching_up_limit_s``."""
        config = self.config
        catching_up = now - self._last_arrival < config.catching_up_s
        found = []
        for uid in list(self._unattended):
            member = members.get(uid)
            if member is None or member.attended or not member.live:
                del self._unattended[uid]  # forgotten, failed, left or replaced meanwhile
                continue
            silent = now - member.last_seen
            grace = config.heartbeat_timeout_s if member.grace_s is None else member.grace_s
            if silent <= grace or (catching_up and silent <= config.catching_up_limit_s):
                continue
            del self._unattended[uid]
            found.append(Overdue(member, silent, grace, member.quiet_s > config.unanswered_after_s))
        return found + self._hung(now, members, catching_up)

    def _hung(self, now: float, members: Mapping[str, Member], catching_up: bool) -> list[Overdue]:
        """The connected processes whose Heartbeats stopped ``hung_after_s`` ago, oldest first: the scan stops at
        the first one heard since, so a tick costs nothing per healthy process."""
        limit, found = self.config.hung_after_s, []
        for uid in list(self._heard) if limit > 0 else ():
            member = members.get(uid)
            if member is None or not member.live or not member.sessions or member.heard_at is None:
                del self._heard[uid]  # gone, failed, detached or attached again since: heard afresh, if at all
                continue
            silent = now - member.heard_at
            if silent <= limit or (catching_up and silent <= self.config.catching_up_limit_s):
                break
            del self._heard[uid]
            found.append(Overdue(member, silent, limit, hung=True))
        return found

    def fail(self, member: Member, process_id: int, why: str) -> bool:
        """Marks the process failed; returns whether a session of it is open (to be evicted)."""
        member.status, member.reason = Status.FAILED, why
        self.down[process_id] = f"failed: {why}"
        return member.sessions > 0

    def leave(self, member: Member, process_id: int) -> None:
        """Marks the process as left."""
        member.status, member.reason = Status.LEFT, "left"
        self.down[process_id] = "left"

    def restarted(self, member: Member, process_id: int) -> None:
        """A new incarnation holds ``process_id``: it is up again, on the clock until it calls or attaches."""
        self.down.pop(process_id, None)
        self.track(member)

    def _start_clock(self, member: Member, grace_s: float | None) -> None:
        member.grace_s = grace_s
        self._unattended.pop(member.uid, None)  # re-added last: the dict stays ordered by when each went silent
        self._unattended[member.uid] = None
