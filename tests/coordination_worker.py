"""A job process for coordination tests: discovers, then does one thing and reports it as JSON lines.

    python tests/coordination_worker.py increment KEY COUNT     # COUNT kv_increment calls, then the last sum
    python tests/coordination_worker.py swap KEY COUNT          # COUNT counter steps won by kv_compare_set
    python tests/coordination_worker.py steps SECONDS           # steps of SECONDS each until the preemption sync point
    python tests/coordination_worker.py live TIMEOUT            # live_processes(TIMEOUT) on each "ask" line on stdin

Settings come from IFRT_* variables (IFRT_PREEMPTION_SIGNALS=TERM for ``steps``). Events are reported too.
"""

import json
import sys
import threading
import time

import ifrt
from ifrt import events

MAX_STEPS = 100_000


_say = threading.Lock()


def say(**fields) -> None:
    """One JSON line, whole: events arrive on the session thread while the main thread reports too."""
    with _say:
        sys.stdout.write(json.dumps({"t": time.monotonic(), **fields}) + "\n")
        sys.stdout.flush()


def main() -> None:
    mode, *args = sys.argv[1:]
    client = ifrt.Client(timeout=90)
    client.on_event(lambda e: say(event=type(e).__name__, **({} if isinstance(e, events.TopologyChanged)
                                                             else vars(e))))
    topology = client.discover()
    say(topology=topology.fingerprint, process_id=topology.process_id)
    if mode == "increment":
        key, count = args[0], int(args[1])
        total = 0
        for _ in range(count):
            total = client.kv_increment(key)
        say(incremented=count, last=total)
    elif mode == "swap":  # the key holds b"<count>:<process id>:<attempt>": unique, so a swap never looks like another
        key, count = args[0], int(args[1])
        held, won, attempt = b"", 0, 0
        while won < count:
            attempt += 1
            desired = f"{int(held.split(b':')[0] or 0) + 1}:{topology.process_id}:{attempt}".encode()
            held = client.kv_compare_set(key, held, desired) or b""
            won += held == desired
        say(swapped=won, attempts=attempt)
    elif mode == "steps":
        seconds = float(args[0])
        for step in range(MAX_STEPS):
            time.sleep(seconds)  # the step's work
            reached = client.reached_preemption_sync_point(step)
            say(step=step, reached=reached)
            if reached:
                break  # the runtime checkpoints here, then exits
    elif mode == "live":
        for line in sys.stdin:
            if line.strip() == "ask":
                try:
                    say(live={str(k): v for k, v in client.live_processes(float(args[0])).items()})
                except ifrt.IfrtError as e:
                    say(live_error=type(e).__name__, error=str(e))
    client.close()
    say(closed=True)


if __name__ == "__main__":
    main()
