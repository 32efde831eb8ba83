"""One process incarnation as the coordinator holds it: its registration, its phase and its liveness."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from coordinator.core.registration import Registration


class Status(enum.Enum):
    JOINING = "joining"
    ALIVE = "alive"
    FAILED = "failed"
    LEFT = "left"


@dataclass
class Member:
    """One process incarnation: its registration and its liveness."""

    registration: Registration
    status: Status
    last_seen: float
    incarnation: int = 0
    calls: int = 0  # Register calls in flight: the process is waiting on us, so it is alive
    sessions: int = 0  # open session streams (two overlap briefly when a client reconnects); keepalive vouches for each
    reason: str = ""
    grace_s: float | None = None  # how long it may stay silent without a call or session; None: the heartbeat timeout
    replaced: bool = False  # a newer incarnation holds its claim: only what answers its client is kept (see ``retire``)
    heard_at: float | None = None  # its session's last Heartbeat (None: none since it attached, as from a client
    # that predates them): a session quiet past ClusterConfig.slow_after_s shows its process as slow
    attaching: bool = False  # answered with the topology by this coordinator, its session not attached yet
    quiet_s: float = 0.0  # how long its session had been quiet when the last one ended: a dropped connection after
    # that long means the process stopped answering, not that its connection was lost
    silenced: bool = False  # its last session ended quiet (or never sent Heartbeats): dropped for silence, as far as
    # the coordinator can tell, not closed by a process that answered until then (ClusterConfig.grace_after_session)
    attached_at: float = 0.0  # when its latest session attached
    recovered_at: float | None = None  # when it was last heard again after a silence (a Heartbeat after a gap, or a
    # session attached after one dropped for silence): a connection that closes soon after is a flapping link's

    @property
    def uid(self) -> str:
        return self.registration.client_uid

    @property
    def live(self) -> bool:
        """Joining or alive: neither failed nor gone."""
        return self.status in (Status.JOINING, Status.ALIVE)

    @property
    def attended(self) -> bool:
        """A call waits on us or a session is open: something vouches that it is alive."""
        return bool(self.calls or self.sessions)


def retire(member: Member) -> None:
    """Keeps of an incarnation that a newer one replaced only what answers its client (who it was, its secret's hash,
    why it ended): its devices and request, up to --max-request-bytes, go (the journal keeps the request)."""
    member.registration = replace(member.registration, devices=(), request=b"")
    member.replaced = True


def claim_of(r: Registration) -> object:
    """What a registration holds: its explicit process id, or its stable key when ids are assigned."""
    return r.process_id if r.process_id is not None else r.stable_key
