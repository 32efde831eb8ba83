"""``ifrt``: the process side from a shell (``ifrt discover``)."""

from __future__ import annotations

import argparse
import logging
import sys

from ifrt import render
from ifrt.client import Client
from ifrt.errors import IfrtError
from ifrt.settings import COORDINATOR_ENV, NUM_PROCESSES_ENV, PLUGIN_ENV, PROCESS_ID_ENV


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
    d.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="give up after this long, naming who is missing (default %(default)s)")
    d.add_argument("--json", action="store_true", help="print the topology as one JSON object (Topology.to_dict)")
    d.add_argument("--verbose", "-v", action="store_true", help="log progress while waiting")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with Client(args.coordinator, process_id=args.process_id, num_processes=args.num_processes,
                    plugin=args.plugin, timeout=args.timeout) as client:
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
