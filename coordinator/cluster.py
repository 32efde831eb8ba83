"""What the operator fixed for one cluster: the pure state machine's configuration (no server or gRPC settings)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.limits import DEFAULT_LIMITS, Limits
from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_PROCESSES
from ifrt.protocol import SLOW_SHARE

# Liveness rides on each connection's HTTP/2 keepalive (CoordinatorConfig.keepalive_options). A process that goes
# silent is noticed at most ping interval + ping timeout later (its connection is dropped and its session ends), then
# has the reconnect grace to attach again: the three shares add up to the heartbeat timeout. Pings are what an idle
# session costs, so the interval takes the largest share; a killed process's connection closes at once, so it is
# reported after the grace alone.
PING_INTERVAL_SHARE = 1 / 2
"""The keepalive ping interval, as a share of the heartbeat timeout: twice per timeout."""
PING_TIMEOUT_SHARE = 3 / 8
"""How long a ping may go unanswered, as a share of the heartbeat timeout: long enough that a peer whose gRPC core
is slow to answer (a host busy with a registration storm) keeps its session."""


HEARTBEAT_SHARE = 1 / 5
"""How often a session sends a Heartbeat, as a share of the heartbeat timeout. The keepalive pings decide liveness:
heartbeats show a process that stopped answering as slow before its connection is dropped, and fail one whose
connection stays up without them for ``hung_timeouts`` (a deadlock holding Python's GIL)."""


class FailurePolicy(enum.StrEnum):
    PROPAGATE = "propagate"
    """A failed process is reported to all others; the topology stays as it is."""
    ELASTIC = "elastic"
    """A failed process is dropped and a new generation over the survivors is published (down to a minimum)."""


@dataclass(frozen=True)
class ClusterConfig:
    """What the operator fixed for this cluster, and the waiting rules the state machine applies."""

    num_processes: int
    cluster_id: str = "default"
    max_processes: int = MAX_PROCESSES
    """Exclusive bound on process ids (2**14 keeps every global id within int32)."""
    heartbeat_timeout_s: float = 10.0
    """A process silent this long (its connection's keepalive pings unanswered, or its session ended and it did not
    attach again) is failed; before publication, its registration is forgotten."""
    on_failure: FailurePolicy = FailurePolicy.PROPAGATE
    max_heartbeat_rate: float = 512.0
    """Heartbeats a second the sessions of the whole job may send: each costs the coordinator about 0.1-0.3 ms of
    CPU, so past ``max_heartbeat_rate * heartbeat_timeout_s * HEARTBEAT_SHARE`` processes (1,024 at the defaults)
    they are spaced further apart, and a process that stops answering shows as slow later."""
    hung_timeouts: float = 3.0
    """A process whose session stays connected but sends no Heartbeat for this many heartbeat timeouts (or as many
    heartbeat intervals, where they are spaced further) is failed: it hung with its connection answered (a deadlock
    holding Python's GIL leaves gRPC's keepalive running). 0: never, such a process is only shown slow."""
    min_processes: int = 1
    """With the elastic policy, or a shrink: fewest processes a new generation may have."""
    shrink: bool = False
    """A replace-mode job may shrink to its survivors (``coordinator.shrink``; the operator gave --min-processes)."""
    limits: Limits = DEFAULT_LIMITS
    """What callers may send: sizes and counts of requests, registrations, key-values and barrier names."""
    allow_mixed_platforms: bool = False
    """Whether processes with different device plugins or platforms may form one cluster."""
    attempt: int = 0
    """The job attempt this state serves: ``--attempt`` at first, then each one NextAttempt starts (the state of a
    new attempt is built with it); a process of another attempt is refused."""
    max_restarts: int | None = None
    """The job's restart budget (``--max-restarts``); None: the first ``ifrt run`` agent of each run of the job states
    it (``ifrt run --max-restarts``), 0 if none does."""
    max_wait_s: float = 30.0
    """Longest one Register or KeyValueGet call is held open; clients call again after it."""
    stall_slack_s: float = 5.0
    """How much longer than its own timeout a call resolved by the tick (barrier, agreement, preemption sync) waits:
    only a stall of the tick needs it."""
    progress_cache_s: float = 1.0
    """A progress answer is reused this long while nobody new registers (thousands may ask at once)..."""
    progress_refresh_s: float = 0.1
    """...and this long while registrations still arrive, so its count lags by at most this much."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_processes <= self.max_processes:
            raise InvalidArgument(f"num_processes {self.num_processes} is out of range: expected 1 <= num_processes "
                                  f"<= {self.max_processes}")
        if not 1 <= self.min_processes <= self.num_processes:
            raise InvalidArgument(f"min_processes {self.min_processes} is out of range: expected 1 <= min_processes "
                                  f"<= num_processes ({self.num_processes})")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise InvalidArgument(f"--max-restarts {self.max_restarts} is out of range: expected an integer >= 0")
        if not self.heartbeat_timeout_s > 0:
            raise InvalidArgument(f"heartbeat timeout {self.heartbeat_timeout_s} is not positive: expected seconds > 0")
        if not self.hung_timeouts >= 0:
            raise InvalidArgument(f"--hung-timeouts {self.hung_timeouts} is negative: expected a number of heartbeat "
                                  "timeouts >= 0 (0: never)")
        if not self.max_heartbeat_rate > 0:
            raise InvalidArgument(f"--max-heartbeat-rate {self.max_heartbeat_rate} is not positive: expected "
                                  "heartbeats a second > 0")

    @property
    def heartbeat_interval_s(self) -> float:
        """How often each session sends a Heartbeat: HEARTBEAT_SHARE of the heartbeat timeout, or as spaced as
        ``max_heartbeat_rate`` asks for this job's processes."""
        return max(self.heartbeat_timeout_s * HEARTBEAT_SHARE, self.num_processes / self.max_heartbeat_rate)

    @property
    def unanswered_after_s(self) -> float:
        """A session quiet this long (one and a half heartbeat intervals) missed a heartbeat: if its connection is
        dropped then, the process stopped answering (a healthy one's connection lost is never this quiet)."""
        return 1.5 * self.heartbeat_interval_s

    @property
    def slow_after_s(self) -> float:
        """A session quiet this long (no Heartbeat) shows its process as slow: SLOW_SHARE of the timeout, or
        ``unanswered_after_s`` where heartbeats are spaced further."""
        return max(self.heartbeat_timeout_s * SLOW_SHARE, self.unanswered_after_s)

    @property
    def hung_after_s(self) -> float:
        """A connected session that sent no Heartbeat for this long is failed (0: never); see ``hung_timeouts``."""
        return self.hung_timeouts * max(self.heartbeat_timeout_s, self.heartbeat_interval_s)

    @property
    def reconnect_grace_s(self) -> float:
        """How long a process whose session ended has to attach again before it is failed: what the timeout leaves
        (1/8 of it) once a dropped connection was noticed, so a silent process is failed within the timeout. A
        client re-attaches within about 0.1 s of its connection closing."""
        return self.heartbeat_timeout_s * (1 - PING_INTERVAL_SHARE - PING_TIMEOUT_SHARE)

    @property
    def catching_up_s(self) -> float:
        """How recently a Register call or a session must have arrived for the coordinator to count itself as still
        working through a burst of them (see Liveness.overdue)."""
        return min(1.0, self.heartbeat_timeout_s / 10)

    @property
    def catching_up_limit_s(self) -> float:
        """The longest a silent process is spared while the coordinator catches up: three timeouts."""
        return 3 * self.heartbeat_timeout_s
