"""What a flood of held calls on a JAX process's coordination socket costs its own JAX client: a heartbeat's and a
quick set-and-read's latency with the socket idle and, in the same run, while another caller holds 1,100 task-state
watches and 100 gets that wait (no deadline, as any process of the same Unix user can), and the stand-in's threads.

    .venv/bin/python bench/standin_flood.py [--rounds 200] [--flood 1100]

A real coordinator on loopback, a real ifrt client and the stand-in's real server in this process; the calls come
over raw gRPC channels on its socket, as JAX's client makes them. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import grpc

import ifrt
from coordinator.local import LocalCoordinator
from ifrt._generated import xla_coordination_pb2 as xla_pb
from ifrt.jax.xla_standin.server import WORKERS, StandInServer
from ifrt.jax.xla_standin.service import CoordinationStandIn

XLA = "xla.coordination.CoordinationService"


def _method(channel: grpc.Channel, name: str, response: type) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(f"/{XLA}/{name}", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=response.FromString)


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered) * 1000, 3),
            "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 3), "n": len(ordered)}


def _timed(rounds: int, call: Callable[[int], None]) -> dict[str, float]:
    samples = []
    for i in range(rounds):
        started = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - started)
    return _summary(samples)


def run(rounds: int, flood: int) -> dict:
    with LocalCoordinator(num_processes=1, log_level="WARNING") as coordinator, \
            ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=60) as client:
        server = StandInServer(CoordinationStandIn(client, client.discover(), "bench/flood"))
        incarnations = xla_pb.Incarnations(task_id=0, service_incarnation=server.standin.incarnation)
        try:
            with grpc.insecure_channel(server.address) as own, grpc.insecure_channel(server.address) as other:
                heartbeat = _method(own, "Heartbeat", xla_pb.HeartbeatResponse)
                insert = _method(own, "InsertKeyValue", xla_pb.InsertKeyValueResponse)
                try_get = _method(own, "TryGetKeyValue", xla_pb.TryGetKeyValueResponse)

                def beat(_: int) -> None:
                    heartbeat(xla_pb.HeartbeatRequest(incarnations=incarnations, source_task_id=0), timeout=30)

                def set_and_read(i: int, phase: str) -> None:
                    key = f"{phase}/{i}"
                    insert(xla_pb.InsertKeyValueRequest(incarnations=incarnations,
                                                        kv=xla_pb.KeyValueEntry(key=key, value=b"v")), timeout=30)
                    try_get(xla_pb.TryGetKeyValueRequest(incarnations=incarnations, key=key), timeout=30)

                idle = {"heartbeat": _timed(rounds, beat),
                        "set_and_read": _timed(rounds, lambda i: set_and_read(i, "idle")),
                        "threads": server.threads()}
                watch = _method(other, "WatchTasks", xla_pb.WatchTasksResponse)
                get = _method(other, "GetKeyValue", xla_pb.GetKeyValueResponse)
                began = time.perf_counter()
                held = [watch.future(xla_pb.WatchTasksRequest(incarnations=incarnations, version_number=0))
                        for _ in range(flood)]
                held += [get.future(xla_pb.GetKeyValueRequest(incarnations=incarnations, key="never-set"))
                         for _ in range(100)]
                while sum(c.done() for c in held) < len(held) - sum(server.slots.held.values()):
                    time.sleep(0.05)
                settled_s = time.perf_counter() - began
                flooded = {"heartbeat": _timed(rounds, beat),
                           "set_and_read": _timed(rounds, lambda i: set_and_read(i, "flooded")),
                           "threads": server.threads(), "held": dict(server.slots.held),
                           "refused": sum(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in held),
                           "flood_settled_s": round(settled_s, 3)}
                began = time.perf_counter()
                for call in held:
                    call.cancel()
                while server.slots.held:
                    time.sleep(0.01)
                flooded["slots_freed_after_cancel_s"] = round(time.perf_counter() - began, 3)
        finally:
            server.close()
    return {"rounds": rounds, "flood": {"watches": flood, "gets": 100}, "max_threads": WORKERS, "idle": idle,
            "flooded": flooded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="timed calls of each kind in each phase")
    parser.add_argument("--flood", type=int, default=1100, help="task-state watches the other caller opens")
    args = parser.parse_args()
    print(json.dumps(run(args.rounds, args.flood), indent=2))


if __name__ == "__main__":
    main()
