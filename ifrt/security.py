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


def transport_mismatch(target: str, tls: bool, client_cert: bool = False,
                       timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``target`` cannot be spoken to as configured (TLS against plaintext, the reverse, or mutual TLS without
    a client certificate), or None when it can, when nothing listens there yet, or when the answer is unclear
    (the caller's retries cover those)."""
    host, port = split_host_port(target)
    if not port.isdigit():
        return None
    address = (host, int(port))
    if tls:
        answer = _tls_answer(address, timeout)
        if answer == "plaintext":
            return (f"the coordinator at {target} speaks plaintext, but this process is set up for TLS "
                    f"({TLS_CA_ENV} / {TLS_CERT_ENV}): unset them, or start the coordinator with --tls-cert and "
                    "--tls-key")
        if answer == "needs a client certificate" and not client_cert:
            return (f"the coordinator at {target} requires a client certificate (mutual TLS): set {TLS_CERT_ENV} "
                    f"and {TLS_KEY_ENV} to one signed by the CA its --tls-client-ca names")
        return None
    if not _speaks_plaintext_http2(address, timeout) and _tls_answer(address, timeout) not in (None, "plaintext"):
        return (f"the coordinator at {target} requires TLS: set {TLS_CA_ENV} to the CA that signed its "
                f"certificate (and {TLS_CERT_ENV} / {TLS_KEY_ENV} if it requires client certificates)")
    return None


def _speaks_plaintext_http2(address: tuple[str, int], timeout: float) -> bool:
    """A plaintext HTTP/2 server answers the client preface with a SETTINGS frame."""
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            sock.sendall(_H2_PREFACE)
            first = sock.recv(16)
    except OSError:
        return False
    return len(first) >= 4 and first[3] == 0x04


def _tls_answer(address: tuple[str, int], timeout: float) -> str | None:
    """How the server answers a TLS handshake without a client certificate: "tls", "needs a client certificate",
    "plaintext", or None when nothing clear answers."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only the protocol is probed here
    context.set_alpn_protocols(["h2"])
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
