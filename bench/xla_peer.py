"""The peer of the discovery benchmark: XLA's coordination service doing PJRT's topology exchange.

Runs under an interpreter that has jaxlib (not the project's venv, and without importing the project):

    service  hosts the coordination service, as ``jax.distributed.initialize`` does in process 0, until stdin
             closes; prints ``{"ready": ...}`` once it serves.
    driver   simulates many processes, each with its own ``DistributedRuntimeClient`` (the one
             ``jax.distributed.initialize`` makes), doing what PJRT's ``ExchangeTopologies`` does: connect, set
             ``local_topology/cpu/<id>``; process 0 gets every local topology, builds the global one and sets
             ``global_topology/cpu``; every other process gets that. Same stdin/stdout protocol as
             bench/ifrt_driver.py (``ready``, ``go``, ``received``, result), then ``exit`` shuts the clients down.
             With ``--connections per-process`` (the default) each simulated process dials a loopback address
             of its own (127.1.0.0 onward; all of 127.0.0.0/8 routes to ``lo``) at the service's port, and so has
             its own TCP connection: clients of one process that dial the same target share one connection
             (gRPC's global subchannel pool, which jaxlib gives no option to avoid). The service then listens on
             all interfaces (``--bind 0.0.0.0:PORT``).

The values are PJRT's ``LocalTopologyProto`` / ``GlobalTopologyProto`` (xla/pjrt/distributed/protocol.proto),
encoded here by hand with the fields that carry what an ifrt registration carries: node id, boot id (one per
host, like ifrt's hostname), and per device its ordinal, kind and, in the global form, global id and slice.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from jaxlib import _jax  # what jax._src.lib exposes to jax.distributed

PLATFORM = "cpu"
LOOPBACK_BASE = 1 << 16
"""Simulated process i dials 127.0.0.0 + LOOPBACK_BASE + i (127.1.0.0, 127.1.0.1, ...)."""
GATHER_THREADS = 8
"""Process 0 fetches the local topologies in parallel, as PJRT's GetAllLocalTopologies does on a thread pool."""
HEARTBEAT_S = 100
SHUTDOWN_S = 10


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    """One protobuf field; proto3 leaves out zeros and empty strings."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value) if value else b""
    return _varint(number << 3 | 2) + _varint(len(value)) + value if value else b""


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of a message made of varint and length-delimited fields."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        if key & 7 == 0:
            value, i = _read_varint(buf, i)
            out.append((key >> 3, value))
        else:
            size, i = _read_varint(buf, i)
            out.append((key >> 3, buf[i:i + size]))
            i += size
    return out


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return n, i


def device_proto(ordinal: int, kind: str, global_id: int = 0, slice_index: int = 0) -> bytes:
    """A DeviceProto: local_device_ordinal (1), global_device_id (4), slice_index (5), device_kind (8)."""
    return _field(1, ordinal) + _field(4, global_id) + _field(5, slice_index) + _field(8, kind.encode())


def local_topology(node_id: int, devices: int) -> bytes:
    """A LocalTopologyProto: node_id (1), boot_id (2), devices (3) of kind ``sim``."""
    body = _field(1, node_id) + _field(2, f"host-{node_id:05d}".encode())
    return body + b"".join(_field(3, device_proto(i, "sim")) for i in range(devices))


def global_topology(locals_: list[bytes]) -> bytes:
    """The GlobalTopologyProto PJRT's BuildGlobalTopology makes: global ids in node order, a slice per boot id."""
    slices: dict[bytes, int] = {}
    next_id = 0
    nodes = []
    for raw in locals_:
        fields = _fields(raw)
        boot_id = next((v for f, v in fields if f == 2), b"")
        slice_index = slices.setdefault(boot_id, len(slices))
        node = b"".join(_field(f, v) for f, v in fields if f != 3)
        for f, v in fields:
            if f == 3:
                device = dict(_fields(v))
                node += _field(3, device_proto(device.get(1, 0), device.get(8, b"").decode(), next_id, slice_index))
                next_id += 1
        nodes.append(_field(1, node))
    return b"".join(nodes)


def own_target(address: str, node_id: int) -> str:
    """The service's port at a loopback address of ``node_id``'s own, so that its client has its own connection."""
    n = LOOPBACK_BASE + node_id
    if n >= (1 << 24) - 1:  # 127.255.255.255 is the broadcast address
        raise ValueError(f"node id {node_id} has no loopback address of its own (127.1.0.0 + id < 127.255.255.255)")
    return f"127.{n >> 16}.{n >> 8 & 255}.{n & 255}:{address.rpartition(':')[2]}"


class Distinct:
    """The distinct topologies a driver's processes received, so that each process need not keep its own copy.

    A process's bytes are compared (memcmp) with those seen so far as soon as it holds them, and then dropped:
    N copies of an N-process topology grow as N squared (9 GiB at 8,192 processes x 8 devices).
    """

    def __init__(self) -> None:
        self.blobs: list[bytes] = []
        self._lock = threading.Lock()

    def index(self, value: bytes) -> int:
        """The index of ``value`` among the distinct topologies, added if new."""
        with self._lock:
            for i, blob in enumerate(self.blobs):
                if blob == value:
                    return i
            self.blobs.append(value)
            return len(self.blobs) - 1


