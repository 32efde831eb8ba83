"""``ifrt``: the process side from a shell (``ifrt discover``, ``ifrt plugins``, ``ifrt env``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from ifrt import clusters, render
from ifrt.client import Client
from ifrt.errors import IfrtError
from ifrt.settings import COORDINATOR_ENV, NUM_PROCESSES_ENV, PLUGIN_ENV, PROCESS_ID_ENV, resolve
from plugins import all_plugins


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ifrt", description="ifrt-topology from the shell.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = commands.add_parser(
        "discover", help="register this process with the coordinator and print the published topology",
        description="Registers this process's local devices with the coordinator, waits until every process has "
                    "registered, and prints the topology. Exits non-zero, with the error on stderr, on failure.")
    d.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                   help=f"coordinator address(es) (default ${COORDINATOR_ENV})")
    d.add_argument("--process-id", type=int, metavar="I",
                   help=f"this process's id (default ${PROCESS_ID_ENV}; unset: the coordinator assigns one)")
    d.add_argument("--num-processes", type=int, metavar="N",
                   help=f"expected process count, checked against the coordinator's (default ${NUM_PROCESSES_ENV})")
    d.add_argument("--plugin", metavar="NAME", help=f"device plugin (default ${PLUGIN_ENV}, else cpu)")
    d.add_argument("--transfer-bind", metavar="HOST:PORT",
                   help="where this process's transfer endpoint listens, advertised in the topology (default "
                        "$IFRT_TRANSFER_BIND, else an ephemeral port on the address that reaches the coordinator)")
    d.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="give up after this long, naming who is missing (default %(default)s)")
    d.add_argument("--json", action="store_true", help="print the topology as one JSON object (Topology.to_dict)")
    d.add_argument("--verbose", "-v", action="store_true", help="log progress while waiting")
    pl = commands.add_parser("plugins", help="list the device plugins found and whether each works here",
                             description="Lists built-in plugins and those of installed distributions (entry "
                                         "point group ifrt.plugins), whether each is available here and why not. "
                                         "A plugin that fails to load is listed with its error.")
    pl.add_argument("--json", action="store_true", help="one JSON object per plugin, one per line")
    commands.add_parser("env", help="show the settings discover() would use here, and where each comes from",
                        description="Shows the launcher environments found (torchrun, Open MPI, SLURM, Kubernetes) "
                                    "and the settings discover() would resolve from them and IFRT_* variables.")
    return p


def _plugins(as_json: bool) -> int:
    infos = all_plugins()
    if as_json:
        for info in infos:
            print(json.dumps({"name": info.name, "source": info.source, "status": info.status}))
        return 0
    rows = [("plugin", "source", "status")] + [(i.name, i.source, i.status) for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(2)]
    for name, source, status in rows:
        print(f"{name.ljust(widths[0])}  {source.ljust(widths[1])}  {status}")
    return 0


def _env() -> int:
    for found in clusters.present(os.environ):
        print(f"launcher {found.source}: " + ", ".join(f"{f}={getattr(found, f)}" for f in (
            "coordinator", "process_id", "num_processes", "local_rank", "local_world_size")))
    try:
        settings = resolve()
    except IfrtError as e:
        print(f"discover() would fail: {e}")
        return 1
    for field, value in vars(settings).items():
        print(f"{field}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "plugins":
        return _plugins(args.json)
    if args.command == "env":
        return _env()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with Client(args.coordinator, process_id=args.process_id, num_processes=args.num_processes,
                    plugin=args.plugin, timeout=args.timeout, transfer_bind=args.transfer_bind) as client:
            topology = client.discover()
    except IfrtError as e:
        print(f"ifrt discover: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(topology.to_json())
    else:
        print(render.summary(topology))
        print(f"this process: {topology.process_id}")
        print(render.table(topology))
    return 0


if __name__ == "__main__":
    sys.exit(main())
