"""One driver process of the discovery benchmark: simulates many ifrt processes with grpc.aio.

Started by bench/discovery.py. Each simulated process has its own channel (and so its own connection) and
sends one RegisterRequest built as ``ifrt.Client`` builds it. Protocol on stdin/stdout, one JSON line each:
``{"ready": ...}`` once the channels exist, then on a ``go`` line from stdin it registers every process,
prints ``{"received": ...}`` when all of them hold an answer, then the result (timings, fingerprints); it closes
the channels on an ``exit`` line (or end of stdin).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.client import CHANNEL_OPTIONS
from ifrt.records import LocalDevice

REGISTER = "/ifrt.topology.v1.Coordinator/Register"
WAIT_MS = 30_000
"""How long the coordinator may hold one Register call (its own cap is 30 s)."""
PLUGIN = "cpu"
TRANSFER_PORT = 8477


@dataclass
class Outcome:
    """What one simulated process saw: when it first sent, when it held the topology, and the raw answer."""

    process_id: int
    sent: float = 0.0
    received: float = 0.0
    attempts: int = 0
    answer: bytes = b""
    error: str = ""
    decode_s: float = 0.0
    facts: dict = field(default_factory=dict)


def fake_devices(count: int) -> list[LocalDevice]:
    """``count`` simulated local devices, platform ``cpu`` and kind ``sim``."""
    return [LocalDevice(i, PLUGIN, "sim") for i in range(count)]


def wire_fields(device: LocalDevice) -> dict[str, Any]:
    """The fields of ``device`` that the wire's LocalDevice message has (what ``ifrt.Client`` copies over)."""
    names = pb.LocalDevice.DESCRIPTOR.fields_by_name
    return {f.name: getattr(device, f.name) for f in dataclasses.fields(device) if f.name in names}


def transfer_address(process_id: int) -> str:
    """A distinct transfer endpoint per simulated process, as every real host has its own address."""
    return f"10.{process_id >> 16 & 255}.{process_id >> 8 & 255}.{process_id & 255}:{TRANSFER_PORT}"


def register_request(process_id: int, num_processes: int, devices: list[LocalDevice]) -> bytes:
    """A serialized RegisterRequest with an explicit process id, built as ``ifrt.Client`` builds it."""
    request = pb.RegisterRequest(cluster_id="", num_processes=num_processes, client_uid=uuid.uuid4().hex,
                                 hostname=f"host-{process_id:05d}", local_rank=0,
                                 address=transfer_address(process_id), wait_ms=WAIT_MS)
    request.process_id = process_id
    if "plugin" in pb.RegisterRequest.DESCRIPTOR.fields_by_name:  # wire versions that name the device plugin
        request.plugin = PLUGIN
    for d in devices:
        request.devices.add(**wire_fields(d))
    return request.SerializeToString()


async def register(channel: grpc.aio.Channel, request: bytes, outcome: Outcome, deadline: float) -> None:
    """Registers until the answer carries the topology (re-registering on a progress answer) or time runs out."""
    call = channel.unary_unary(REGISTER)  # raw bytes both ways; decompressing and hashing are timed in check()
    outcome.sent = time.monotonic()
    while (remaining := deadline - time.monotonic()) > 0:
        outcome.attempts += 1
        try:
            answer = await call(request, timeout=remaining, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            outcome.error = f"{e.code().name}: {e.details()}"
            return
        received = time.monotonic()
        if pb.RegisterResponse.FromString(answer).topology:
            outcome.received = received
            outcome.answer = answer
            return
    outcome.error = "DEADLINE: no topology before the benchmark's deadline"


def check(outcome: Outcome) -> None:
    """Decodes the answer as ``ifrt.Client`` does and checks its fingerprint; records sizes and the time taken."""
    start = time.perf_counter()
    response = pb.RegisterResponse.FromString(outcome.answer)
    canonical = wire.decompress(response.encoding, response.topology)
    fingerprint = wire.fingerprint(canonical)
    outcome.decode_s = time.perf_counter() - start
    if fingerprint != response.fingerprint:
        outcome.error = f"fingerprint mismatch: sent {response.fingerprint}, bytes hash to {fingerprint}"
    if response.process_id != outcome.process_id:
        outcome.error = f"process id {response.process_id} in the answer, expected {outcome.process_id}"
    outcome.facts = {"fingerprint": fingerprint, "canonical_bytes": len(canonical),
                     "payload_bytes": len(response.topology), "response_bytes": len(outcome.answer),
                     "encoding": pb.Encoding.Name(response.encoding)}
    outcome.answer = b""


def emit(record: dict) -> None:
    """One JSON line to the orchestrator."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def run(address: str, first: int, count: int, num_processes: int, devices: int, timeout: float) -> None:
    """Opens ``count`` channels, waits for ``go``, registers processes ``first..first+count-1``, reports."""
    local = fake_devices(devices)
    requests = [register_request(first + i, num_processes, local) for i in range(count)]
    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in range(count)]
    outcomes = [Outcome(first + i) for i in range(count)]
    emit({"ready": count})
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if line.strip() != "go":
        return
    cpu0 = time.process_time()
    deadline = time.monotonic() + timeout
    await asyncio.gather(*(register(c, r, o, deadline) for c, r, o in zip(channels, requests, outcomes, strict=True)))
    emit({"received": time.monotonic()})
    for o in outcomes:
        if not o.error:
            check(o)
    emit({
        "sent": [o.sent for o in outcomes],
        "received": [o.received for o in outcomes],
        "attempts": sum(o.attempts for o in outcomes),
        "decode_s": [o.decode_s for o in outcomes if not o.error],
        "errors": dict(Counter(o.error for o in outcomes if o.error)),
        "fingerprints": dict(Counter(o.facts["fingerprint"] for o in outcomes if o.facts)),
        "facts": next((o.facts for o in outcomes if o.facts), {}),
        "driver_cpu_s": time.process_time() - cpu0,
    })
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # connections stay up until "exit"
    await asyncio.gather(*(c.close() for c in channels))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--address", required=True)
    p.add_argument("--first", type=int, required=True, help="first simulated process id")
    p.add_argument("--count", type=int, required=True, help="how many simulated processes")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--devices", type=int, required=True, help="devices per process")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds until every process holds the topology")
    args = p.parse_args()
    asyncio.run(run(args.address, args.first, args.count, args.num_processes, args.devices, args.timeout))


if __name__ == "__main__":
    main()