def emit(record: dict) -> None:
    """One JSON line to the orchestrator."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def serve(bind: str, num_processes: int) -> None:
    """Hosts the coordination service until stdin closes."""
    service = _jax.get_distributed_runtime_service(bind, num_processes, heartbeat_timeout=HEARTBEAT_S,
                                                   shutdown_timeout=SHUTDOWN_S)
    emit({"ready": bind, "pid": os.getpid()})
    sys.stdin.read()
    service.shutdown()


class Simulated:
    """One simulated process: its client and what it saw."""

    def __init__(self, address: str, node_id: int, num_processes: int, devices: int, timeout_s: int) -> None:
        self.node_id = node_id
        self.num_processes = num_processes
        self.timeout_ms = timeout_s * 1000
        self.local = local_topology(node_id, devices)
        self.client = _jax.get_distributed_runtime_client(address, node_id, init_timeout=timeout_s,
                                                          shutdown_timeout=SHUTDOWN_S, heartbeat_timeout=HEARTBEAT_S,
                                                          use_compression=True)
        self.sent = self.received = 0.0
        self.held: int | None = None
        """Which of the driver's distinct topologies this process received."""
        self.error = ""

    def exchange(self, go: threading.Event, topologies: Distinct) -> None:
        """Connects and exchanges topologies as PJRT does; records the time from connect to holding the topology."""
        go.wait()
        self.sent = time.monotonic()
        try:
            self.client.connect()
            self.client.key_value_set_bytes(f"local_topology/{PLATFORM}/{self.node_id}", self.local)
            if self.node_id == 0:
                keys = [f"local_topology/{PLATFORM}/{i}" for i in range(self.num_processes)]
                with ThreadPoolExecutor(GATHER_THREADS) as pool:
                    locals_ = list(pool.map(lambda k: self.client.blocking_key_value_get_bytes(k, self.timeout_ms),
                                            keys))
                topology = global_topology(locals_)
                self.client.key_value_set_bytes(f"global_topology/{PLATFORM}", topology)
            else:
                topology = self.client.blocking_key_value_get_bytes(f"global_topology/{PLATFORM}", self.timeout_ms)
            self.received = time.monotonic()
            self.held = topologies.index(topology)
        except Exception as e:  # the binding raises XlaRuntimeError (a RuntimeError) or others; report, not crash
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    def shutdown(self) -> None:
        """Leaves the cluster (a barrier over all processes in XLA's service)."""
        try:
            self.client.shutdown()
        except Exception as e:  # a late or missing peer makes shutdown fail; nothing to do about it here
            self.error = self.error or f"shutdown: {e}"


def drive(address: str, first: int, count: int, num_processes: int, devices: int, timeout_s: int,
          own_connections: bool) -> None:
    """Simulates processes ``first..first+count-1`` on one thread each; reports like bench/ifrt_driver.py."""
    threading.stack_size(512 << 10)
    sims = [Simulated(own_target(address, first + i) if own_connections else address, first + i, num_processes,
                      devices, timeout_s) for i in range(count)]
    go = threading.Event()
    distinct = Distinct()
    threads = [threading.Thread(target=s.exchange, args=(go, distinct), daemon=True) for s in sims]
    for t in threads:
        t.start()
    emit({"ready": count})
    if sys.stdin.readline().strip() != "go":
        os._exit(1)
    cpu0 = time.process_time()
    go.set()
    deadline = time.monotonic() + timeout_s + 5
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    emit({"received": time.monotonic()})
    # Every process's bytes were compared with the distinct topologies; each of those is hashed once.
    topologies = distinct.blobs
    held = [s.held for s in sims if s.held is not None and not s.error]
    hashes = []
    for topology in topologies:
        start = time.perf_counter()
        hashes.append((hashlib.sha256(topology).hexdigest(), time.perf_counter() - start))
    errors = Counter(s.error or "no topology before the deadline" for s in sims if s.error or not s.received)
    topology = topologies[0] if topologies else b""
    fingerprints = Counter(hashes[i][0] for i in held)
    emit({
        "sent": [s.sent for s in sims],
        "received": [s.received for s in sims],
        "attempts": count,
        "decode_s": [d for _, d in hashes],
        "errors": dict(errors),
        "fingerprints": dict(fingerprints),
        "payloads": dict(fingerprints),  # what was sent is the topology itself
        "facts": {"canonical_bytes": len(topology), "payload_bytes": len(topology), "encoding": "raw",
                  "zlib_bytes": len(zlib.compress(topology, 6))} if topology else {},
        "driver_cpu_s": time.process_time() - cpu0,
    })
    sys.stdin.readline()
    closers = [threading.Thread(target=s.shutdown, daemon=True) for s in sims]
    for t in closers:
        t.start()
    for t in closers:
        t.join(SHUTDOWN_S + 5)
    os._exit(0)  # the clients' destructors would otherwise try to shut down again


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("service")
    s.add_argument("--bind", required=True, help="HOST:PORT")
    s.add_argument("--num-processes", type=int, required=True)
    d = sub.add_parser("driver")
    d.add_argument("--address", required=True)
    d.add_argument("--first", type=int, required=True)
    d.add_argument("--count", type=int, required=True)
    d.add_argument("--num-processes", type=int, required=True)
    d.add_argument("--devices", type=int, required=True)
    d.add_argument("--timeout", type=int, default=90, help="seconds (connect, and each blocking get)")
    d.add_argument("--connections", choices=["per-process", "shared"], default="per-process",
                   help="per-process: each client dials a loopback address of its own at --address's port; "
                        "shared: all dial --address and share one connection (default %(default)s)")
    args = p.parse_args()
    if args.role == "service":
        serve(args.bind, args.num_processes)
    else:
        drive(args.address, args.first, args.count, args.num_processes, args.devices, args.timeout,
              args.connections == "per-process")


if __name__ == "__main__":
    main()
