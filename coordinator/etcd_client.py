"""etcd3aio's client as the store uses it: one channel to every member, each request marked to need an etcd leader
(a member cut from the majority refuses at once instead of holding it), answers of any size, IP endpoints."""

from __future__ import annotations

import socket

import grpc

from ifrt.hostport import join_host_port, split_host_port

NO_LEADER = "etcdserver: no leader"
"""What an etcd member without a leader answers a request that requires one (etcd's ``hasleader`` metadata)."""


def _leader_required(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """``details`` with etcd's ``hasleader`` mark, as etcd's own client sends it: a member cut from the majority (no
    leader) then refuses the request at once with "etcdserver: no leader" instead of holding it until it times out."""
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), ("hasleader", "true")))


class _LeaderRequired(grpc.aio.UnaryUnaryClientInterceptor):
    """Marks every unary request ``_leader_required``. A refused one was not applied, so it is sent again, up to once
    per member: the channel picks members in turn (etcd3aio's round robin), so it goes to another one."""

    def __init__(self, members: int) -> None:
        self._tries = members

    async def intercept_unary_unary(self, continuation, details, request):
        details = _leader_required(details)
        for _ in range(self._tries - 1):
            call = await continuation(details, request)
            if await call.code() != grpc.StatusCode.UNAVAILABLE or NO_LEADER not in (await call.details() or ""):
                return call
        return await continuation(details, request)


class _LeaderRequiredStream(grpc.aio.StreamStreamClientInterceptor):
    """Marks every stream (the lease renewal) ``_leader_required``; a refused renewal is tried again by its caller,
    which lands on another member the same way. (gRPC takes each interceptor for one kind of call only.)"""

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_leader_required(details), request_iterator)


def etcd_client(endpoints: list[str], tls: dict):  # an etcd3aio Etcd3Client
    """etcd3aio's client on one channel to every member, with ``_LeaderRequired`` on it (etcd3aio has no hook for
    interceptors: its channel factory is replaced by one that adds them) and answers of any size (a journal is read
    in one range request, far over gRPC's 4 MiB default; etcd bounds requests, not answers)."""
    from etcd3aio import Etcd3Client  # the optional extra ifrt-topology[etcd]
    from etcd3aio.connections import ConnectionManager

    class Channels(ConnectionManager):
        def get_channel(self, ca_cert: bytes | None = None, cert_key: bytes | None = None,
                        cert_chain: bytes | None = None, tls_server_name: str | None = None) -> grpc.aio.Channel:
            options = [*self.grpc_options]
            interceptors = [_LeaderRequired(len(endpoints)), _LeaderRequiredStream()]
            if ca_cert is None:
                return grpc.aio.insecure_channel(self.target, options=options, interceptors=interceptors)
            if tls_server_name is not None:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            credentials = grpc.ssl_channel_credentials(root_certificates=ca_cert, private_key=cert_key,
                                                       certificate_chain=cert_chain)
            return grpc.aio.secure_channel(self.target, credentials, options=options, interceptors=interceptors)

    client = Etcd3Client(endpoints=endpoints, **tls)
    client._manager = Channels(endpoints)
    client._manager.grpc_options.append(("grpc.max_receive_message_length", -1))
    return client


def ip_endpoint(endpoint: str) -> str:
    """``etcd1:2379`` -> ``10.0.0.5:2379``: the etcd client dials IP literals only."""
    host, port = split_host_port(endpoint)
    try:
        return join_host_port(socket.gethostbyname(host), port)
    except OSError:
        return endpoint
