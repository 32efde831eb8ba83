"""A worker for the agent hop tests (tests/test_agent_hop.py): ``python tests/agent_hop_worker.py SCENARIO``.

Its first line is ``started process P pid X``; each ProcessFailed it hears prints ``heard process P failed: REASON``.
Scenarios:
  pushed  follows the keys under ``hop/`` with a PushedKeys view and prints ``view ready`` once it answers; process 1
          then waits for the file ``$HOP_TRIGGER`` and sets ``hop/1``, printing ``set hop/1``; process 0 reads
          ``hop/1`` as a start-up does (off the view while it answers, else asking the coordinator) and prints
          ``got hop/1 via view|coordinator`` once it has it
  busy    local rank 1 burns CPU in one native call that holds the GIL (``busy``), a second after it started
  own     watches a prefix of its own (``own/<pid>/``) and prints ``watching own`` once the coordinator watches it
"""

from __future__ import annotations

import os
import re
import sys
import time

import ifrt
from ifrt.errors import IfrtError
from ifrt.events import ProcessFailed
from ifrt.pushed import PushedKeys


def main(scenario: str) -> None:
    client = ifrt.Client(transfer=False)
    topology = client.discover()
    client.on_event(heard)
    print(f"started process {topology.process_id} pid {os.getpid()}", flush=True)
    if scenario == "pushed":
        pushed(client, topology.process_id)
    if scenario == "busy" and os.environ.get("IFRT_LOCAL_RANK") == "1":
        time.sleep(1.0)
        print("busy", flush=True)
        re.fullmatch(r"(x+x+)+y", "x" * 64)  # backtracks for ages in C, holding the GIL
    if scenario == "own":
        client.kv_watch(f"own/{os.getpid()}/")
        print("watching own", flush=True)
    while True:
        time.sleep(1.0)


def pushed(client: ifrt.Client, process_id: int) -> None:
    view = PushedKeys(client, "hop/")
    while not view.ready():
        time.sleep(0.05)
    print("view ready", flush=True)
    if process_id == 1:
        while not os.path.exists(os.environ["HOP_TRIGGER"]):
            time.sleep(0.05)
        client.kv_set("hop/1", b"1", timeout=60)
        print("set hop/1", flush=True)
        return
    while True:
        if view.ready():
            if view.values(["hop/1"]) != [None] or view.wait(["hop/1"], 0.2):
                print("got hop/1 via view", flush=True)
                return
            continue
        try:
            if client.kv_try_get("hop/1") is not None:
                print("got hop/1 via coordinator", flush=True)
                return
        except IfrtError:  # a standby taking over: asked again
            pass
        time.sleep(0.2)


def heard(event: object) -> None:
    if isinstance(event, ProcessFailed):
        print(f"heard process {event.process_id} failed: {event.reason}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
