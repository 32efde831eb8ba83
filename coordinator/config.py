"""The coordinator daemon's tunables in one object, each with its default and the reason for it: the cluster's
(the pure state machine's ``ClusterConfig``) and the server's around it. ``coordinator.main``'s flags fill it."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.core.cluster import ClusterConfig
from coordinator.store import EtcdAccess


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything the daemon is run with; ``cluster`` is what the state machine decides by."""

    cluster: ClusterConfig
    bind: str = "0.0.0.0:8476"
    """Where to listen for processes (host:port; port 0 picks a free one, see ready_file)."""
    tick_interval_s: float | None = None
    """How often silent processes and overdue barriers are looked for; None: a twentieth of the heartbeat timeout,
    between 0.02 and 0.1 s. A tick looks only at processes without a session or call, so it can be this frequent:
    a failure is reported at most that much after the timeout, and an idle cluster's tick costs the same at any N."""

    @property
    def tick_s(self) -> float:
        if self.tick_interval_s is not None:
            return self.tick_interval_s
        return min(0.1, max(0.02, self.cluster.heartbeat_timeout_s / 20))

    @property
    def keepalive_interval_s(self) -> float:
        """How often the coordinator pings each connection (HTTP/2 keepalive): ClusterConfig.keepalive_interval_s."""
        return self.cluster.keepalive_interval_s

    @property
    def keepalive_timeout_s(self) -> float:
        """How long a ping may go unanswered before the coordinator drops the connection (ending its session):
        ClusterConfig.keepalive_timeout_s. A drop is not a failure: the process is failed only once silent beyond
        the heartbeat timeout (ClusterConfig.grace_after_session)."""
        return self.cluster.keepalive_timeout_s

    @property
    def keepalive_options(self) -> tuple[tuple[str, int], ...]:
        """gRPC server options that carry liveness: every connection is pinged each keepalive interval (in gRPC's
        core, no Python involved) and dropped once a ping goes unanswered for the keepalive timeout, which ends
        the process's session (see ClusterState.detach)."""
        interval_ms = max(1, round(self.keepalive_interval_s * 1000))
        timeout_ms = max(1, round(self.keepalive_timeout_s * 1000))
        return (
            ("grpc.keepalive_time_ms", interval_ms),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            # What chttp2 actually waits for a ping's ack (grpcio 1.85): keepalive_timeout_ms alone leaves it at 60 s.
            ("grpc.http2.ping_timeout_ms", timeout_ms),
            # Keep pinging a connection that sends nothing (a quiet session) instead of stopping after two pings.
            ("grpc.http2.max_pings_without_data", 0),
        )
    progress_interval_s: float = 10.0
    """How often the log names who is still missing while the cluster is incomplete."""
    progress_hosts: int = 32
    """Registered hosts listed in one progress answer (the count is always exact)."""
    gc_interval_s: float = 1.0
    """How often young garbage is collected (a few milliseconds at most: the heap start-up made is frozen)."""
    busy_callers: int = 16
    """From this many calls waiting for the journal on, the writer lets entries gather between store writes."""
    write_spacing: float = 4.0
    """Under load, a store write starts no sooner than this many times the last write's duration after that one
    started (``max_write_spacing_s`` at most): the store is then busy about a quarter of the time or less, and each
    write carries everything queued meanwhile."""
    max_write_spacing_s: float = 0.05
    shutdown_grace_s: float = 1.0
    """How long calls in flight may finish after SIGTERM/SIGINT before they are cancelled."""
    check_replay: bool = False
    """At a graceful stop, replay the journal into a fresh state and log whether it is the live one."""
    store: str = "memory"
    """memory, or etcd://HOST:PORT[,HOST:PORT...] to survive restarts and run standby replicas."""
    leader_ttl_s: int = 5
    """With etcd: the leader's lease; a standby takes over this long after the leader dies."""
    advertise: str | None = None
    """The address clients reach this replica at, shown by standbys (default: the bound address)."""
    ready_file: str | None = None
    """If set, "host:port" is written here once the server accepts calls (for scripts and tests)."""
    token: str | None = field(default=None, repr=False)
    """If set, every Coordinator call must carry this shared secret (read from --token-file; never logged)."""
    agent_key: str | None = field(default=None, repr=False)
    """If set, an agent joins only with its host's credential under this key (``ifrt.agent_credential``; read from
    --agent-key-file; never logged). With a token and no agent key, no agent may join."""
    tls_cert: str | None = None
    """PEM certificate (and tls_key its key) to serve TLS with; None serves plaintext."""
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """If set, mutual TLS: every client must present a certificate signed by this CA."""
    etcd_access: EtcdAccess = field(default_factory=EtcdAccess)
    """With --store etcd: TLS files and a user for etcd (none by default)."""
    metrics_port: int | None = None
    """If set, Prometheus metrics are served over HTTP on this port (0 picks one); off by default."""
    metrics_bind: str = "0.0.0.0"
    """The host the metrics server listens on; keep the port inside the cluster's network."""
    metrics_token: bool = False
    """Whether the metrics port asks for ``token`` as well (a Bearer header, or Basic with it as password)."""
    grpc_options: tuple[tuple[str, int], ...] = field(default=(
        # A burst of thousands of registrations must queue, not be dropped with CANCELLED.
        ("grpc.server.max_pending_requests", 1 << 16),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 16),
        # Two coordinators must not silently share one port.
        ("grpc.so_reuseport", 0),
        # Clients ping (after 5 s without hearing from us) to notice a vanished coordinator; do not punish them.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ))
