"""How long calls that wait on the cluster are held, and when a progress answer is stale: the core's waiting rules,
decided from the cluster's configuration and the time given. Pure."""

from __future__ import annotations

from coordinator.core.cluster import ClusterConfig


def wait_s(config: ClusterConfig, requested_s: float, *, resolved_by_tick: bool = False) -> float:
    """How long a call that waits on the cluster is held: a Register call or a key-value get its own wait, at most
    ``max_wait_s``; a call the tick resolves at its deadline (barrier, agreement, sync point) its own timeout and
    the stall slack (the tick answers it in time; only a stalled tick leaves it to this bound)."""
    if resolved_by_tick:
        return requested_s + config.stall_slack_s
    return max(0.0, min(requested_s, config.max_wait_s))


def progress_stale(config: ClusterConfig, now: float, made_at: float, made_with: int, registered: int) -> bool:
    """Whether a progress answer made at ``made_at`` with ``made_with`` processes registered (``registered`` now)
    must be made again: building one costs O(N log N), so at most a few are made a second however many processes
    ask, and its count lags by at most ``progress_refresh_s`` while registrations arrive."""
    age = now - made_at
    return not (age < config.progress_refresh_s or (made_with == registered and age < config.progress_cache_s))
