"""The least a grpc.aio server costs per registering process: the floor under `bench/discovery.py`'s CPU figure.

    .venv/bin/python bench/grpc_floor.py --processes 4096

A grpc.aio server whose handler does nothing but wait until all N calls arrived and answer each with the same
bytes, driven like the discovery benchmark: two client processes, one channel (and so one connection) per
simulated process with `ifrt.client_config.CHANNEL_OPTIONS`, N calls at once. Prints one JSON object per N: the server's
utime+stime from "go" to the last answer, per process, with the connections made after "go" (as in
`bench/discovery.py`: `cpu_per_process_ms`) and made before it (`call_only_cpu_per_process_ms`). The coordinator
cannot cost less than the first per process while each process connects and makes one unary call with grpc.aio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import grpc

METHOD = "/floor.Floor/Register"
PAYLOAD = b"\0" * 1024
"""About what the coordinator answers 4096 synthetic processes (the topology, compressed)."""


async def serve(n: int) -> None:
    arrived, everyone = 0, asyncio.Event()

    async def register(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        nonlocal arrived
        arrived += 1
        if arrived == n:
            everyone.set()
        await everyone.wait()
        return PAYLOAD

    server = grpc.aio.server(options=[("grpc.server.max_pending_requests", 1 << 16),
                                      ("grpc.server.max_pending_requests_hard_limit", 1 << 16)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "floor.Floor", {"Register": grpc.unary_unary_rpc_method_handler(register)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def drive(port: int, count: int, connect_first: bool) -> None:
    from ifrt.client_config import CHANNEL_OPTIONS

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) for _ in range(count)]
    if connect_first:
        await asyncio.gather(*(c.channel_ready() for c in channels))
    print("ready", flush=True)
    sys.stdin.readline()
    await asyncio.gather(*(c.unary_unary(METHOD)(b"\0" * 300, wait_for_ready=True) for c in channels))
    print("done", flush=True)
    sys.stdin.readline()


def measure(n: int, drivers: int, connect_first: bool) -> float:
    """The server's CPU seconds from "go" to the last answer."""
    from discovery import cpu_seconds

    here = [sys.executable, __file__]
    server = subprocess.Popen([*here, "--serve", str(n)], stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen] = []
    try:
        port = server.stdout.readline().strip()  # type: ignore[union-attr]
        clients = [subprocess.Popen([*here, "--drive", port, str(n // drivers), str(int(connect_first))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(drivers)]
        for c in clients:
            assert c.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        time.sleep(1.0)  # the clients' start-up (and with connect_first their connections) stays off the clock
        before = sum(cpu_seconds(server.pid))
        for c in clients:
            c.stdin.write("go\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        for c in clients:
            assert c.stdout.readline().strip() == "done"  # type: ignore[union-attr]
        return sum(cpu_seconds(server.pid)) - before
    finally:
        for p in [*clients, server]:
            p.kill()
            p.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", default="256,1024,4096", help="comma-separated N (default %(default)s)")
    p.add_argument("--drivers", type=int, default=2, help="client processes (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs per N; the median CPU is printed (default 3)")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--drive", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    if args.drive:
        asyncio.run(drive(int(args.drive[0]), int(args.drive[1]), args.drive[2] == "1"))
        return 0
    for n in (int(x) for x in args.processes.split(",")):
        n -= n % args.drivers
        record: dict = {"system": "grpc.aio floor", "processes": n}
        for key, connect_first in (("cpu_per_process_ms", False), ("call_only_cpu_per_process_ms", True)):
            runs = sorted(round(1000 * measure(n, args.drivers, connect_first) / n, 3) for _ in range(args.repeat))
            record |= {key: runs[len(runs) // 2], f"{key}_runs": runs}
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
