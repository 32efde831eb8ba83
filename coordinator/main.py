"""``ifrt-coordinator``: the daemon that gathers every process's devices and publishes one topology."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys

from coordinator import logs
from coordinator.config import CoordinatorConfig
from coordinator.core.cluster import ClusterConfig, FailurePolicy
from coordinator.core.limits import FLAGS as LIMIT_FLAGS
from coordinator.core.limits import Limits
from coordinator.store import MIN_LEASE_TTL_S, EtcdAccess, check_lease_ttl, lease_margin, open_store
from ifrt.agent_credential import AGENT_KEY_FILE_ENV, read_agent_key
from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_LOCAL_DEVICES, MAX_PROCESSES, MAX_PROCESSES_INT64
from ifrt.protocol import read_secret_file

DEFAULTS = CoordinatorConfig(cluster=ClusterConfig(num_processes=1))


TUNING = ("--max-heartbeat-rate", "--hung-timeouts", "--progress-interval", "--check-replay")
"""Flags besides the limits and budgets that ``--help`` leaves to ``--help-limits``: rates, timings, a self-check."""


def parser(full: bool = False) -> argparse.ArgumentParser:
    """The daemon's flags. ``--help`` shows what starting it takes (the job, its store, who may call, logs and
    metrics); ``--help-limits`` (``full``) adds the limits, budgets and timings, which have safe defaults."""
    p = argparse.ArgumentParser(
        prog="ifrt-coordinator",
        description="Gathers the local devices of every process of a job over gRPC, assigns process and global "
                    "device ids (process_id << 17 | local_id), and publishes one topology, byte-identical in "
                    "every process, once all --num-processes have registered.",
        epilog="Processes connect with IFRT_COORDINATOR=HOST:PORT and ifrt.discover(). Stops cleanly on SIGTERM "
               "or SIGINT.",
    )
    p.add_argument("--help-limits", action=_FullHelp, nargs=0,
                   help="show every flag, the limits, memory budgets and timings included, and exit")
    p.add_argument("--num-processes", type=int, required=True, metavar="N",
                   help="how many processes the job has; the topology is published when all N registered")
    p.add_argument("--bind", default=DEFAULTS.bind, metavar="HOST:PORT",
                   help="address to listen on (default %(default)s; port 0 picks a free port)")
    p.add_argument("--cluster-id", default=DEFAULTS.cluster.cluster_id, metavar="ID",
                   help="name of this job's cluster; processes that ask for another cluster id are refused "
                        "(default %(default)s)")
    p.add_argument("--attempt", type=int, default=DEFAULTS.cluster.attempt, metavar="N",
                   help="the job attempt this coordinator serves (default %(default)s): with --store etcd, a new "
                        "attempt starts from an empty journal (no key-value or barrier result of an earlier attempt "
                        "is seen) and fences the earlier one off; processes of another attempt (IFRT_ATTEMPT, "
                        "TORCHELASTIC_RESTART_COUNT, SLURM_RESTART_COUNT) are refused")
    p.add_argument("--max-restarts", type=int, default=DEFAULTS.cluster.max_restarts, metavar="N",
                   help="the job's restart budget: restarts in place (`ifrt run`) the coordinator decides before the "
                        "job is over (default: the first agent's `ifrt run --max-restarts`, 0 if it gives none); "
                        "an agent stating another is refused")
    p.add_argument("--store", default=DEFAULTS.store, metavar="memory|etcd://HOST:PORT[,HOST:PORT...]",
                   help="where registrations, failures and key-values are kept: memory (default; lost when this "
                        "process ends) or etcd, which survives restarts and lets standby replicas take over "
                        "(needs ifrt-topology[etcd]); every change is durable there before it is acknowledged")
    p.add_argument("--leader-ttl", type=int, default=DEFAULTS.leader_ttl_s, metavar="SECONDS",
                   help="with etcd: the leader's lease; a standby takes over this long after the leader dies, "
                        "and a leader cut off from etcd stops answering 10%% of it (at least "
                        f"{lease_margin(MIN_LEASE_TTL_S):g} s) before it can expire (default %(default)s, at least "
                        f"{MIN_LEASE_TTL_S})")
    p.add_argument("--advertise", metavar="HOST:PORT",
                   help="the address clients use for this replica, reported by standbys (default: --bind)")
    p.add_argument("--int64-ids", action="store_true",
                   help=f"allow process ids up to 2**46 (global ids then need int64); by default process ids "
                        f"stay below {MAX_PROCESSES} so every global id fits in int32")
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULTS.cluster.heartbeat_timeout_s, metavar="SECONDS",
                   help="the silence a process is allowed: one the coordinator hears nothing from for longer (no "
                        "heartbeat, no answered keepalive ping, no session) is declared failed and every other "
                        "process is told, never sooner; a silent one within 1/4 of it more (pings go every 1/4, "
                        "a connection whose ping is unanswered for 1/2 is dropped, and its process has what the "
                        "timeout leaves of its silence to attach again). A process whose connection closed while "
                        "it answered (killed) is declared failed after 1/8 of it. When most of the job goes "
                        "silent at once, the leader steps aside for this long instead (docs/failures.md) "
                        "(default %(default)s)")
    p.add_argument("--max-heartbeat-rate", type=float, default=DEFAULTS.cluster.max_heartbeat_rate, metavar="N",
                   help="heartbeats a second all sessions together may send (default %(default)g): each session "
                        "sends one every fifth of --heartbeat-timeout, spaced further for jobs larger than this "
                        "rate allows, so that a process that stops answering shows as slow (after a third of the "
                        "timeout, later when spaced) before it is declared failed; each heartbeat costs the "
                        "coordinator about 0.1-0.3 ms of CPU")
    p.add_argument("--hung-timeouts", type=float, default=DEFAULTS.cluster.hung_timeouts, metavar="N",
                   help="a process whose session stays connected but sends no heartbeat for N heartbeat timeouts "
                        "(a deadlock holding Python's GIL leaves its connection answered) is declared failed "
                        "(default %(default)g; 0: never, it is only shown slow)")
    p.add_argument("--on-failure", choices=[p.value for p in FailurePolicy], default=FailurePolicy.PROPAGATE.value,
                   help="propagate: report a failed process to all others and keep the topology (default); "
                        "elastic: drop it and publish a new generation over the survivors (see --min-processes); "
                        "under `ifrt run --recover replace` its agents then wait for nothing, and a process that "
                        "takes the id again (replaced, its agent back, a spare host) is in the next generation "
                        "(docs/failures.md, 'Go on first, grow after')")
    p.add_argument("--min-processes", type=int, metavar="M",
                   help="with --on-failure elastic: the fewest processes a new generation may have; below it the "
                        "failure is reported as fatal (default 1). Without it, for jobs of `ifrt run --recover "
                        "replace`: a failed process neither replaced nor taken over within the agents' "
                        "--replace-timeout is dropped, and the survivors go on in a new generation, while at least "
                        "M processes remain (a shrink; else the whole job restarts)")
    p.add_argument("--allow-mixed-platforms", action="store_true",
                   help="let processes with different device plugins or platforms form one cluster (by default "
                        "the first process's plugin and platform are required of all)")
    limits = p.add_argument_group(
        "limits", "what callers may send; a request over a limit is refused with INVALID_ARGUMENT naming the value, "
                  "the limit and its flag (gRPC itself refuses a message over --max-request-bytes), and changes "
                  "nothing; sizes of text are bytes of UTF-8")
    default = DEFAULTS.cluster.limits
    limits.add_argument("--max-request-bytes", dest="request_bytes", type=int, default=default.request_bytes,
                        metavar="BYTES", help="largest message of any call; gRPC refuses larger ones with "
                                              "RESOURCE_EXHAUSTED (default %(default)s)")
    limits.add_argument("--max-devices-per-process", dest="devices_per_process", type=int,
                        default=default.devices_per_process, metavar="N",
                        help=f"most devices one process may register (default %(default)s; at most "
                             f"{MAX_LOCAL_DEVICES}, 2**17, the local ids a global id encodes)")
    limits.add_argument("--max-attributes", dest="attributes_per_device", type=int,
                        default=default.attributes_per_device, metavar="N",
                        help="most attributes one device may carry (default %(default)s)")
    limits.add_argument("--max-string-bytes", dest="string_bytes", type=int, default=default.string_bytes,
                        metavar="BYTES", help="longest hostname, address, cluster id, plugin, platform, kind, slice "
                                              "key, attribute key or attribute value, and a call's request or call "
                                              "id (default %(default)s)")
    limits.add_argument("--kv-max-value-bytes", dest="kv_value_bytes", type=int, default=default.kv_value_bytes,
                        metavar="BYTES", help="largest value the key-value store accepts (default %(default)s)")
    limits.add_argument("--kv-max-keys", dest="kv_keys", type=int, default=default.kv_keys, metavar="N",
                        help="most keys the key-value store holds; a new key beyond them is refused, overwriting "
                             "an existing one is not (default %(default)s)")
    limits.add_argument("--kv-max-key-bytes", dest="kv_key_bytes", type=int, default=default.kv_key_bytes,
                        metavar="BYTES", help="longest key of the key-value store (default %(default)s)")
    limits.add_argument("--max-barrier-name-bytes", dest="barrier_name_bytes", type=int,
                        default=default.barrier_name_bytes, metavar="BYTES",
                        help="longest barrier name (default %(default)s)")
    limits.add_argument("--max-concurrent-streams", dest="concurrent_streams", type=int,
                        default=default.concurrent_streams, metavar="N",
                        help="calls one client connection may have open at once (HTTP/2 streams; per connection, "
                             "so a host with several connections gets this many on each); further calls wait for "
                             "one to end instead of failing (default %(default)s; 0: gRPC's own, no limit)")
    limits.add_argument("--max-barriers", dest="barriers", type=int, default=default.barriers, metavar="N",
                        help="most barriers kept, finished and cancelled ones included (a name is used once and "
                             "its result repeated to late callers); a new name beyond them is refused; what one "
                             "process holds alone (cancels of barriers nobody arrived at, barriers nobody else "
                             "arrived at) is at most this divided by --num-processes (default %(default)s)")
    limits.add_argument("--max-watches-per-session", dest="watches_per_session", type=int,
                        default=default.watches_per_session, metavar="N",
                        help="most key prefixes one process's session watches (each at most --kv-max-key-bytes "
                             "long); a watch beyond them is not started (default %(default)s)")
    limits.add_argument("--max-session-backlog-bytes", dest="session_backlog_bytes", type=int,
                        default=default.session_backlog_bytes, metavar="BYTES",
                        help="most bytes of events a session may leave unread; past it the session is ended and "
                             "its process attaches again (default %(default)s)")
    limits.add_argument("--max-health-name-bytes", dest="health_name_bytes", type=int,
                        default=default.health_name_bytes, metavar="BYTES",
                        help="longest service name a health check or watch may name; the health service needs no "
                             "token (default %(default)s)")
    limits.add_argument("--max-health-watches-per-connection", dest="health_watches_per_connection", type=int,
                        default=default.health_watches_per_connection, metavar="N",
                        help="health watches one connection may hold open (default %(default)s)")
    limits.add_argument("--max-health-watches", dest="health_watches", type=int, default=default.health_watches,
                        metavar="N", help="health watches held open at once over all connections (default "
                                          "%(default)s)")
    limits.add_argument("--max-stranger-health-watches", dest="stranger_health_watches", type=int,
                        default=default.stranger_health_watches, metavar="N",
                        help="with --token-file: health watches held open at once by callers whose connection made "
                             "no call with the token; further ones are refused with RESOURCE_EXHAUSTED, and each "
                             "ends after --max-connection-idle (default %(default)s)")
    limits.add_argument("--first-message-timeout", dest="first_message_seconds", type=int,
                        default=default.first_message_seconds, metavar="SECONDS",
                        help="how long a Session or health call may take to send its first message before it is "
                             "ended (default %(default)s)")
    limits.add_argument("--max-connection-idle", dest="connection_idle_seconds", type=int,
                        default=default.connection_idle_seconds, metavar="SECONDS",
                        help="close a connection that has no call in flight, or has not finished its handshake, "
                             "for this long; a process's session keeps its connection busy, and clients reconnect "
                             "by themselves (default %(default)s)")
    limits.add_argument("--max-event-history", dest="event_history", type=int, default=default.event_history,
                        metavar="N",
                        help="job events kept for sessions that attach or reconnect late; one further behind is "
                             "sent each process's state instead (default %(default)s)")
    limits.add_argument("--max-connections", dest="connections", type=int, default=default.connections,
                        metavar="N",
                        help="most connections at once, further ones are refused at accept (default %(default)s: "
                             "what the job uses, --num-processes twice (a process and an agent each) plus 128, "
                             "within the descriptor limit, raised to its hard limit at start, less 64 the "
                             "coordinator keeps for itself; a job needs a descriptor limit of at least "
                             "--num-processes + 128, and the coordinator warns at start when it is lower)")
    limits.add_argument("--max-stranger-connections", dest="stranger_connections", type=int,
                        default=default.stranger_connections, metavar="N",
                        help="with --token-file: connections held at once by callers that made no call with the "
                             "token (probes, strangers); past it the oldest of them, a second or more old, are "
                             "closed, and gRPC accepts twice N connections beyond --max-connections, so strangers "
                             "never take the job's share (default %(default)s)")
    limits.add_argument("--max-agents", dest="agents", type=int, default=default.agents, metavar="N",
                        help="job watches (WatchJob, one per `ifrt run` agent) held open at once; further ones are "
                             "refused with RESOURCE_EXHAUSTED (default %(default)s)")
    budgets = p.add_argument_group(
        "memory budgets", "bytes a caller can make the coordinator hold, each with its own RESOURCE_EXHAUSTED that "
                          "names its flag (docs/security.md adds them up)")
    budgets.add_argument("--kv-max-bytes", dest="kv_bytes", type=int, default=default.kv_bytes, metavar="BYTES",
                         help="bytes the key-value store holds: keys, values and 256 bytes a key; a write past it is "
                              "refused, a smaller overwrite or a deletion is not (default %(default)s)")
    budgets.add_argument("--max-reply-bytes", dest="reply_bytes", type=int, default=default.reply_bytes,
                         metavar="BYTES", help="largest answer built for one call (a KeyValueDir listing); a larger "
                                               "one is refused (default %(default)s)")
    budgets.add_argument("--max-answers-per-caller", dest="answers_per_caller", type=int,
                         default=default.answers_per_caller, metavar="N",
                         help="increments and swaps whose answers are kept per caller for its retries; a retry of "
                              "an older call is refused (default %(default)s)")
    budgets.add_argument("--max-answer-bytes", dest="answer_bytes", type=int, default=default.answer_bytes,
                         metavar="BYTES", help="bytes of remembered answers over all callers, a swap's value "
                                               "included (its journal entry keeps it), and a record per caller of "
                                               "what it forgot; the oldest call is forgotten first and its retry "
                                               "refused, never applied twice (default %(default)s)")
    budgets.add_argument("--max-barrier-bytes", dest="barrier_bytes", type=int, default=default.barrier_bytes,
                         metavar="BYTES", help="bytes barriers hold, finished and cancelled ones included (names, "
                                               "participants); a new barrier past it is refused; what one "
                                               "process holds alone (cancels of barriers nobody arrived at, "
                                               "barriers nobody else arrived at) is at most this divided by "
                                               "--num-processes (default %(default)s)")
    budgets.add_argument("--max-sessions-per-process", dest="sessions_per_process", type=int,
                         default=default.sessions_per_process, metavar="N",
                         help="sessions one process holds open at once; a newer one ends the oldest (default "
                              "%(default)s)")
    budgets.add_argument("--max-backlog-bytes", dest="backlog_bytes", type=int, default=default.backlog_bytes,
                         metavar="BYTES", help="bytes of events all sessions together leave unread (an event sent to "
                                               "many is counted once); past it the session holding the most is "
                                               "ended and its process attaches again (default %(default)s)")
    budgets.add_argument("--max-registration-bytes", dest="registration_bytes", type=int,
                         default=default.registration_bytes, metavar="BYTES",
                         help="bytes of registrations one job attempt keeps (journaled), restarted processes' "
                              "included; a registration past it is refused (default %(default)s)")
    budgets.add_argument("--max-watch-bytes", dest="watch_bytes", type=int, default=default.watch_bytes,
                         metavar="BYTES", help="bytes of key prefixes all sessions together watch; a watch past it is "
                                               "not started and is logged (default %(default)s)")
    budgets.add_argument("--max-pending-reply-bytes", dest="pending_reply_bytes", type=int,
                         default=default.pending_reply_bytes, metavar="BYTES",
                         help="bytes of large answers (64 KiB and more) built and not yet read by their callers, "
                              "over all calls; an answer past it is refused (default %(default)s)")
    p.add_argument("--progress-interval", type=float, default=DEFAULTS.progress_interval_s, metavar="SECONDS",
                   help="how often to log who is still missing while waiting (default %(default)s)")
    p.add_argument("--check-replay", action="store_true",
                   help="at a graceful stop (SIGTERM, SIGINT), replay the journal into a fresh state and log whether "
                        "it is the live one, or the first part that differs (an ERROR): the check a replica that "
                        "takes over relies on, at the cost of one replay at exit")
    p.add_argument("--ready-file", metavar="PATH",
                   help="write HOST:PORT to this file once serving (useful with port 0)")
    p.add_argument("--token-file", metavar="PATH",
                   help="require this file's content (a shared secret) on every call: clients send it from "
                        "IFRT_TOKEN_FILE or IFRT_TOKEN; calls without it get UNAUTHENTICATED (default: no token)")
    p.add_argument("--agent-key-file", metavar="PATH", default=os.environ.get(AGENT_KEY_FILE_ENV),
                   help="bind `ifrt run` agents to their hosts: an agent joins only with its host's credential, the "
                        "HMAC of the host's name under this file's key (`ifrt agent-credential --host H` prints it; "
                        "an agent given the key file derives its own). Required for agents when --token-file is "
                        "set: a token holder alone may register processes, never act as an agent "
                        f"(${AGENT_KEY_FILE_ENV}; default: none)")
    p.add_argument("--tls-cert", metavar="PEM",
                   help="serve TLS with this certificate (needs --tls-key); clients then need IFRT_TLS_CA")
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-client-ca", metavar="PEM",
                   help="mutual TLS: require every client to present a certificate signed by this CA "
                        "(IFRT_TLS_CERT and IFRT_TLS_KEY on the clients; needs --tls-cert)")
    etcd = p.add_argument_group("etcd security", "for --store etcd://...; each flag falls back to its variable")
    etcd.add_argument("--etcd-ca", metavar="PEM", default=os.environ.get("IFRT_ETCD_CA"),
                      help="talk TLS to etcd, trusting this CA ($IFRT_ETCD_CA)")
    etcd.add_argument("--etcd-cert", metavar="PEM", default=os.environ.get("IFRT_ETCD_CERT"),
                      help="client certificate for etcd's --client-cert-auth ($IFRT_ETCD_CERT; needs --etcd-key)")
    etcd.add_argument("--etcd-key", metavar="PEM", default=os.environ.get("IFRT_ETCD_KEY"),
                      help="the private key of --etcd-cert ($IFRT_ETCD_KEY)")
    etcd.add_argument("--etcd-user", metavar="NAME", default=os.environ.get("IFRT_ETCD_USER"),
                      help="log in to etcd as this user ($IFRT_ETCD_USER; needs --etcd-password-file)")
    etcd.add_argument("--etcd-password-file", metavar="PATH", default=os.environ.get("IFRT_ETCD_PASSWORD_FILE"),
                      help="file holding that user's password ($IFRT_ETCD_PASSWORD_FILE)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log verbosity on stderr (default %(default)s)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text: one readable line per record (default); json: one JSON object per line with time, "
                        "level, message, cluster_id and, where known, event, process_id and host")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics over HTTP at /metrics on this port (0 picks a free one, logged); "
                        "off by default")
    p.add_argument("--metrics-bind", default=DEFAULTS.metrics_bind, metavar="HOST",
                   help="the address the metrics server listens on (default %(default)s); the port shows hosts, "
                        "addresses and failure reasons: bind it to 127.0.0.1 or a management network, or add "
                        "--metrics-token")
    p.add_argument("--metrics-token", action="store_true",
                   help="the metrics port asks for the --token-file token too: `Authorization: Bearer TOKEN` "
                        "(Prometheus: authorization.credentials_file), or any user and TOKEN as password")
    if not full:
        tuning = [a for a in p._actions
                  if a in limits._group_actions + budgets._group_actions or set(a.option_strings) & set(TUNING)]
        for action in tuning:
            action.help = argparse.SUPPRESS
        p.epilog += (f" Limits, memory budgets and timings ({len(tuning)} more flags, each with a safe default): "
                     "ifrt-coordinator --help-limits.")
    return p


class _FullHelp(argparse.Action):
    """``--help-limits``: prints the help of every flag and exits, as ``--help`` does."""

    def __call__(self, p: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser(full=True).print_help()
        p.exit()


def _etcd_access(args: argparse.Namespace) -> EtcdAccess:
    """The etcd security flags, checked; InvalidArgument naming the flag that is wrong."""
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise InvalidArgument("--etcd-cert and --etcd-key go together: give both, or neither")
    if args.etcd_cert and not args.etcd_ca:
        raise InvalidArgument("--etcd-cert needs --etcd-ca: client certificates are part of TLS")
    if bool(args.etcd_user) != bool(args.etcd_password_file):
        raise InvalidArgument("--etcd-user and --etcd-password-file go together: give both, or neither")
    for flag, path in (("--etcd-ca", args.etcd_ca), ("--etcd-cert", args.etcd_cert), ("--etcd-key", args.etcd_key)):
        if path and not os.access(path, os.R_OK):
            raise InvalidArgument(f"{flag} {path!r} is not a readable file")
    password = read_secret_file(args.etcd_password_file, "--etcd-password-file") if args.etcd_user else None
    return EtcdAccess(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user, password)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format, args.cluster_id)
    try:
        try:
            check_lease_ttl(args.leader_ttl)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if args.attempt < 0:
            raise InvalidArgument(f"--attempt {args.attempt} is out of range: expected an integer >= 0")
        token = read_secret_file(args.token_file, "--token-file") if args.token_file else None
        agent_key = read_agent_key(args.agent_key_file, "--agent-key-file") if args.agent_key_file else None
        if bool(args.tls_cert) != bool(args.tls_key):
            raise InvalidArgument("--tls-cert and --tls-key go together: give both, or neither for plaintext")
        if args.tls_client_ca and not args.tls_cert:
            raise InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                           ("--tls-client-ca", args.tls_client_ca)):
            if path and not os.access(path, os.R_OK):
                raise InvalidArgument(f"{flag} {path!r} is not a readable file")
        etcd_access = _etcd_access(args)
        if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
            raise InvalidArgument(f"--metrics-port {args.metrics_port} is out of range: expected 0 to 65535")
        if args.metrics_token and token is None:
            raise InvalidArgument("--metrics-token needs --token-file: it asks for that token on the metrics port")
        cluster = ClusterConfig(num_processes=args.num_processes, cluster_id=args.cluster_id,
                                max_processes=MAX_PROCESSES_INT64 if args.int64_ids else MAX_PROCESSES,
                                heartbeat_timeout_s=args.heartbeat_timeout, on_failure=FailurePolicy(args.on_failure),
                                max_heartbeat_rate=args.max_heartbeat_rate, hung_timeouts=args.hung_timeouts,
                                min_processes=args.min_processes or 1, shrink=args.min_processes is not None,
                                limits=Limits(**{name: getattr(args, name) for name in LIMIT_FLAGS}),
                                allow_mixed_platforms=args.allow_mixed_platforms, attempt=args.attempt,
                                max_restarts=args.max_restarts)
    except InvalidArgument as e:
        print(f"ifrt-coordinator: {e}", file=sys.stderr)
        return 2
    try:
        open_store(args.store, args.cluster_id)  # fail on a bad --store before serving anything
    except ValueError as e:
        print(f"ifrt-coordinator: {e}", file=sys.stderr)
        return 2
    config = CoordinatorConfig(cluster=cluster, bind=args.bind,
                               progress_interval_s=args.progress_interval, ready_file=args.ready_file,
                               check_replay=args.check_replay,
                               store=args.store, leader_ttl_s=args.leader_ttl, advertise=args.advertise,
                               metrics_port=args.metrics_port, metrics_bind=args.metrics_bind,
                               metrics_token=args.metrics_token, token=token, agent_key=agent_key,
                               tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                               etcd_access=etcd_access)
    if token is None:
        logging.getLogger("ifrt.coordinator").warning(
            "no cluster token (--token-file): any client that reaches %s may call the coordinator, register "
            "processes and read every key-value (transfers still prove each sender with its own process's key)",
            args.bind)
    if token is not None and agent_key is None:
        logging.getLogger("ifrt.coordinator").warning(
            "no agent key (--agent-key-file): `ifrt run` agents cannot join this job, since the token alone does "
            "not say which host an agent acts for")
    from coordinator.server import BindError, serve  # here: a flag refused above (or --help) needs none of it

    gc.freeze()  # what start-up allocated is never garbage: keep the collector off it under load
    try:
        asyncio.run(serve(config))
    except BindError as e:
        print(f"ifrt-coordinator: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
