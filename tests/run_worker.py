"""A worker for ``ifrt run`` tests: discovers, says who it is, then does what its scenario says.

    python tests/run_worker.py SCENARIO

Scenarios:
  loop    prints ``step N`` lines until stopped; SIGTERM prints ``received SIGTERM`` and exits 7
  fail    local rank 1 exits 3 right after discovery, in every attempt; the others loop
  finish  three steps, then exit 0
  once    loops in attempt 0 (like loop); in any later attempt, three steps, then exit 0
  host    loops until a generation after the first is published (its own, for a newcomer), prints
          ``generation G process P on HOST`` for each of its processes, then exits 0
  vanish  loops; process 3 deletes the file RUN_WORKER_VANISH names (its own command), then exits 3: its
          replacement cannot start
  odd-spare  loops; a warm spare (IFRT_SPARE set at its start) has 2 cpu devices instead of the agent's count,
          as a spare on other hardware would
Its first line is ``started process P attempt A pid X fingerprint F`` (IFRT_* settings from the agent); each
JobWhole it receives (peers replaced under ``--recover replace``) prints ``job whole at generation G: process P
incarnation N[, ...]``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import ifrt

STEP_S = 0.05


def main(scenario: str) -> None:
    def on_sigterm(signum: int, frame: object) -> None:
        print("received SIGTERM", flush=True)
        os._exit(7)

    signal.signal(signal.SIGTERM, on_sigterm)
    if scenario == "odd-spare" and os.environ.get("IFRT_SPARE"):
        os.environ["IFRT_CPU_DEVICE_COUNT"] = "2"
    client = ifrt.Client(transfer=False)
    topology = client.discover()
    client.on_event(say_whole)
    attempt = os.environ.get("IFRT_ATTEMPT")
    print(f"started process {topology.process_id} attempt {attempt} pid {os.getpid()} fingerprint "
          f"{topology.fingerprint}", flush=True)
    print(f"a line on stderr from local rank {os.environ['IFRT_LOCAL_RANK']}", file=sys.stderr, flush=True)
    if scenario == "fail" and os.environ["IFRT_LOCAL_RANK"] == "1":
        os._exit(3)
    if scenario == "vanish" and topology.process_id == 3:
        os.remove(os.environ["RUN_WORKER_VANISH"])
        os._exit(3)
    if scenario == "host":
        while client.topology is None or client.topology.generation == 1:
            time.sleep(STEP_S)
        for p in client.topology.processes:
            print(f"generation {client.topology.generation} process {p.process_id} on {p.hostname}", flush=True)
        client.close()
        return
    step = 0
    finishes = scenario == "finish" or (scenario == "once" and attempt != "0")
    while not finishes or step < 3:
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(STEP_S)
    client.close()


def say_whole(event: ifrt.events.Event) -> None:
    if isinstance(event, ifrt.events.JobWhole):
        back = ", ".join(f"process {r.process_id} incarnation {r.incarnation}" for r in event.replaced)
        print(f"job whole at generation {event.generation}: {back}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
