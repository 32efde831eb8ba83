"""A job process for liveness tests: discovers, then reports its topology and every event as JSON lines.

    python tests/live_worker.py [--barrier NAME [--barrier-when-told]] [--kv-set KEY=VALUE] [--kv-get KEY]

Settings come from IFRT_* variables. It runs until its standard input closes (or it is killed). With
``--barrier-when-told`` it arrives at the barrier when the line ``arrive`` comes on its standard input, so a
test decides when that happens instead of guessing a delay.
"""

import argparse
import json
import sys
import threading
import time

import ifrt
from ifrt import events

_say = threading.Lock()


def say(**fields) -> None:
    """One JSON line, whole: events arrive on the session thread while the main thread reports too."""
    with _say:
        sys.stdout.write(json.dumps({"t": time.monotonic(), **fields}) + "\n")
        sys.stdout.flush()


def describe(event) -> dict:
    fields = {"event": type(event).__name__}
    if isinstance(event, events.TopologyChanged):
        fields.update(generation=event.topology.generation, fingerprint=event.topology.fingerprint)
    elif isinstance(event, events.JobWhole):
        fields.update(generation=event.generation, fingerprint=event.topology.fingerprint,
                      replaced={str(r.process_id): r.incarnation for r in event.replaced})
    else:
        fields.update(vars(event))
    return fields


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--barrier")
    p.add_argument("--barrier-timeout", type=float, default=60)
    p.add_argument("--barrier-when-told", action="store_true",
                   help="arrive at --barrier when the line 'arrive' comes on stdin, not at once")
    p.add_argument("--kv-set")
    p.add_argument("--kv-get")
    args = p.parse_args()

    client = ifrt.Client(timeout=90)
    client.on_event(lambda e: say(**describe(e)))
    topology = client.discover()
    say(topology=topology.fingerprint, generation=topology.generation, process_id=topology.process_id)
    threading.Thread(target=lambda: say(attached=client.wait_attached(60)), daemon=True).start()
    if args.kv_set:
        key, _, value = args.kv_set.partition("=")
        client.kv_set(key, value.encode())
        say(kv_set=key)
    if args.kv_get:
        say(kv_get=args.kv_get, value=client.kv_get(args.kv_get, timeout=30).decode())

    def arrive() -> None:
        try:
            client.barrier(args.barrier, timeout=args.barrier_timeout)
            say(barrier="ok")
        except ifrt.IfrtError as e:
            say(barrier=type(e).__name__, error=str(e))

    if args.barrier and not args.barrier_when_told:
        threading.Thread(target=arrive, daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "arrive" and args.barrier and args.barrier_when_told:
            say(arriving=args.barrier)
            threading.Thread(target=arrive, daemon=True).start()
    client.close()
    say(closed=True)


if __name__ == "__main__":
    main()
