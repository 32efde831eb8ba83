"""Fail fast: once a runtime (JAX, torch.distributed) has started from the topology, a failed peer or a coordinator
lost beyond the failover window ends this process within a second, instead of a hang in the runtime's collectives
or its shutdown barrier.

What happens is the program's choice (``on_failure``):

- ``"exit"`` (default): one line on stderr naming the failed process, its host, the reason and the topology
  generation, then ``os._exit`` with ``JobFailed.exit_code`` (``EXIT_PEER_FAILED``, ``EXIT_COORDINATOR_LOST``).
- ``"raise"``: the typed error (``PeerFailed``, ``CoordinatorGone``) is raised in the main thread, by the signal
  ``RAISE_SIGNAL``; the process exits with the same code when the program ends, or after ``grace`` seconds anyway.
- a callable: called with the error in a thread of its own; then the same exit, at the latest after ``grace``.
- ``"recover"`` (under ``ifrt run --recover replace``): a peer that fails or is replaced is no failure of this
  process: its collectives fail, and the program re-forms its groups in place (``ifrt.torch.recover()``) or, in
  JAX's recoverable mode, goes on over the live devices (``ifrt.jax``). This process declared failed, or the
  coordinator lost, still ends it as ``"exit"``.

A process that leaves on purpose (``ProcessLeft``) is no failure. A process whose main thread ends with an uncaught
exception waits up to the coordinator's heartbeat timeout + 1 s for the failure that caused it (a peer's death
breaks collectives before the coordinator decides), so it reports the peer, not its own broken collective; if none
comes, it exits 1 without leaving, so the coordinator declares it failed and the other processes end.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal

from ifrt import events
from ifrt.errors import CoordinatorGone, InvalidArgument, JobFailed, PeerFailed
from ifrt.safe_text import safe
from ifrt.settings import failover_window

if TYPE_CHECKING:
    from ifrt.client import Client
    from ifrt.topology import Topology

log = logging.getLogger("ifrt.failfast")

OnFailure = Literal["exit", "raise", "recover"] | Callable[[JobFailed], object]
FAILOVER_WINDOW_S = 30.0
"""A coordinator out of reach this long is a failure (a standby takes over after its leader TTL, 5 s by default)."""
RAISE_GRACE_S = 30.0
"""With ``"raise"`` or a callable: the most time the program gets to save its state before the exit anyway."""
RAISE_SIGNAL = signal.SIGUSR2
"""The signal that interrupts the main thread to raise the error (``"raise"``)."""
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
"""The coordinator's default, assumed until its session's first answer says its own."""
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (an uncaught KeyboardInterrupt), as a shell reports it."""
EXIT_UNCAUGHT = 1
"""Exit code after an uncaught exception that no peer's failure explains: a bug in this program."""


def check(on_failure: OnFailure) -> None:
    """InvalidArgument saying what is accepted if ``on_failure`` is not "exit", "raise", "recover" or a callable, if
    "raise" is asked for outside the main thread (only the main thread can install its signal handler), or if
    IFRT_FAILOVER_WINDOW is not a positive number."""
    failover_window_from_env()
    if callable(on_failure) or on_failure in ("exit", "recover"):
        return
    if on_failure != "raise":
        raise InvalidArgument(f"on_failure={on_failure!r}: expected 'exit', 'raise', 'recover' or a callable taking "
                              "the error")
    if threading.current_thread() is not threading.main_thread():
        raise InvalidArgument("on_failure='raise' needs the runtime started from the main thread (the error is "
                              "raised there by a signal handler): start it from the main thread, or use 'exit' "
                              "or a callable")


def failure_for(event: events.Event, topology: Topology, *, recover: bool = False) -> JobFailed | None:
    """The failure an event means for a job whose runtime started on ``topology``, or None (a process that left on
    purpose, a topology change, the coordinator back; with ``recover``, a peer that failed or was replaced: the
    program re-forms its groups)."""
    me = topology.process_id
    if isinstance(event, events.ProcessFailed):
        if recover and event.process_id != me:
            return None
        what = "this process was declared failed" if event.process_id == me else "failed"
        return _peer(topology, event.process_id, what, event.reason)
    # Without recover the runtime cannot take a process back: its old run is gone.
    if isinstance(event, events.ProcessRestarted) and not recover:
        return _peer(topology, event.process_id, "restarted",
                     f"incarnation {event.incarnation} replaced the one this runtime started with")
    return None


