"""A job's process that stays up and reports on stdout, one JSON object a line: its topology, then every event.

    IFRT_COORDINATOR=c1:8476,c2:8476 IFRT_PROCESS_ID=2 IFRT_NUM_PROCESSES=4 python examples/cluster_worker.py

Lines, in the order they happen:

    {"topology": "<fingerprint>", "generation": 1, "process_id": 2, "hostname": "worker2", "address": "...",
     "processes": 4, "hosts": 4}
    {"preflight": {...}}                           with --preflight: Client.preflight's report (PreflightReport)
    {"event": "CoordinatorLost", "reason": "..."}  and every other event, with its fields
    {"event": "CoordinatorRestored", "coordinator": "c2:8476"}
    {"rechecked": "<fingerprint>", "generation": 1, "coordinator": "c2:8476"}

After each CoordinatorRestored it sends its registration again (the same idempotent request) and prints what the
replica now leading answers: the same fingerprint and generation when nothing was lost in the takeover. It runs
until SIGTERM or SIGINT (then it leaves the cluster, so peers see ProcessLeft) or until it is killed.
scripts/compose-demo.sh and scripts/multihost.sh run four of these.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

import ifrt
from ifrt import events

_say = threading.Lock()


def say(**fields: object) -> None:
    """One JSON line, whole: events arrive on the session thread while the main thread reports too."""
    with _say:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()


def describe(event: events.Event) -> dict:
    if isinstance(event, events.TopologyChanged):
        return {"event": "TopologyChanged", "generation": event.topology.generation,
                "fingerprint": event.topology.fingerprint}
    return {"event": type(event).__name__, **vars(event)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=120.0, help="discovery timeout in seconds (default %(default)s)")
    p.add_argument("--preflight", action="store_true",
                   help="after discovery, probe every peer's transfer endpoint with the others (Client.preflight)")
    args = p.parse_args()

    client = ifrt.Client(timeout=args.timeout)
    stop = threading.Event()

    def leave(signum: int, _frame: object) -> None:
        stop.set()
        threading.Thread(target=client.close, daemon=True).start()  # ends the watch below

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    watched = client.watch()  # subscribed before discovery: no event is missed
    try:
        topology = client.discover()
    except ifrt.IfrtError as e:
        say(error=f"{type(e).__name__}: {e}")
        return 1
    hosts = {(p.hostname, p.address.rpartition(":")[0]) for p in topology.processes}
    say(topology=topology.fingerprint, generation=topology.generation, process_id=topology.process_id,
        hostname=topology.process(topology.process_id).hostname, address=topology.process(topology.process_id).address,
        processes=topology.num_processes, hosts=len(hosts))
    if args.preflight:
        try:
            say(preflight=client.preflight(timeout=60).to_dict())
        except ifrt.IfrtError as e:
            say(preflight={"ok": False, "error": f"{type(e).__name__}: {e}"})
    for event in watched:
        say(**describe(event))
        if isinstance(event, events.CoordinatorRestored) and not stop.is_set():
            try:
                again = client.register_again()
            except ifrt.IfrtError as e:
                say(rechecked=None, error=f"{type(e).__name__}: {e}")
                continue
            say(rechecked=again.fingerprint, generation=again.generation, coordinator=event.coordinator)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
