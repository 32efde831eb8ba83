"""Who may talk to the coordinator: the cluster token and the process secret on every call, TLS channels,
and a quick probe that tells a TLS/plaintext mismatch at once instead of after a long timeout."""

from __future__ import annotations

import secrets
import socket
import ssl
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc

from ifrt.hostport import split_host_port
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA
from ifrt.settings import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, Settings

PROBE_TIMEOUT_S = 1.0
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def new_process_secret() -> str:
    """A fresh random secret for one process incarnation (or one ``ifrt run`` agent: agents prove who they are the
    same way)."""
    return secrets.token_hex(16)


def plain_channel(target: str, settings: Settings, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``target`` (TLS when the settings name a CA or client certificate) that adds nothing to a call. It
    dials ``target`` directly, whatever proxy the environment names, unless the settings ask for the proxy
    (IFRT_USE_PROXY=1): a proxy meant for other traffic must not carry the job's."""
    options = (*options, ("grpc.enable_http_proxy", int(settings.use_proxy)))
    if settings.tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(settings.tls_ca), private_key=_read(settings.tls_key),
            certificate_chain=_read(settings.tls_cert))
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target, options=options)


def with_identity(channel: grpc.Channel, settings: Settings, process_secret: str,
                  extra: Sequence[tuple[str, str]] = ()) -> grpc.Channel:
    """``channel`` with the token, ``process_secret`` and ``extra`` metadata on its every call (the same connection
    underneath)."""
    metadata = [(SECRET_METADATA, process_secret), *extra]
    if settings.token:
        metadata.append((TOKEN_METADATA, settings.token))
    return grpc.intercept_channel(channel, _WithMetadata(tuple(metadata)))


