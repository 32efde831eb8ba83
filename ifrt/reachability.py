"""Why a coordinator could not be reached, in an operator's words, and a paced report of it while a client retries.

A call that never reaches the coordinator fails with gRPC's UNAVAILABLE and a status text such as ``failed to
connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: Connection
refused``. The cause at its end ("connection refused", a TLS handshake failure) is what a person needs to see.
"""

from __future__ import annotations

import logging
import re
import time

import grpc

from ifrt import waiting
from ifrt.client_config import DEFAULTS, ClientConfig
from ifrt.hostport import split_host_port
from ifrt.waiting import Pacer

_CONNECT_FAILURE = "failed to connect to all addresses"
_PREFIXES = re.compile(r"^(?:(?:UNKNOWN|UNAVAILABLE|UNAUTHENTICATED|INTERNAL): )*(?:ipv[46]:\S+?: )?"
                       r"(?:Failed to connect to remote host: )?")
_BAD_CERTIFICATE = ("CERTIFICATE_VERIFY_FAILED", "Hostname Verification Check failed", "Peer name")


def unreached_cause(error: grpc.RpcError) -> str | None:
    """The cause of a call that never reached a coordinator (``"connection refused"``), or None if it did."""
    if not hasattr(error, "code") or error.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = error.details() or ""
    if _CONNECT_FAILURE not in details:
        return None
    last = details.partition("last error: ")[2] or details
    cause = _PREFIXES.sub("", last.strip()).removesuffix(": OK").strip()
    return cause[:1].lower() + cause[1:] if cause else details


def certificate_problem(cause: str, target: str, ca_file: str | None) -> str | None:
    """What to set when ``cause`` is the coordinator's certificate being refused; None for any other cause."""
    if not any(marker in cause for marker in _BAD_CERTIFICATE):
        return None
    host = split_host_port(target)[0]
    if "Hostname Verification" in cause or "Peer name" in cause:
        return (f"the coordinator's TLS certificate does not name {host!r}, the address this process dialled "
                f"({cause}): dial a name or IP its certificate lists (subjectAltName), or reissue its --tls-cert with "
                f"{host} among them")
    trusted = f"the CA in {ca_file}" if ca_file else "the system's CAs"
    return (f"the coordinator at {target} presented a TLS certificate that {trusted} did not sign ({cause}): set "
            "IFRT_TLS_CA to the CA that signed the coordinator's --tls-cert")


class UnreachableReport:
    """Says, within seconds of an outage and then every few seconds, which coordinator cannot be reached or does not
    serve (a standby, one that stepped down) and why, through ``ifrt.waiting``."""

    def __init__(self, config: ClientConfig = DEFAULTS) -> None:
        self._config = config
        self._pacer: Pacer | None = None
        self.cause: str | None = None
        """The latest cause seen (kept after the coordinator answers, for a final error)."""
        self.bound = ""
        """The bound the retrying call counts against, as its lines name it ("the failover window (30 s,
        IFRT_FAILOVER_WINDOW)", "the discovery timeout (300 s)"); set by ``Connection.call``."""

    def failed(self, target: str, cause: str, deadline: float, *, reached: bool = False) -> None:
        """Notes one failed attempt on ``target`` (``reached``: it answered, but not as a serving leader); says so
        when a report is due."""
        now = time.monotonic()
        self.cause = f"{target}: {cause}"
        if self._pacer is None:
            self._pacer = Pacer(self._config.unreachable_report_after_s, self._config.unreachable_report_every_s, now)
        if not self._pacer.due(now):
            return
        level = logging.WARNING if self._pacer.waited(now) >= self._config.warn_after_s else logging.INFO
        what = "no serving coordinator at" if reached else "cannot reach"
        bound = f": {self.bound}" if self.bound else ""
        waiting.say(level, "%s %s: %s (retrying for %.0f s more%s)", what, target, cause, max(0.0, deadline - now),
                    bound)

    def reached(self) -> None:
        """A coordinator answered: the next outage is reported afresh."""
        self._pacer = None
