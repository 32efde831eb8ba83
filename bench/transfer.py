"""Array transfer throughput between two processes on loopback: ifrt.transfer.Channels side by side with a
plain TCP socket moving the same bytes into reused buffers (the floor any framing and allocation add to).

    .venv/bin/python bench/transfer.py [--sizes 1K,1M,64M] [--seconds 3]

Prints one JSON object per (path, size): messages per second, GiB/s, and the ratio to the raw socket.
Process 0 sends and process 1 echoes each array back, so each message crosses loopback twice.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
CHUNK = 4 << 20  # the receive size ifrt.transfer uses


def parse_size(text: str) -> int:
    """``64M`` -> 67108864."""
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def echo_ifrt() -> None:
    """Process 1: sends every array it receives back to process 0, until it receives an empty one."""
    import ifrt

    with ifrt.Client(timeout=60) as client, client.channels() as channels:
        peer = next(d.id for d in client.discover().devices if d.process_id == 0)
        while (array := channels.recv(peer, timeout=120)).size:
            channels.send(array, peer)


def echo_raw(port: int) -> None:
    """The baseline's echo: length-prefixed messages back to the sender, until a zero length."""
    buffers: dict[int, bytearray] = {}
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while size := int.from_bytes(_read(sock, 8, buffers), "big"):
            payload = _read(sock, size, buffers)
            sock.sendall(size.to_bytes(8, "big"))
            sock.sendall(payload)


def _read(sock: socket.socket, size: int, buffers: dict[int, bytearray]) -> memoryview:
    """``size`` bytes into a buffer reused for every message of that size (the cheapest possible receive)."""
    view, got = memoryview(buffers.setdefault(size, bytearray(size))), 0
    while got < size:
        n = sock.recv_into(view[got:], min(CHUNK, size - got))
        if not n:
            raise EOFError("peer closed")
        got += n
    return view


def timed(round_trip, seconds: float) -> tuple[int, float]:
    """(round trips, elapsed) doing ``round_trip`` for about ``seconds``, after one warm-up trip."""
    round_trip()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        round_trip()
        count += 1
    return count, time.perf_counter() - started


def bench_ifrt(sizes: list[int], seconds: float) -> list[dict]:
    import ifrt
    from coordinator.local import LocalCoordinator

    results = []
    with LocalCoordinator(num_processes=2, log_level="WARNING") as coordinator:
        env = dict(os.environ, IFRT_COORDINATOR=coordinator.address, IFRT_PROCESS_ID="1", IFRT_NUM_PROCESSES="2")
        echo = subprocess.Popen([sys.executable, __file__, "--echo-ifrt"], env=env)
        with ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=60) as client, \
                client.channels() as channels:
            peer = next(d.id for d in client.discover().devices if d.process_id == 1)
            for size in sizes:
                array = np.ones(size, dtype=np.uint8)

                def round_trip(array=array) -> None:
                    channels.send(array, peer)
                    channels.recv(peer, timeout=120)

                results.append(_result("ifrt.Channels", size, *timed(round_trip, seconds)))
            channels.send(np.zeros(0, dtype=np.uint8), peer)
        echo.wait(60)
    return results


def bench_raw(sizes: list[int], seconds: float) -> list[dict]:
    results = []
    buffers: dict[int, bytearray] = {}
    with socket.create_server(("127.0.0.1", 0)) as server:
        echo = subprocess.Popen([sys.executable, __file__, "--echo-raw", str(server.getsockname()[1])])
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with sock:
            for size in sizes:
                payload = np.ones(size, dtype=np.uint8)

                def round_trip(payload=payload, size=size) -> None:
                    sock.sendall(size.to_bytes(8, "big"))
                    sock.sendall(memoryview(payload))
                    _read(sock, 8, buffers)
                    _read(sock, size, buffers)

                results.append(_result("raw socket", size, *timed(round_trip, seconds)))
            sock.sendall((0).to_bytes(8, "big"))
        echo.wait(60)
    return results


def _result(path: str, size: int, trips: int, elapsed: float) -> dict:
    return {"path": path, "bytes": size, "round_trips": trips, "messages_per_s": round(2 * trips / elapsed, 1),
            "gib_per_s": round(2 * trips * size / elapsed / (1 << 30), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1K,1M,64M", help="array sizes in bytes, K/M/G suffixes (default %(default)s)")
    p.add_argument("--seconds", type=float, default=3.0, help="measuring time per size and path")
    p.add_argument("--echo-ifrt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--echo-raw", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo_ifrt:
        echo_ifrt()
        return 0
    if args.echo_raw:
        echo_raw(args.echo_raw)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    raw = {r["bytes"]: r for r in bench_raw(sizes, args.seconds)}
    for result in bench_ifrt(sizes, args.seconds):
        result["vs_raw_socket"] = round(result["gib_per_s"] / raw[result["bytes"]]["gib_per_s"], 3)
        print(json.dumps(raw[result["bytes"]]))
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
