"""A job process for liveness tests: discovers, then reports its topology and every event as JSON lines.

    python tests/live_worker.py [--barrier NAME] [--kv-set KEY=VALUE] [--kv-get KEY]

Settings come from IFRT_* variables. It runs until its standard input closes (or it is killed).
"""

import argparse
import json
import sys
import threading
import time

import ifrt
from ifrt import events


def say(**fields) -> None:
    print(json.dumps({"t": time.monotonic(), **fields}), flush=True)


def describe(event) -> dict:
    fields = {"event": type(event).__name__}
    if isinstance(event, events.TopologyChanged):
        fields.update(generation=event.topology.generation, fingerprint=event.topology.fingerprint)
    else:
        fields.update(vars(event))
    return fields


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--barrier")
    p.add_argument("--barrier-timeout", type=float, default=60)
    p.add_argument("--barrier-delay", type=float, default=0, help="wait this long before arriving")
    p.add_argument("--kv-set")
    p.add_argument("--kv-get")
    args = p.parse_args()

    client = ifrt.Client(timeout=90)
    client.on_event(lambda e: say(**describe(e)))
    topology = client.discover()
    say(topology=topology.fingerprint, generation=topology.generation, process_id=topology.process_id)
    if args.kv_set:
        key, _, value = args.kv_set.partition("=")
        client.kv_set(key, value.encode())
        say(kv_set=key)
    if args.kv_get:
        say(kv_get=args.kv_get, value=client.kv_get(args.kv_get, timeout=30).decode())
    if args.barrier:
        def arrive() -> None:
            time.sleep(args.barrier_delay)
            try:
                client.barrier(args.barrier, timeout=args.barrier_timeout)
                say(barrier="ok")
            except ifrt.IfrtError as e:
                say(barrier=type(e).__name__, error=str(e))
        threading.Thread(target=arrive, daemon=True).start()
    sys.stdin.read()
    client.close()
    say(closed=True)


if __name__ == "__main__":
    main()
