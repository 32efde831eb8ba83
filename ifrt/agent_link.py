"""``AgentConnection``: a worker's Register and Session through its ``ifrt run`` agent (``IFRT_AGENT_SOCKET``).

The agent serves them on a Unix socket in a directory only the job's user may enter: plaintext, the token and the
process secret on every call as to the coordinator (the agent proves the worker's registration with the secret's
hash). Every other call of the worker goes to the coordinator itself, on the worker's own ``Connection``.
"""

from __future__ import annotations

import time

import grpc

from ifrt.client_config import DEFAULTS, ClientConfig
from ifrt.connection import Connection
from ifrt.errors import ERROR_TRAILER, AgentGone, IfrtError, from_rpc_error
from ifrt.reachability import UnreachableReport
from ifrt.security import local_channel
from ifrt.settings import AGENT_SOCKET_ENV, Settings


class AgentConnection(Connection):
    """One channel, to the agent's socket; a call the agent does not answer at all raises AgentGone at once (nobody
    else serves that socket), one it answers with an error is retried or raised as a coordinator's would be."""

    def __init__(self, settings: Settings, process_secret: str, socket_path: str,
                 config: ClientConfig = DEFAULTS) -> None:
        super().__init__(settings, process_secret, config)
        self.socket_path = socket_path
        self.target = f"unix:{socket_path}"

    def current(self) -> str:
        return self.target

    def rotate(self, failed: str) -> None:
        """One agent: nothing to move on to."""

    def check_transport(self, target: str) -> None:
        """Plaintext on both sides, always."""

    def _channel(self, target: str) -> grpc.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = local_channel(target, self.settings, self._secret,
                                                             self.config.channel_options)
        return channel

    def error_of(self, error: grpc.RpcError, target: str) -> IfrtError:
        if gone(error):
            return AgentGone(f"the ifrt run agent serving {self.socket_path} ({AGENT_SOCKET_ENV}) is gone: it exited "
                             f"or was killed, and with it this worker's link to the coordinator ({error.details()})")
        return from_rpc_error(error, target)

    def failed(self, error: grpc.RpcError, target: str, report: UnreachableReport | None = None,
               deadline: float = 0.0) -> IfrtError:
        typed = self.error_of(error, target)
        if not typed.retryable:
            raise typed from None
        if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            time.sleep(self.backoff.next())
        return typed


def gone(error: grpc.RpcError) -> bool:
    """Whether a failed call never reached a server: UNAVAILABLE that no server sent (no ``ifrt-error`` trailer)."""
    code = error.code() if hasattr(error, "code") else None
    trailers = dict(error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else {}
    return code == grpc.StatusCode.UNAVAILABLE and ERROR_TRAILER not in trailers