def _peer(topology: Topology, process_id: int, what: str, reason: str) -> PeerFailed:
    host = _host(topology, process_id)
    return PeerFailed(f"process {process_id} ({host}) {what}: {reason} (topology generation {topology.generation})",
                      process_id=process_id, hostname=host, reason=reason, generation=topology.generation)


def _host(topology: Topology, process_id: int) -> str:
    try:
        process = topology.process(process_id)
    except (KeyError, IndexError, ValueError):
        return "unknown host"
    return " ".join(part for part in (process.hostname, process.address) if part) or "unknown host"


class Watchdog:
    """Ends this process on the job's first failure, as ``on_failure`` says; armed by ``arm``."""

    def __init__(self, client: Client, topology: Topology, on_failure: OnFailure, runtime: str, *,
                 abort: Callable[[], None] | None = None, shutdown: Callable[[], None] | None = None,
                 cleanup: Callable[[], None] | None = None, failover_window: float | None = None,
                 grace: float = RAISE_GRACE_S) -> None:
        check(on_failure)
        self.client, self.topology, self.on_failure, self.runtime = client, topology, on_failure, runtime
        self._abort, self._shutdown, self._cleanup = abort, shutdown, cleanup
        self.failover_window = failover_window if failover_window is not None else failover_window_from_env()
        self.grace = grace
        self.failure: JobFailed | None = None
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._armed = False
        self._exiting = False
        self._lost_timer: threading.Timer | None = None

    def arm(self) -> None:
        """Starts acting on the client's events; from now on this process ends on the job's first failure."""
        if self.on_failure == "raise":
            signal.signal(RAISE_SIGNAL, self._raise_in_main)
        atexit.register(self._at_exit)  # runs before the runtime's own exit hooks, registered earlier
        self._armed = True
        self._subscribe()

    @property
    def heartbeat_timeout(self) -> float:
        """The coordinator's heartbeat timeout (how long its decision on a silent process may take): what its
        session's first answer said, DEFAULT_HEARTBEAT_TIMEOUT_S before one came."""
        return self.client.heartbeat_timeout_s or DEFAULT_HEARTBEAT_TIMEOUT_S

    def _subscribe(self) -> None:
        """The one place events come in: every job event since the topology, so a failure between discovery and
        this call (during the runtime's start) counts too."""
        self.client.on_event(self._on_event, since_topology=True)

    def _on_event(self, event: events.Event) -> None:
        if not self._armed:
            return
        if isinstance(event, events.CoordinatorLost):
            with self._lock:
                if self._lost_timer is None:
                    self._lost_timer = threading.Timer(self.failover_window, self._coordinator_gone, (event.reason,))
                    self._lost_timer.daemon = True
                    self._lost_timer.start()
        elif isinstance(event, events.CoordinatorRestored):
            with self._lock:
                timer, self._lost_timer = self._lost_timer, None
            if timer is not None:
                timer.cancel()
        elif (failure := failure_for(event, self.topology, recover=self.on_failure == "recover")) is not None:
            self.fail(failure)

    def _coordinator_gone(self, reason: str) -> None:
        coordinator = self.client.current_coordinator()
        self.fail(CoordinatorGone(
            f"the coordinator {coordinator} stayed out of reach for {self.failover_window:g} s (the failover "
            f"window): {reason} (topology generation {self.topology.generation})",
            hostname=coordinator, reason=reason, generation=self.topology.generation))

    def fail(self, failure: JobFailed) -> None:
        """Acts on the job's first failure (later ones are ignored): says it on stderr, then exits, raises in the
        main thread or calls the program's callable."""
        with self._lock:
            if self.failure is not None or not self._armed:
                return
            self.failure = failure
        action = ("exiting" if self.on_failure in ("exit", "recover") else
                  "raising it in the main thread" if self.on_failure == "raise" else "calling on_failure")
        _say(f"ifrt: {self.runtime} job failed: {failure}; process {self.topology.process_id} is {action} "
             f"(exit code {failure.exit_code})")
        self._failed.set()  # said: _at_exit may end the process from now on
        if self.on_failure in ("exit", "recover") or self._exiting:  # nothing to raise into, or nothing to recover
            self._exit(failure.exit_code)
        deadline = threading.Timer(self.grace, self._exit_anyway)
        deadline.daemon = True
        deadline.start()
        threading.Thread(target=self._deliver, name="ifrt-failfast", daemon=True).start()

    def _deliver(self) -> None:
        assert self.failure is not None
        if self._abort is not None:  # a collective blocked on a hung peer returns
            try:
                self._abort()
            except Exception:
                log.exception("aborting %s's process group failed", self.runtime)
        if self.on_failure == "raise":
            signal.pthread_kill(threading.main_thread().ident, RAISE_SIGNAL)  # type: ignore[arg-type]
            return
        try:
            self.on_failure(self.failure)  # type: ignore[operator]
        except BaseException:
            log.exception("on_failure callback %r failed", self.on_failure)
        self._exit(self.failure.exit_code)

    def _raise_in_main(self, signum: int, frame: object) -> None:
        if self.failure is not None and not self._exiting:  # in _at_exit, the exit follows anyway
            raise self.failure

    def _exit_anyway(self) -> None:
        assert self.failure is not None
        _say(f"ifrt: process {self.topology.process_id} still running {self.grace:g} s after the failure: exiting "
             f"(exit code {self.failure.exit_code})")
        self._exit(self.failure.exit_code)

    def _exit(self, code: int) -> None:
        """Ends the process past the exit hooks, once ``cleanup`` (what those hooks would remove) has run."""
        if self._cleanup is not None:
            with contextlib.suppress(Exception):
                self._cleanup()
        _exit(code)

    def _at_exit(self) -> None:
        """The program ends: with a failure known, exit with its code at once (never in the runtime's shutdown);
        after an uncaught exception, first wait for the failure that may explain it; else leave normally."""
        self._exiting = True
        if self.failure is not None:
            self._failed.wait(1.0)  # until the line is out
            self._exit(self.failure.exit_code)
        crash = getattr(sys, "last_value", None)
        if crash is not None and self._armed:
            if isinstance(crash, KeyboardInterrupt):
                self._exit(EXIT_INTERRUPTED)
            if self._failed.wait(self.heartbeat_timeout + 1.0):
                self._exit(self.failure.exit_code)  # type: ignore[union-attr]
            # a bug here: exit without leaving, so the coordinator declares this process failed and peers end too
            self._exit(EXIT_UNCAUGHT)
        if self._shutdown is not None:  # the runtime's shutdown barrier, while a peer's failure still ends it
            try:
                self._shutdown()
            except Exception:
                log.exception("%s shutdown failed", self.runtime)
        with self._lock:
            self._armed = False


def arm(client: Client, topology: Topology, on_failure: OnFailure, runtime: str, **options: object) -> Watchdog:
    """A Watchdog for ``runtime`` on ``client``'s events, armed (``options``: Watchdog's keywords)."""
    watchdog = Watchdog(client, topology, on_failure, runtime, **options)  # type: ignore[arg-type]
    watchdog.arm()
    return watchdog


def failover_window_from_env(env: Mapping[str, str] | None = None) -> float:
    """IFRT_FAILOVER_WINDOW in seconds, else FAILOVER_WINDOW_S; InvalidArgument naming the value if it is not a
    positive number."""
    return failover_window(FAILOVER_WINDOW_S, env)


def _say(line: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(safe(line) + "\n")  # a peer's host and reason came from the wire: one line, escaped
        sys.stderr.flush()


def _exit(code: int) -> None:
    """Ends the process now, past the runtime's exit hooks (JAX's shutdown barrier waits for the failed peer)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
