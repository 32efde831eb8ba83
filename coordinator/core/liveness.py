"""Liveness: which processes something vouches for, which are on the clock, and which are down. No I/O.

A process is alive while it holds a session (its connection's keepalive vouches for it: a silent peer's connection
is dropped, which ends the session) or waits in a Register call; otherwise it is on the clock, and is failed
(forgotten, before publication) once silent beyond its grace. A session that ended quiet (dropped for silence) gives
its process what the heartbeat timeout leaves of its silence; one that closed while its process answered (a kill) the
short reconnect grace (``ClusterConfig.grace_after_session``). A session that sends Heartbeats and stops for
``hung_after_s`` while its connection stays up (keepalive is answered by gRPC's own threads: a process deadlocked
holding Python's GIL) fails its process too.

Partitions are faults too: when most of the job goes silent at once, the leader suspects itself first
(``mass_silence``): nothing is failed on that evidence, and the shell steps aside for a replica the processes reach.
Only a process this leader heard from (attached, or called) since it took over counts toward that suspicion, so a
replica that leads again after standing aside, or that took over, declares processes that never come back after
its grace, as after any failover: the suspicion cannot defer a real failure more than once.

    attended (call or session) ──(last one ends)──▶ on the clock ──(silent beyond its grace)──▶ overdue
            ▲                                            │
            └──────────(a call or session arrives)───────┘
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.core.cluster import SUSPECT_SHARE, ClusterConfig
from coordinator.core.members import Member, Status


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
    silenced: bool = False
    """Its session ended quiet, or sent no Heartbeats to tell: dropped for silence as far as the coordinator can tell,
    not closed by a process answering until then."""

    @property
    def by_silence(self) -> bool:
        """Lost by silence (a dropped connection, or a hang), not by a connection its process closed."""
        return self.silenced or self.hung

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
        if member.silenced:  # back after a silence: its link may still be flapping (see ``detached``)
            member.recovered_at = now
        member.sessions += 1
        member.attaching = False
        member.attached_at = now
        member.heard_at, member.quiet_s, member.silenced = None, 0.0, False
        self._vouched(member, now)

    def heard(self, member: Member, now: float) -> None:
        """A session's Heartbeat: the process answers. A quiet session is shown slow, and failed only after
        ``hung_after_s``; a session that never sent one is judged by its connection's keepalive alone. One heard
        again after a gap (its link was silent, then came back) is recovering from a silence for a while."""
        if member.heard_at is not None and now - member.heard_at > self.config.unanswered_after_s:
            member.recovered_at = now  # a Heartbeat missed: its link (or the process) was silent, and is back
        member.heard_at = now
        self._heard.pop(member.uid, None)  # re-added last: the dict stays ordered by when each was last heard
        self._heard[member.uid] = None

    def detached(self, member: Member, now: float, *, carried: bool = False) -> None:
        """A session ended: unless another session or a call vouches for it, its grace starts: the reconnect grace
        after a close, what the heartbeat timeout leaves of its silence after a drop (see ``grace_after_session``).
        ``carried``: it was carried on an agent's host session, which ended: Heartbeats do not cross it, so whether
        it closed or went silent is unknown, and silence is assumed. A session of its own without a Heartbeat yet is
        taken as silent since it attached if it ends within a keepalive drop's time of attaching, else (a client that
        predates Heartbeats) judged by its connection alone: as a close. A close within a
        heartbeat timeout of recovering from a silence is a flapping link's (its client gave up the connection
        during the outage), not a kill: it is judged as a silence that ended at its last Heartbeat."""
        member.sessions = max(0, member.sessions - 1)
        if member.sessions:
            self._released(member, now, None)  # still attended: no clock starts
            return
        config = self.config
        if member.heard_at is not None:
            quiet: float | None = now - member.heard_at
        elif carried:
            quiet = None
        elif now - member.attached_at <= config.keepalive_interval_s + config.keepalive_timeout_s:
            # no Heartbeat yet, though a client sends its first on attach: silent since it attached (a session ending
            # this soon may be a keepalive drop of one silent from the start), unless that was only just now
            quiet = now - member.attached_at
        else:
            quiet = 0.0  # none for longer than a drop takes: a client that predates Heartbeats (a close)
        flapping = member.recovered_at is not None and now - member.recovered_at <= config.heartbeat_timeout_s
        member.quiet_s = quiet or 0.0
        member.silenced = quiet is None or quiet > config.answering_within_s or flapping
        self._released(member, now, config.grace_after_session(quiet, flapping=flapping))

    def _vouched(self, member: Member, now: float) -> None:
        member.last_seen = now
        member.silenced = False
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
            member.last_seen, member.grace_s, member.silenced, member.recovered_at = now, None, False, None
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
            stopped = member.heard_at is not None and member.quiet_s > config.answering_within_s
            found.append(Overdue(member, silent, grace, stopped, silenced=member.silenced))
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

    def mass_silence(self, found: Sequence[Overdue], members: Mapping[str, Member]) -> str | None:
        """Why this leader should suspect itself rather than the job, or None: some of ``found`` (the overdue
        processes of this tick) were lost by silence, and they with the processes whose sessions were dropped for
        silence and are still on the clock are at least two and more than ``SUSPECT_SHARE`` of the published live
        processes: most of the job went silent at once, which is what this leader's own partition looks like."""
        if not any(o.by_silence and o.member.status is Status.ALIVE for o in found):
            return None
        silent = {o.member.uid for o in found if o.by_silence and o.member.status is Status.ALIVE}
        silent.update(uid for uid in self._unattended
                      if (m := members.get(uid)) is not None and m.silenced and m.status is Status.ALIVE
                      and not m.attended)
        alive = sum(1 for m in members.values() if m.status is Status.ALIVE)
        if len(silent) < 2 or len(silent) <= SUSPECT_SHARE * alive:
            return None
        return (f"{len(silent)} of the job's {alive} live processes went silent at once (their connections dropped "
                f"unanswered, or their heartbeats stopped): more likely this coordinator's own partition than theirs")

    def spare(self, found: Sequence[Overdue]) -> None:
        """Puts overdue processes back as they were (on the clock, or watched for heartbeats): none is failed on the
        evidence of a mass silence (see ``mass_silence``); a tick finds them again if nothing changes."""
        hung = {o.member.uid: None for o in found if o.hung}
        self._heard = {**hung, **self._heard}  # the oldest heard first, as the scan expects
        for o in found:
            if not o.hung:
                self._unattended[o.member.uid] = None

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
