"""The HTTP server of the metrics and status port: WSGI, a thread per connection, and bounded. A connection must send
its whole request (line and headers) within ``REQUEST_TIMEOUT_S``, each read and write of it is timed out as well,
and at most ``MAX_CONNECTIONS`` are open at once: past that a new connection closes the oldest one that has not sent
its request yet (or, when every one is being answered, is closed itself). So a flood of idle or slow connections
costs a bounded number of threads and descriptors, and an operator's request still gets through."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

MAX_CONNECTIONS = 64
"""Connections open at once; each holds a thread and a descriptor while it lives."""
REQUEST_TIMEOUT_S = 5.0
"""Longest a connection may take to send its request, and any one read or write of it."""
BACKLOG = 128

log = logging.getLogger("ifrt.coordinator")


class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
    """A threading WSGI server with a request deadline and a cap on open connections (see the module)."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, address: tuple[str, int], app: Callable, *, max_connections: int = MAX_CONNECTIONS,
                 request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, float] = {}  # not yet sent their request -> deadline, oldest first
        self._answering: set[socket.socket] = set()
        super().__init__(address, _Handler)
        self.set_app(app)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._answering)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Admits a new connection, closing the oldest waiting one if the cap is reached; then starts its thread."""
        oldest, refused = None, False
        with self._lock:
            if len(self._waiting) + len(self._answering) >= self.max_connections:
                if self._waiting:
                    oldest = next(iter(self._waiting))
                    del self._waiting[oldest]
                else:
                    refused = True
            if not refused:
                self._waiting[request] = time.monotonic() + self.request_timeout_s
        if oldest is not None:
            _hang_up(oldest)  # its thread wakes from its read and ends; it closes its own socket
        if refused:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except RuntimeError:  # no thread could start: drop this connection, keep serving
            self.shutdown_request(request)

    def answering(self, request: socket.socket) -> bool:
        """Marks ``request`` as sent in full (it is answered, and no longer closed for a newer connection); False if
        it was closed meanwhile."""
        with self._lock:
            if self._waiting.pop(request, None) is None:
                return False
            self._answering.add(request)
            return True

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._waiting.pop(request, None)
            self._answering.discard(request)
        super().shutdown_request(request)

    def service_actions(self) -> None:
        """Between accepts (at least every half second): hangs up connections past their request deadline."""
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, deadline in self._waiting.items() if deadline <= now]
            for conn in late:
                del self._waiting[conn]
        for conn in late:
            _hang_up(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out, was hung up or went away is no news; anything else is logged."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            return
        log.warning("the metrics server failed to answer %s: %s: %s", client_address, type(error).__name__, error)


class _Handler(WSGIRequestHandler):
    """One request per connection (HTTP/1.0), with the server's timeout on every read and write."""

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # type: ignore[attr-defined]
        super().setup()

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers
        return self.server.answering(self.connection) and parsed  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged (a scraper or an open page asks every few seconds)."""


def token_required(app: Callable, token: str) -> Callable:
    """``app`` behind the cluster's token: a request must carry ``Authorization: Bearer <token>`` (Prometheus's
    ``authorization: {credentials_file: ...}``) or Basic credentials whose password is the token (a browser asks
    for them); any other gets 401 and nothing of the cluster."""
    expected = token.encode()

    def gated(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        if hmac.compare_digest(_presented(environ.get("HTTP_AUTHORIZATION", "")), expected):
            return app(environ, start_response)
        body = b"this port requires the cluster's token: Authorization: Bearer <token>, or any user and the token " \
               b"as password\n"
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("Content-Length", str(len(body))),
                                            ("WWW-Authenticate", 'Basic realm="ifrt coordinator", charset="UTF-8"')])
        return [body]

    return gated


def _presented(authorization: str) -> bytes:
    """The secret an Authorization header carries (a Bearer token, or a Basic password); b"" for none."""
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip().encode("latin-1", "replace")
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            return b""
        return decoded.partition(b":")[2]
    return b""


def _hang_up(conn: socket.socket) -> None:
    """Wakes the thread reading ``conn``; that thread closes it (closing here could close a reused descriptor)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
