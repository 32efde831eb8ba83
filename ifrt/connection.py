"""``Connection``: one process's channels to the coordinator replicas and the one retry loop its calls take.

The common path is one round trip: a call goes straight to the current replica. Only after a call failed does
the connection probe whether the replica speaks the other transport (TLS against plaintext, or HTTP/1 where gRPC was
expected), once per replica that accepts connections, so a mismatch is reported at once instead of after the timeout;
a failure that retrying can fix moves on to the next replica after a pause that grows to about a second (a process
waiting for a coordinator that is not up costs next to no CPU). A
call that rides through a failover (``failover=True``: the Client's key-value calls and barriers) keeps trying
while no replica leads, up to the failover window, also past its own deadline, so that a short call made while a
standby takes over does not fail while the store holds every answer.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import grpc
from google.protobuf.message import Message

from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.client_config import DEFAULTS, ClientConfig
from ifrt.errors import (
    CertificateRejected,
    CoordinatorUnavailable,
    IfrtError,
    Overloaded,
    TransportMismatch,
    from_rpc_error,
)
from ifrt.reachability import UnreachableReport, certificate_problem, unreached_cause
from ifrt.security import plain_channel, probe_transport, with_identity
from ifrt.settings import FAILOVER_WINDOW_ENV, Settings, failover_window


class Backoff:
    """Pauses between retries: doubling from ``first`` to ``cap`` seconds, with jitter."""

    def __init__(self, first: float = 0.01, cap: float = 1.0) -> None:
        self.first, self.cap = first, cap
        self._failures = 0
        self._jitter = random.Random()  # its own: retries never draw from (or disturb) the program's global random

    def next(self) -> float:
        """The next pause, in seconds."""
        self._failures += 1
        return self._jitter.uniform(0.5, 1.0) * min(self.cap, self.first * 2 ** min(self._failures, 16))

    def reset(self) -> None:
        """After a success: the next failure pauses ``first`` again."""
        self._failures = 0


class Connection:
    """Stubs for each coordinator replica, which replica is current, and ``call``: the retry loop of every call."""

    def __init__(self, settings: Settings, process_secret: str, config: ClientConfig = DEFAULTS,
                 extra_metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.settings = settings
        self._extra = extra_metadata
        self.config = config
        self.backoff = Backoff(config.backoff_first_s, config.backoff_cap_s)
        self.failover_window_s = failover_window(config.failover_window_s)
        """How long a call that rides through a failover waits for a replica to lead (``call(failover=True)``)."""
        self._secret = process_secret
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._plain: dict[str, grpc.Channel] = {}  # the same connections, without this process's identity
        self._stubs: dict[str, CoordinatorStub] = {}
        self._current = 0
        self._answered: set[str] = set()  # replicas that answered: their transport is known to match
        self._probed: set[str] = set()  # replicas whose listener a probe found speaking the configured transport

    @property
    def where(self) -> str:
        """The replicas, for messages: ``"c1:8476, c2:8477"``."""
        return ", ".join(self.settings.coordinators)

    @property
    def ever_answered(self) -> bool:
        """Whether any replica has answered a call of this connection."""
        return bool(self._answered)

    def current(self) -> str:
        """The replica calls go to now."""
        return self.settings.coordinators[self._current % len(self.settings.coordinators)]

    def rotate(self, failed: str) -> None:
        """Moves on to the next replica, if ``failed`` is still the current one."""
        with self._lock:
            if self.current() == failed:
                self._current += 1

    def stub(self, target: str) -> CoordinatorStub:
        """The stub for ``target``, its channel opened on first use (no probe: that waits for a failure)."""
        with self._lock:
            stub = self._stubs.get(target)
            if stub is None:
                stub = self._stubs[target] = CoordinatorStub(self._channel(target))
            return stub

    def channel(self, target: str) -> grpc.Channel:
        """The channel to ``target`` (carrying the token and process secret), for stubs of other services."""
        with self._lock:
            return self._channel(target)

    def bare_channel(self, target: str) -> grpc.Channel:
        """The connection to ``target`` without this process's token and secret: an agent forwards its workers'
        calls on it, each with the worker's own (``ifrt.run.forward``)."""
        with self._lock:
            self._channel(target)
            return self._plain[target]

    def _channel(self, target: str) -> grpc.Channel:
        channel = self._channels.get(target)
        if channel is None:
            plain = self._plain[target] = plain_channel(target, self.settings, self.config.channel_options)
            channel = self._channels[target] = with_identity(plain, self.settings, self._secret, self._extra)
        return channel

    def answered(self, target: str) -> None:
        """Notes that ``target`` answered a call: its transport matches, and the next failure pauses briefly."""
        self._answered.add(target)
        self.backoff.reset()

    def failed(self, error: grpc.RpcError, target: str, report: UnreachableReport | None = None,
               deadline: float = 0.0) -> IfrtError:
        """The typed error of a call to ``target`` that failed: raised when retrying cannot fix it (among them a
        TLS/plaintext mismatch or a refused certificate, found now); else returned, after moving on to the next
        replica and a backoff pause. ``report`` logs, paced, why a replica cannot be reached until ``deadline``."""
        cause = unreached_cause(error)
        if cause is not None and (problem := certificate_problem(cause, target, self.settings.tls_ca)) is not None:
            raise CertificateRejected(problem)
        typed = from_rpc_error(error, target)
        if not typed.retryable:
            raise typed from None
        if report is not None:
            report.failed(target, cause or _details(error), deadline, reached=cause is None)
        self.check_transport(target)
        self.rotate(target)
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            time.sleep(self.backoff.next())
        return typed

    def error_of(self, error: grpc.RpcError, target: str) -> IfrtError:
        """The typed error of a call to ``target`` that failed, as this connection reads it."""
        return from_rpc_error(error, target)

    def check_transport(self, target: str) -> None:
        """TransportMismatch when ``target`` speaks TLS and this process plaintext, or the reverse, or answers HTTP/1
        (a web server, such as the coordinator's metrics port); a replica that answered before, or that a probe found
        speaking the right transport, is not probed again (a refused connection is all a port nobody listens on
        costs)."""
        if target in self._answered or target in self._probed:
            return
        probe = probe_transport(target, self.settings.tls, client_cert=self.settings.tls_cert is not None)
        if probe.mismatch is not None:
            raise TransportMismatch(probe.mismatch)
        if probe.listening:
            self._probed.add(target)

    def call(self, method: str, request: Callable[[float], Message], deadline: float, *, slack: float = 0.0,
             timeout: Callable[[float], float] | None = None, report: UnreachableReport | None = None,
             give_up: Callable[[IfrtError | None], IfrtError] | None = None, wait_for_ready: bool | None = None,
             failover: bool = False, what: str = "", bound: str = "") -> Any:
        """Calls ``method`` with ``request(seconds the coordinator may wait)``, retrying what retrying can fix until
        ``deadline``.

        Each attempt may take ``timeout(remaining)`` seconds (default: the remaining time plus ``slack``, for
        the answer). Past the deadline, raises ``give_up(last error)`` (default: CoordinatorUnavailable). By default
        a call waits for a connection only to the one replica there is, once it answered: a new one fails fast, so
        that a transport mismatch is probed for at once.

        With ``failover``, a call rides through a failover: once an attempt went unanswered (no replica led), the call
        goes on until a replica answers or the failover window (``failover_window_s``) has passed since, also past
        its own deadline; the time without a leader does not count against the coordinator's wait (each later
        attempt asks for what was left of it when the leader was lost), and a deadline later than the window still
        bounds the whole call. Past the window, CoordinatorUnavailable names ``what`` was waited for, the window and
        the replicas tried. A refusal for load (Overloaded, an agent's) is an answer, not a failover: it is retried
        until the call's own deadline, and then raised as Overloaded naming the refusal.

        While it retries, ``report`` says (paced) why no replica answers and which bound the call counts against:
        ``bound`` (the call's own, e.g. "the discovery timeout (300 s)"; default: the timeout of ``what``), or the
        failover window once that is what keeps the call going."""
        last_error: IfrtError | None = None
        lost_since: float | None = None  # when an attempt first went unanswered: no replica has answered since
        report = report or UnreachableReport(self.config)
        single = len(self.settings.coordinators) == 1
        own = bound or f"the {max(0.0, deadline - time.monotonic()):.0f} s timeout of {what or method}"
        while True:
            now = time.monotonic()
            ends, wait = deadline, deadline - now
            report.bound = own
            if failover and lost_since is not None:
                ends = max(deadline, lost_since + self.failover_window_s)
                wait = min(max(0.0, deadline - lost_since), ends - now)
                if ends > deadline:
                    report.bound = self.window
            if now >= ends:
                break
            target = self.current()
            ready = (single and target in self._answered) if wait_for_ready is None else wait_for_ready
            seconds = ends - now + slack if timeout is None else timeout(ends - now)
            try:
                answer = getattr(self.stub(target), method)(request(wait), timeout=seconds, wait_for_ready=ready)
            except grpc.RpcError as e:
                failed_at = time.monotonic()
                last_error = self.failed(e, target, report, ends)
                if lost_since is None and not isinstance(last_error, Overloaded):  # a refusal for load is no failover
                    lost_since = failed_at
                continue
            self.answered(target)
            report.reached()
            return answer
        if failover and isinstance(last_error, Overloaded):  # said as what it was, not as a failover or a timeout
            raise Overloaded(f"{what or method}: refused for load until its time ran out; last refusal: {last_error}")
        if failover and lost_since is not None and last_error is not None:
            raise self.leaderless(what or method, time.monotonic() - lost_since, last_error)
        raise (give_up or partial(self.unavailable, method))(last_error)

    @property
    def window(self) -> str:
        """The failover window as lines and errors name it: ``the failover window (30 s, IFRT_FAILOVER_WINDOW)``."""
        return f"the failover window ({self.failover_window_s:g} s, {FAILOVER_WINDOW_ENV})"

    def leaderless(self, what: str, waited: float, last_error: IfrtError) -> CoordinatorUnavailable:
        """What a call that rode out a failover raises when no replica took over within the failover window."""
        return CoordinatorUnavailable(
            f"{what}: no coordinator replica answered as the leader for {waited:.1f}s, longer than a failover may "
            f"take: {self.window}; replicas tried: {self.where}; last error: {last_error}")

    def unavailable(self, method: str, last_error: IfrtError | None) -> CoordinatorUnavailable:
        """What a call of ``method`` that ran out of time raises by default."""
        if last_error is None:
            return CoordinatorUnavailable(f"{method} was not sent to the coordinator ({self.where}): its time had run "
                                          "out before the call")
        return CoordinatorUnavailable(f"{method} did not reach the coordinator ({self.where}) in time; last error: "
                                      f"{last_error}")

    def close(self) -> None:
        """Closes every channel; a later call opens them again."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._plain.clear()
            self._stubs.clear()
        for channel in channels:
            channel.close()


def _details(error: grpc.RpcError) -> str:
    return (error.details() if hasattr(error, "details") else None) or str(error)
