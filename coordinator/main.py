"""``ifrt-coordinator``: the daemon that gathers every process's devices and publishes one topology."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

from coordinator.config import CoordinatorConfig
from coordinator.server import BindError, serve
from coordinator.state import ClusterConfig, FailurePolicy
from coordinator.store import open_store
from ifrt.errors import InvalidArgument
from ifrt.ids import MAX_PROCESSES, MAX_PROCESSES_INT64

DEFAULTS = CoordinatorConfig(cluster=ClusterConfig(num_processes=1))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ifrt-coordinator",
        description="Gathers the local devices of every process of a job over gRPC, assigns process and global "
                    "device ids (process_id << 17 | local_id), and publishes one topology, byte-identical in "
                    "every process, once all --num-processes have registered.",
        epilog="Processes connect with IFRT_COORDINATOR=HOST:PORT and ifrt.discover(). Stops cleanly on SIGTERM "
               "or SIGINT.",
    )
    p.add_argument("--num-processes", type=int, required=True, metavar="N",
                   help="how many processes the job has; the topology is published when all N registered")
    p.add_argument("--bind", default=DEFAULTS.bind, metavar="HOST:PORT",
                   help="address to listen on (default %(default)s; port 0 picks a free port)")
    p.add_argument("--cluster-id", default=DEFAULTS.cluster.cluster_id, metavar="ID",
                   help="name of this job's cluster; processes that ask for another cluster id are refused "
                        "(default %(default)s)")
    p.add_argument("--store", default=DEFAULTS.store, metavar="memory|etcd://HOST:PORT[,HOST:PORT...]",
                   help="where registrations, failures and key-values are kept: memory (default; lost when this "
                        "process ends) or etcd, which survives restarts and lets standby replicas take over "
                        "(needs ifrt-topology[etcd]); every change is durable there before it is acknowledged")
    p.add_argument("--leader-ttl", type=int, default=DEFAULTS.leader_ttl_s, metavar="SECONDS",
                   help="with etcd: the leader's lease; a standby takes over this long after the leader dies "
                        "(default %(default)s)")
    p.add_argument("--advertise", metavar="HOST:PORT",
                   help="the address clients use for this replica, reported by standbys (default: --bind)")
    p.add_argument("--int64-ids", action="store_true",
                   help=f"allow process ids up to 2**46 (global ids then need int64); by default process ids "
                        f"stay below {MAX_PROCESSES} so every global id fits in int32")
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULTS.cluster.heartbeat_timeout_s, metavar="SECONDS",
                   help="a process that sends no heartbeat for this long, or loses its connection and is not back "
                        "within it, is declared failed and every other process is told (default %(default)s)")
    p.add_argument("--on-failure", choices=[p.value for p in FailurePolicy], default=FailurePolicy.PROPAGATE.value,
                   help="propagate: report a failed process to all others and keep the topology (default); "
                        "elastic: drop it and publish a new generation over the survivors (see --min-processes)")
    p.add_argument("--min-processes", type=int, metavar="M",
                   help="with --on-failure elastic: the fewest processes a new generation may have; below it the "
                        "failure is reported as fatal (default 1)")
    p.add_argument("--allow-mixed-platforms", action="store_true",
                   help="let processes with different device plugins or platforms form one cluster (by default "
                        "the first process's plugin and platform are required of all)")
    p.add_argument("--kv-max-value-bytes", type=int, default=DEFAULTS.cluster.kv_max_value_bytes, metavar="BYTES",
                   help="largest value the key-value store accepts (default %(default)s)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULTS.max_request_bytes, metavar="BYTES",
                   help="largest registration accepted; larger ones get RESOURCE_EXHAUSTED (default %(default)s)")
    p.add_argument("--progress-interval", type=float, default=DEFAULTS.progress_interval_s, metavar="SECONDS",
                   help="how often to log who is still missing while waiting (default %(default)s)")
    p.add_argument("--ready-file", metavar="PATH",
                   help="write HOST:PORT to this file once serving (useful with port 0)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log verbosity on stderr (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.min_processes is not None and args.on_failure != FailurePolicy.ELASTIC:
            raise InvalidArgument("--min-processes applies only with --on-failure elastic")
        cluster = ClusterConfig(num_processes=args.num_processes, cluster_id=args.cluster_id,
                                max_processes=MAX_PROCESSES_INT64 if args.int64_ids else MAX_PROCESSES,
                                heartbeat_timeout_s=args.heartbeat_timeout, on_failure=FailurePolicy(args.on_failure),
                                min_processes=args.min_processes or 1,
                                kv_max_value_bytes=args.kv_max_value_bytes,
                                allow_mixed_platforms=args.allow_mixed_platforms)
    except InvalidArgument as e:
        print(f"ifrt-coordinator: {e}", file=sys.stderr)
        return 2
    try:
        open_store(args.store, args.cluster_id)  # fail on a bad --store before serving anything
    except ValueError as e:
        print(f"ifrt-coordinator: {e}", file=sys.stderr)
        return 2
    config = CoordinatorConfig(cluster=cluster, bind=args.bind, max_request_bytes=args.max_request_bytes,
                               progress_interval_s=args.progress_interval, ready_file=args.ready_file,
                               store=args.store, leader_ttl_s=args.leader_ttl, advertise=args.advertise)
    gc.freeze()  # what start-up allocated is never garbage: keep the collector off it under load
    try:
        asyncio.run(serve(config))
    except BindError as e:
        print(f"ifrt-coordinator: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
