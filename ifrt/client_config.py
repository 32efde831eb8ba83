"""``ClientConfig``: the client's tunables in one place, each with its default and the reason for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from ifrt.errors import InvalidArgument
from ifrt.protocol import MAX_TOPOLOGY_BYTES

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    # Reconnect to a coordinator that is not up yet within ~100 ms of it starting (gRPC's default: ~1 s, growing);
    # gRPC adds up to 20% jitter to the cap.
    ("grpc.initial_reconnect_backoff_ms", 10),
    ("grpc.max_reconnect_backoff_ms", 80),
    # Give up a connection attempt after 2 s (gRPC's default: 20 s), so a replica whose host vanished (its SYNs
    # unanswered) does not hold a process back from the replica that took over.
    ("grpc.min_reconnect_backoff_ms", 2000),
    # Notice a connection that died without closing (coordinator host down, partition, stopped, or dropped by the
    # coordinator during a link flap, its close lost): ping after 1 s without hearing from it (its own pings count;
    # it allows one a second) and give up 1 s later, so that after a flap the process re-attaches within about a
    # second of the link coming back, well inside the heartbeat timeout the coordinator allows its silence (acks
    # come from gRPC's core, not from Python: a busy coordinator still answers them). ping_timeout_ms is what
    # gRPC's core waits for the ack; keepalive_timeout_ms alone leaves that at 60 s.
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.http2.ping_timeout_ms", 1000),
    # One connection per client, as separate processes have; topologies of large clusters exceed 4 MiB.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", MAX_TOPOLOGY_BYTES),
)
"""The options of every channel to the coordinator: they carry the client's side of liveness (keepalive pings)."""


@dataclass(frozen=True)
class ClientConfig:
    """How long a client waits, retries and keeps things; the defaults suit jobs from 1 to 2**14 processes."""

    poll_s: float = 5.0
    """Longest one Register call waits on the coordinator; a progress line is logged after each."""
    warn_after_s: float = 30.0
    """Progress lines, and reports of a coordinator out of reach, are INFO until discover() has waited (or the
    coordinator has been out of reach) this long, then WARNING (shown without logging setup)."""
    first_report_s: float = 1.5
    """The first Register call waits at most this long, so that a process still waiting says so this soon (on
    stderr when the program set up no logging: ``ifrt.waiting``); then one line per ``poll_s``."""
    unreachable_report_after_s: float = 1.5
    """A coordinator unreachable this long is reported (shorter outages, e.g. a replica failover, pass silently)."""
    unreachable_report_every_s: float = 5.0
    """...and then again this often while it stays unreachable."""
    answer_slack_s: float = 5.0
    """How much longer than the coordinator's own wait a call may take before the client gives up on it."""
    backoff_first_s: float = 0.01
    """First pause after a failed call (doubling up to ``backoff_cap_s``, with jitter): a brief outage costs little."""
    backoff_cap_s: float = 1.0
    """Longest pause between retries: a coordinator back up (or a standby that took over) is reached within about a
    second, while a process waiting for one that is not up yet (pods started before it) costs ~1% of a core."""
    failover_window_s: float = 30.0
    """Longest a key-value call, barrier or start-up exchange waits for a coordinator replica to lead once none
    answers (a standby takes over after the leader's ``--leader-ttl``, 5 s by default), also past the call's own
    timeout; ``IFRT_FAILOVER_WINDOW`` overrides it, as it does the time a started runtime allows (``ifrt.failfast``)."""
    leave_timeout_s: float = 2.0
    """Longest a Leave (close, or a discover() that gives up) waits: a coordinator that is not there has nobody
    to tell."""
    watch_ack_timeout_s: float = 30.0
    """Longest kv_watch waits for the coordinator to say the watch is in place."""
    session_close_timeout_s: float = 2.0
    """Longest close() waits for the session thread to end."""
    events_kept: int = 1 << 16
    """Job events kept since the held topology (``events_since_topology``): four for each of 2**14 processes."""
    preflight_timeout_s: float = 60.0
    """How long a whole pre-flight may take (``IFRT_PREFLIGHT_TIMEOUT`` overrides it under ``IFRT_PREFLIGHT=1``)."""
    preflight_probe_timeout_s: float = 2.0
    """Longest one pre-flight probe waits for a connection: an endpoint on a healthy network answers in
    milliseconds, while a firewall that drops packets answers never, so this bounds how late such a pair is
    reported."""
    preflight_parallel: int = 32
    """Pre-flight probes one process runs at once."""
    channel_options: tuple[tuple[str, Any], ...] = CHANNEL_OPTIONS

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "channel_options" and not (isinstance(value, int | float) and math.isfinite(value)
                                                     and value > 0):
                raise InvalidArgument(f"ClientConfig {f.name}={value!r} is out of range: expected a finite number > 0")


DEFAULTS = ClientConfig()