def open_channel(target: str, settings: Settings, process_secret: str,
                 options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """A channel to ``target`` whose every call carries the token and the process secret (see ``plain_channel``)."""
    return with_identity(plain_channel(target, settings, options), settings, process_secret)


def local_channel(target: str, settings: Settings, process_secret: str,
                  options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """A plaintext channel to a local ``unix:`` ``target`` (the host's ``ifrt run`` agent) whose every call carries
    the token and the process secret, as a channel to the coordinator does."""
    metadata = [(SECRET_METADATA, process_secret)]
    if settings.token:
        metadata.append((TOKEN_METADATA, settings.token))
    return grpc.intercept_channel(grpc.insecure_channel(target, options=options), _WithMetadata(tuple(metadata)))


class Probe(NamedTuple):
    """What a probe of a coordinator's address found: whether anything accepted a connection there, and why it cannot
    be spoken to as configured (None: it can, or the answer was unclear)."""

    listening: bool
    mismatch: str | None


def transport_mismatch(target: str, tls: bool, client_cert: bool = False,
                       timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``target`` cannot be spoken to as configured (TLS against plaintext, the reverse, mutual TLS without a
    client certificate, or an HTTP/1 server where gRPC was expected), or None when it can, when nothing listens there
    yet, or when the answer is unclear (the caller's retries cover those)."""
    return probe_transport(target, tls, client_cert, timeout).mismatch


def probe_transport(target: str, tls: bool, client_cert: bool = False, timeout: float = PROBE_TIMEOUT_S) -> Probe:
    """``transport_mismatch``, saying also whether anything listens at ``target`` (a port nothing listens on costs
    one refused connection, no TLS handshake)."""
    host, port = split_host_port(target)
    if not port.isdigit():
        return Probe(False, None)
    address = (host, int(port))
    plain = _plaintext_answer(address, timeout)
    if plain is None:
        return Probe(False, None)  # nothing accepted the connection: nothing to tell yet
    if _is_text(plain):
        return Probe(True, _text_answer(target, plain))
    if tls:
        answer = _tls_answer(address, timeout)
        if answer == "plaintext":
            return Probe(True, (
                f"the coordinator at {target} speaks plaintext, but this process is set up for TLS ({TLS_CA_ENV} / "
                f"{TLS_CERT_ENV}): unset them, or start the coordinator with --tls-cert and --tls-key"))
        if answer == "needs a client certificate" and not client_cert:
            return Probe(True, (
                f"the coordinator at {target} requires a client certificate (mutual TLS): set {TLS_CERT_ENV} and "
                f"{TLS_KEY_ENV} to one signed by the CA its --tls-client-ca names"))
        return Probe(True, None)
    if not _is_settings_frame(plain) and _tls_answer(address, timeout) not in (None, "plaintext"):
        return Probe(True, (
            f"the coordinator at {target} requires TLS: set {TLS_CA_ENV} to the CA that signed its certificate (and "
            f"{TLS_CERT_ENV} / {TLS_KEY_ENV} if it requires client certificates)"))
    return Probe(True, None)


def _is_text(answer: bytes) -> bool:
    """Whether a server answered the HTTP/2 preface in text (an HTTP/1 status line or page), which no gRPC server
    (its first frame is binary) nor TLS server (a binary alert) does."""
    return bool(answer) and all(32 <= b < 127 or b in b"\t\r\n" for b in answer)


def _text_answer(target: str, answer: bytes) -> str:
    """What to say of a server at ``target`` that answered in text, from the first bytes of its ``answer``."""
    first_line = answer.strip().splitlines()[0].decode("ascii")[:60]
    web = answer.startswith(b"HTTP/") or answer.lstrip().lower().startswith((b"<!doctype", b"<html"))
    what = "answers HTTP/1" if web else "answers in text"
    return (f"{target} {what} ({first_line!r}), not gRPC: it is another server, such as a web server or a "
            "coordinator's --metrics-port (its metrics and status page), not the port the coordinator serves gRPC on: "
            "expected the coordinator's gRPC address, the one its log names in 'ifrt-coordinator listening on "
            "HOST:PORT'")


def _plaintext_answer(address: tuple[str, int], timeout: float) -> bytes | None:
    """The first bytes a server answers the HTTP/2 client preface with (b"" when it answers nothing in time or
    closes), or None when nothing accepts a connection at ``address``."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError:
        return None
    with sock:
        try:
            sock.sendall(_H2_PREFACE)
            return sock.recv(64)
        except OSError:
            return b""


def _is_settings_frame(first: bytes) -> bool:
    """A plaintext HTTP/2 server answers the client preface with a SETTINGS frame."""
    return len(first) >= 4 and first[3] == 0x04


def _probe_context() -> ssl.SSLContext:
    """A TLS client context that checks nothing (only the protocol is probed): no CA store is loaded for it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return context


def _tls_answer(address: tuple[str, int], timeout: float) -> str | None:
    """How the server answers a TLS handshake without a client certificate: "tls", "needs a client certificate",
    "plaintext", or None when nothing clear answers."""
    context = _probe_context()
    try:
        with socket.create_connection(address, timeout=timeout) as sock, \
                context.wrap_socket(sock, server_hostname=address[0]) as tls:
            tls.settimeout(0.2)  # with TLS 1.3 a server that wants a client certificate ends the connection just
            try:                 # after the handshake; one that does not waits for the HTTP/2 preface
                if tls.recv(1) == b"":
                    return "needs a client certificate"
            except TimeoutError:
                pass
    except ssl.SSLError as e:
        text = str(e).upper()
        if "CERTIFICATE_REQUIRED" in text or "HANDSHAKE_FAILURE" in text or "BAD_CERTIFICATE" in text:
            return "needs a client certificate"
        if "ALERT" in text:
            return "tls"
        if "WRONG_VERSION_NUMBER" in text or "RECORD LAYER" in text or "PACKET_LENGTH" in text:
            return "plaintext"
        return None
    except OSError:
        return None
    return "tls"


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the same metadata to every call of a channel, whatever its kind (a kind left out would go without the
    token: ``WatchJob`` is unary-stream)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _Details:
        return _Details(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                        details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
