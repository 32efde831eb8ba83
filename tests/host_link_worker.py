"""A worker for the ``ifrt run --worker-link`` tests: ``python tests/host_link_worker.py SCENARIO``.

Its first line is ``started process P pid X fingerprint F via agent|direct``; each ProcessFailed it hears prints
``heard process P failed at T: REASON`` (T: the wall clock), each CoordinatorLost ``lost the coordinator: REASON``.
Scenarios:
  listen    waits until stopped
  failfast  the same, with fail fast armed (``on_failure="exit"``): a peer's failure or a lost link ends it
  hang      local rank 1 deadlocks holding the GIL a second after it started (its connection stays up, its Heartbeats
            stop); the others wait
  watch     watches the keys under ``k/``; process 0 sets ``k/go`` once every process watches; each change prints
            ``changed KEY = VALUE``
  greedy    local rank 1 first lists 2 cpu devices (the others 1); a refused registration prints ``refused: ERROR``,
            then it registers again with 1
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

import ifrt
from ifrt import failfast
from ifrt.errors import IfrtError
from ifrt.events import CoordinatorLost, ProcessFailed


def say(line: str) -> None:
    """One line in one write: workers of one agent share its standard output (``--no-prefix``), and print's separate
    newline would let another worker's line in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(scenario: str) -> None:
    if scenario == "greedy" and os.environ.get("IFRT_LOCAL_RANK") == "1":
        os.environ["IFRT_CPU_DEVICE_COUNT"] = "2"
    client = ifrt.Client(transfer=False)
    try:
        topology = client.discover()
    except IfrtError as e:
        say(f"refused: {type(e).__name__}: {e}")
        if scenario != "greedy":
            sys.exit(3)
        os.environ["IFRT_CPU_DEVICE_COUNT"] = "1"
        client = ifrt.Client(transfer=False)
        topology = client.discover()
    client.on_event(heard)
    via = "agent" if os.environ.get("IFRT_AGENT_SOCKET") else "direct"
    say(f"started process {topology.process_id} pid {os.getpid()} fingerprint {topology.fingerprint} via {via}")
    if scenario == "failfast":
        failfast.arm(client, topology, "exit", "test")
    if scenario == "watch":
        changes = client.kv_watch("k/")
        client.barrier("watching", 30)
        if topology.process_id == 0:
            client.kv_set("k/go", b"1")
        for key, value in changes:
            say(f"changed {key} = {value!r}")
    if scenario == "hang" and os.environ.get("IFRT_LOCAL_RANK") == "1":
        time.sleep(1.0)
        say("holding the GIL")
        ctypes.PyDLL(None).sleep(120)  # libc's sleep through PyDLL: the GIL stays held, no other thread of ours runs
    while True:
        time.sleep(1.0)


def heard(event: object) -> None:
    if isinstance(event, ProcessFailed):
        say(f"heard process {event.process_id} failed at {time.time():.3f}: {event.reason}")
    elif isinstance(event, CoordinatorLost):
        say(f"lost the coordinator: {event.reason}")


if __name__ == "__main__":
    main(sys.argv[1])
