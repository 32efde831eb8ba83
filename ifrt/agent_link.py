"""``AgentConnection``: a worker's calls through its ``ifrt run`` agent (``IFRT_AGENT_SOCKET``).

The agent serves them on a Unix socket in a directory only the job's user may enter: plaintext, the token and the
process secret on every call as to the coordinator (the agent proves the worker's registration with the secret's
hash). Register and Session go in the host's one registration and one session; every other call (key-values,
barriers, ...) is forwarded on the agent's own connection, one attempt each: the worker's retry loop here rides out
a failover, and a coordinator the agent cannot reach comes back as CoordinatorUnavailable, retried.

A worker's link to the coordinator is its agent: once the agent has answered, losing it ends the worker
(``EXIT_AGENT_GONE``, one line on stderr naming the agent's socket), as the agent's own stop would have. An agent
that died (nothing listens on its socket any more) ends it at once; one that stopped answering (SIGSTOP, its host
frozen) is noticed by keepalive pings paced by the coordinator's heartbeat timeout, which the agent's registration
answer carries, and ends it within that timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from ifrt.client_config import DEFAULTS, ClientConfig
from ifrt.connection import Connection
from ifrt.errors import ERROR_TRAILER, AgentGone, IfrtError, Overloaded, from_rpc_error
from ifrt.reachability import UnreachableReport
from ifrt.safe_text import safe
from ifrt.security import local_channel
from ifrt.settings import AGENT_SOCKET_ENV, Settings

EXIT_AGENT_GONE = 74
"""Exit code of a worker that ended because its ``ifrt run`` agent died or stopped answering (sysexits' EX_IOERR:
its link, the agent's socket, failed). Not a bug of the program: the coordinator fails the host's processes and the
job goes on as its recovery says."""
HEARTBEAT_TIMEOUT_METADATA = "ifrt-heartbeat-timeout-ms"
"""Trailing metadata of the agent's Register answers: the coordinator's heartbeat timeout, which paces the worker's
keepalive pings to its agent."""
PING_SHARE = 0.3
"""A worker pings its agent after this share of the heartbeat timeout without hearing from it, and gives up on the
ping after as much again: a stopped agent is noticed within 0.6 of the timeout."""
ANSWER_GRACE_SHARE, MIN_ANSWER_GRACE_S = 0.2, 0.5
"""After its connection went silent, how long an agent whose socket still takes connections has to answer a new one
(a share of the heartbeat timeout, at least ``MIN_ANSWER_GRACE_S``): a live agent whose pings were late on a loaded
host answers, and the session goes on."""
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
"""The coordinator's default, assumed until the agent's answer says its own."""
_LOAD_REFUSAL = "Concurrent RPC limit exceeded"
"""gRPC's own refusal when the agent's server holds as many calls as it has threads: it carries no ``ifrt-error``."""


def keepalive_options(heartbeat_timeout_s: float) -> list[tuple[str, int]]:
    """A worker's pings to its agent, at ``PING_SHARE`` of the heartbeat timeout (the agent allows one per 100 ms)."""
    ping_ms = max(100, round(heartbeat_timeout_s * PING_SHARE * 1000))
    return [("grpc.keepalive_time_ms", ping_ms), ("grpc.keepalive_timeout_ms", ping_ms),
            ("grpc.http2.ping_timeout_ms", ping_ms), ("grpc.http2.max_pings_without_data", 0)]


class AgentConnection(Connection):
    """One channel, to the agent's socket; a call the agent does not answer at all raises AgentGone at once (nobody
    else serves that socket), one it answers with an error is retried or raised as a coordinator's would be. Once the
    agent has answered, a session that loses it ends the process (``EXIT_AGENT_GONE``)."""

    def __init__(self, settings: Settings, process_secret: str, socket_path: str,
                 config: ClientConfig = DEFAULTS) -> None:
        super().__init__(settings, process_secret, config)
        self.socket_path = socket_path
        self.target = f"unix:{socket_path}"
        self.heartbeat_timeout_s: float | None = None
        """The coordinator's heartbeat timeout as the agent's last Register answer said it (None before one)."""
        self._retired: list[grpc.Channel] = []  # channels of an earlier pace, closed with the connection
        self._checking = False

    def current(self) -> str:
        return self.target

    def rotate(self, failed: str) -> None:
        """One agent: nothing to move on to."""

    def check_transport(self, target: str) -> None:
        """Plaintext on both sides, always."""

    def _channel(self, target: str) -> grpc.Channel:
        channel = self._channels.get(target)
        if channel is None:
            options = list(self.config.channel_options)
            if self.heartbeat_timeout_s is not None:
                paced = keepalive_options(self.heartbeat_timeout_s)
                options = [o for o in options if o[0] not in dict(paced)] + paced
            channel = self._channels[target] = grpc.intercept_channel(
                local_channel(target, self.settings, self._secret, options), _Trailers(self._heard))
        return channel

    def _heard(self, heartbeat_timeout_s: float) -> None:
        """The agent's Register answer named the heartbeat timeout: later calls (the session) ping at its pace."""
        with self._lock:
            if heartbeat_timeout_s == self.heartbeat_timeout_s:
                return
            self.heartbeat_timeout_s = heartbeat_timeout_s
            self._retired.extend(self._channels.values())  # a call still on one keeps it
            self._channels.clear()
            self._stubs.clear()

    def close(self) -> None:
        super().close()
        with self._lock:
            retired, self._retired = self._retired, []
        for channel in retired:
            channel.close()

    def error_of(self, error: grpc.RpcError, target: str) -> IfrtError:
        """The typed error of the session's call that failed; a session that lost an agent that had answered ends
        this process (an agent gone for good at once, a silent one if it does not answer within its grace)."""
        typed = self._typed(error, target)
        if isinstance(typed, AgentGone) and self.ever_answered:
            self._lost(_details(error))
        return typed

    def failed(self, error: grpc.RpcError, target: str, report: UnreachableReport | None = None,
               deadline: float = 0.0) -> IfrtError:
        typed = self._typed(error, target)
        if not typed.retryable:
            raise typed from None
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            time.sleep(self.backoff.next())
        return typed

    def _typed(self, error: grpc.RpcError, target: str) -> IfrtError:
        if gone(error):
            how = ("does not answer: it is stopped or hung (its socket still takes connections)"
                   if listened(self.socket_path) else "is gone: it exited or was killed")
            return AgentGone(f"the ifrt run agent serving {self.socket_path} ({AGENT_SOCKET_ENV}) {how}, and with it "
                             f"this worker's link to the coordinator ({_details(error)})")
        if refused_for_load(error):
            return Overloaded(f"this host's ifrt run agent ({self.socket_path}) refused the call for load "
                              f"({_details(error)}): retrying")
        return from_rpc_error(error, f"{self.where} (through this host's ifrt run agent)")

    def _lost(self, details: str) -> None:
        """The agent's link that worked broke: ends the process now if nothing listens on the socket any more, else
        gives the agent its grace to answer a new connection (a check of its own, once at a time)."""
        if not listened(self.socket_path):
            self._end("is gone: nothing listens on its socket any more (it exited or was killed)")
        with self._lock:
            if self._checking:
                return
            self._checking = True
        threading.Thread(target=self._check, args=(details,), name="ifrt-agent-check", daemon=True).start()

    def _check(self, details: str) -> None:
        timeout = self.heartbeat_timeout_s or DEFAULT_HEARTBEAT_TIMEOUT_S
        grace = max(MIN_ANSWER_GRACE_S, timeout * ANSWER_GRACE_SHARE)
        channel = grpc.insecure_channel(self.target)
        try:
            grpc.channel_ready_future(channel).result(timeout=grace)
        except grpc.FutureTimeoutError:
            how = ("stopped answering: its connection went silent" if listened(self.socket_path) else
                   "is gone: it did not answer, and nothing listens on its socket any more")
            self._end(f"{how} ({details}; no answer to a new connection within {grace:g}s)")
        finally:
            channel.close()
            with self._lock:
                self._checking = False

    def _end(self, how: str) -> None:
        """Says on stderr why this process ends, then ends it (``EXIT_AGENT_GONE``), past the program's exit hooks
        (a runtime's shutdown would wait for peers). The line is written by a thread given a moment: a stopped
        agent no longer reads the pipe a worker's stderr may be."""
        line = (f"ifrt: the ifrt run agent serving {self.socket_path} ({AGENT_SOCKET_ENV}) {how}; this worker's "
                f"link to the coordinator went with it: exiting (exit code {EXIT_AGENT_GONE})")
        writer = threading.Thread(target=_say, args=(line,), name="ifrt-agent-gone", daemon=True)
        writer.start()
        writer.join(0.5)
        os._exit(EXIT_AGENT_GONE)


class _Trailers(grpc.UnaryUnaryClientInterceptor):
    """Reads the heartbeat timeout off the agent's unary answers (``HEARTBEAT_TIMEOUT_METADATA``)."""

    def __init__(self, heard: Callable[[float], None]) -> None:
        self._heard = heard

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        outcome.add_done_callback(self._read)  # at once for a blocking call; when it ends for a future
        return outcome

    def _read(self, call: grpc.Call) -> None:
        with contextlib.suppress(Exception):  # a failed call, or an agent that names none
            for key, value in call.trailing_metadata() or ():
                if key == HEARTBEAT_TIMEOUT_METADATA and int(value) > 0:
                    self._heard(int(value) / 1000)


def gone(error: grpc.RpcError) -> bool:
    """Whether a failed call never reached a server: UNAVAILABLE that no server sent (no ``ifrt-error`` trailer)."""
    code = error.code() if hasattr(error, "code") else None
    trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    return code == grpc.StatusCode.UNAVAILABLE and ERROR_TRAILER not in trailers


def refused_for_load(error: grpc.RpcError) -> bool:
    """Whether gRPC itself refused the call because the agent's server holds as many calls as it serves at once."""
    code = error.code() if hasattr(error, "code") else None
    trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    return (code == grpc.StatusCode.RESOURCE_EXHAUSTED and ERROR_TRAILER not in trailers
            and _LOAD_REFUSAL in _details(error))


def listened(path: str) -> bool:
    """Whether a process listens on the Unix socket ``path``: an agent that ended, however, leaves none; a stopped
    one's socket still takes connections (the kernel queues them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.2)
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:  # a full queue, a timeout: someone listens
            return True
    return True


def _details(error: grpc.RpcError) -> str:
    return (error.details() if hasattr(error, "details") else None) or str(error)


def _say(line: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(safe(line) + "\n")
        sys.stderr.flush()
