"""What proving a transfer connection's sender costs: the ``TransferKey`` call a process makes once per peer, and a
new connection's first array (connect, hello, pair-key challenge, the frame) side by side with the same array on a
connection already open, in one run.

    .venv/bin/python bench/transfer_handshake.py [--rounds 200] [--token]

Two processes (two ``ifrt.Client``s in this process, as two processes of a job) against a real coordinator on
loopback. Prints one JSON object: median and p90 milliseconds of each, and what the receiver refused of old
incarnations (``Endpoint.fenced``: 0 here, where no process is replaced; the handshake checks the incarnation every
time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

import ifrt
from coordinator.local import LocalCoordinator
from ifrt.transfer import Channels


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered) * 1000, 3),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 3), "n": len(ordered)}


def run(rounds: int, token: str | None) -> dict:
    flags: tuple[str, ...] = ()
    with tempfile.TemporaryDirectory() as folder:
        if token is not None:
            path = Path(folder, "token")
            path.write_text(token + "\n")
            path.chmod(0o600)
            flags = ("--token-file", str(path))
        with LocalCoordinator(*flags, num_processes=2, log_level="WARNING") as coordinator:
            clients = [ifrt.Client(coordinator.address, process_id=i, num_processes=2, timeout=60, token=token)
                       for i in range(2)]
            threads = [threading.Thread(target=c.discover) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            sender, receiver = clients
            topology = sender.discover()
            src = next(d.id for d in topology.devices if d.process_id == 0)
            dst = next(d.id for d in topology.devices if d.process_id == 1)
            inbound = receiver.channels()
            array = np.arange(4, dtype=np.int32)

            keys = []
            for _ in range(rounds):
                started = time.perf_counter()
                sender.transfer_key(1)
                keys.append(time.perf_counter() - started)

            first, open_ = [], []
            for _ in range(rounds):
                with Channels(topology, sender.endpoint) as outbound:  # a new connection each round
                    started = time.perf_counter()
                    outbound.send(array, dst, src)
                    inbound.recv(src, dst, timeout=30)
                    first.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    outbound.send(array, dst, src)
                    inbound.recv(src, dst, timeout=30)
                    open_.append(time.perf_counter() - started)
            inbound.close()
            assert receiver.endpoint is not None
            fenced = asdict(receiver.endpoint.fenced)
            for c in clients:
                c.close()
    return {"measure": "transfer_handshake", "token": token is not None, "rounds": rounds,
            "transfer_key_call": _summary(keys), "first_array_on_a_new_connection": _summary(first),
            "array_on_an_open_connection": _summary(open_),
            "handshake_ms": round((statistics.median(first) - statistics.median(open_)) * 1000, 3),
            "old_incarnation_refused": fenced}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="calls and connections measured (default %(default)s)")
    p.add_argument("--token", action="store_true", help="run the coordinator with a cluster token")
    args = p.parse_args()
    print(json.dumps(run(args.rounds, "bench token" if args.token else None)))


if __name__ == "__main__":
    main()
