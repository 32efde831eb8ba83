"""What the operator fixed for one cluster: the pure state machine's configuration (no server or gRPC settings)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from coordinator.core.limits import DEFAULT_LIMITS, Limits
from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_PROCESSES
from ifrt.protocol import SLOW_SHARE

# Liveness rides on each connection's HTTP/2 keepalive (CoordinatorConfig.keepalive_options) and on the sessions'
# Heartbeats. The heartbeat timeout is the tolerance: a process is declared failed only once the coordinator has heard
# nothing from it (no Heartbeat, no answered ping, no open session) for longer than the timeout. A connection that
# goes silent is dropped by keepalive (its ping unanswered for the ping timeout), which proves silence since at most
# ``keepalive_timeout_s`` before the drop; the process then has what the timeout leaves to attach again. A connection
# that closes while its process was answering (a killed process: its kernel closes the socket at once) is no silence:
# it has the short reconnect grace, so kills are still reported fast. See ``ClusterConfig.grace_after_session``.
PING_INTERVAL_SHARE = 1 / 4
"""The keepalive ping interval, as a share of the heartbeat timeout: four times per timeout. The ping that finds a
silence is sent within this long of its start, so a silent process is failed at most this much after the timeout."""
PING_TIMEOUT_SHARE = 1 / 2
"""How long a ping may go unanswered, as a share of the heartbeat timeout: long enough that a peer whose gRPC core
is slow to answer (a host busy with a registration storm) keeps its session. A drop costs nothing by itself (the
process has the rest of the timeout to attach again), so a longer wait only shows a silent process as slow longer."""
RECONNECT_GRACE_SHARE = 1 / 8
"""How long a process whose connection closed while it was answering has to attach again, as a share of the
heartbeat timeout: a client re-attaches within about 0.1 s of its connection closing; a killed one never does."""
SUSPECT_SHARE = 1 / 2
"""A leader that loses more than this share of the job's live processes by silence at once suspects itself (its own
partition) before the job: it steps aside instead of declaring them failed (see ``coordinator.core.liveness``)."""


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
    """The silence a process is allowed: one the coordinator has heard nothing from for longer (no Heartbeat, no
    answered keepalive ping, no open session or call) is failed; before publication, its registration is forgotten.
    Never sooner; a silent one is failed within ``PING_INTERVAL_SHARE`` of the timeout more (plus a tick). A process
    whose connection closed while it answered (killed) is failed after the reconnect grace alone."""
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
    """A replace-mode job may shrink to its survivors (``coordinator.core.shrink``; the operator gave
    --min-processes)."""
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
    def keepalive_interval_s(self) -> float:
        """How often the coordinator pings each connection (HTTP/2 keepalive): four times per heartbeat timeout."""
        return self.heartbeat_timeout_s * PING_INTERVAL_SHARE

    @property
    def keepalive_timeout_s(self) -> float:
        """How long a ping may go unanswered before the coordinator drops the connection (ending its session)."""
        return self.heartbeat_timeout_s * PING_TIMEOUT_SHARE

    @property
    def reconnect_grace_s(self) -> float:
        """How long a process whose connection closed while it was answering (killed, or its connection reset) has
        to attach again before it is failed: 1/8 of the timeout. A client re-attaches within about 0.1 s of its
        connection closing."""
        return self.heartbeat_timeout_s * RECONNECT_GRACE_SHARE

    @property
    def answering_within_s(self) -> float:
        """A session whose last Heartbeat came at most this long before it ended was answering: its connection was
        closed, not dropped for silence (a drop by keepalive follows at least the ping timeout of silence, less a
        round trip; the 0.8 leaves room for that round trip)."""
        return min(self.unanswered_after_s, 0.8 * self.keepalive_timeout_s)

    def grace_after_session(self, quiet_s: float | None, *, flapping: bool = False) -> float:
        """How long a process whose last session just ended (``quiet_s`` after its last Heartbeat; None: its sessions
        sent none) has to attach again. Answering until the end (a close, not just after recovering from a silence:
        ``flapping``): the reconnect grace. Otherwise (dropped by keepalive, closed by a client whose link flaps, or
        unknown): the coordinator last heard it at most ``keepalive_timeout_s`` before the end, or at its last
        Heartbeat if later, and it is failed only once that silence passes the heartbeat timeout."""
        if quiet_s is not None and quiet_s <= self.answering_within_s and not flapping:
            return self.reconnect_grace_s
        heard = self.keepalive_timeout_s if quiet_s is None else min(quiet_s, self.keepalive_timeout_s)
        return self.heartbeat_timeout_s - heard

    @property
    def step_aside_s(self) -> float:
        """How long a leader that suspected itself stands aside before it campaigns again: one heartbeat timeout,
        for a replica that the processes reach to take over."""
        return self.heartbeat_timeout_s

    @property
    def catching_up_s(self) -> float:
        """How recently a Register call or a session must have arrived for the coordinator to count itself as still
        working through a burst of them (see Liveness.overdue)."""
        return min(1.0, self.heartbeat_timeout_s / 10)

    @property
    def catching_up_limit_s(self) -> float:
        """The longest a silent process is spared while the coordinator catches up: three timeouts."""
        return 3 * self.heartbeat_timeout_s
