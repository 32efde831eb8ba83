"""The worker of bench/agents_real.py: discovers, prints the topology and every event it hears, each with the time.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process on the machine), so the benchmark
compares them with its own. Lines (under ``ifrt run`` each behind the agent's ``[<process id>] ``):

    up pid X at T                                    before ifrt is imported
    discover pid X at T                              as discover() is called
    topology process P pid X fingerprint F generation G via agent|direct at T
    event KIND process Q pid X at T                  each event (Q: -1 for events about no one process)

Runs until its stdin closes where stdin is a pipe, else (``ifrt run`` gives its workers /dev/null) until killed.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import time

print(f"up pid {os.getpid()} at {time.monotonic():.6f}", flush=True)

import ifrt  # noqa: E402  (after the ``up`` line: the import is part of what a worker's start costs)


def heard(event: object) -> None:
    """Prints one event line (called from the client's session thread)."""
    at = time.monotonic()
    process = getattr(event, "process_id", -1)
    print(f"event {type(event).__name__} process {process} pid {os.getpid()} at {at:.6f}", flush=True)


def main() -> None:
    client = ifrt.Client(transfer=False)
    print(f"discover pid {os.getpid()} at {time.monotonic():.6f}", flush=True)
    topology = client.discover()
    at = time.monotonic()
    client.on_event(heard)
    via = "agent" if os.environ.get("IFRT_AGENT_SOCKET") else "direct"
    print(f"topology process {topology.process_id} pid {os.getpid()} fingerprint {topology.fingerprint} "
          f"generation {topology.generation} via {via} at {at:.6f}", flush=True)
    if stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode):
        sys.stdin.read()  # until the pipe's writer closes it
        client.close()
        return
    while True:  # SIGTERM (the agent's stop) or SIGKILL ends it
        signal.pause()


if __name__ == "__main__":
    main()
