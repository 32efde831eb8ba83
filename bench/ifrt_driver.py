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
import hashlib
import json
import os
import random
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from content import Cluster, Host, on_host
from content import add_arguments as add_content_arguments

from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt.client_config import CHANNEL_OPTIONS
from ifrt.records import LocalDevice

REGISTER = "/ifrt.topology.v1.Coordinator/Register"
WAIT_MS = 30_000
"""How long the coordinator may hold one Register call (its own cap is 30 s)."""
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
"""What ``ifrt.Client`` retries (ifrt.errors)."""


@dataclass
class Outcome:
    """What one simulated process saw: when it first sent, when it held the topology, and the raw answer."""

    process_id: int
    sent: float = 0.0
    received: float = 0.0
    attempts: int = 0
    answer: bytes = b""
    error: str = ""
    retried: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)


def wire_fields(device: LocalDevice) -> dict[str, Any]:
    """The fields of ``device`` that the wire's LocalDevice message has (what ``ifrt.Client`` copies over)."""
    names = pb.LocalDevice.DESCRIPTOR.fields_by_name
    return {f.name: getattr(device, f.name) for f in dataclasses.fields(device) if f.name in names}


def register_request(process_id: int, num_processes: int, host: Host, local_rank: int = 0) -> bytes:
    """A serialized RegisterRequest with an explicit process id, built as ``ifrt.Client`` builds it (host-only
    attributes are not sent) from what the simulated host reports (bench/content.py)."""
    request = pb.RegisterRequest(cluster_id="", num_processes=num_processes, client_uid=uuid.uuid4().hex,
                                 hostname=host.hostname, local_rank=local_rank, address=host.address, wait_ms=WAIT_MS)
    request.process_id = process_id
    if "plugin" in pb.RegisterRequest.DESCRIPTOR.fields_by_name:  # wire versions that name the device plugin
        request.plugin = host.plugin
    for d in host.devices:
        request.devices.add(**wire_fields(d))
    return request.SerializeToString()


async def register(channel: grpc.aio.Channel, request: bytes, outcome: Outcome, deadline: float) -> None:
    """Registers until the answer carries the topology (re-registering on a progress answer) or time runs out.

    Like ``ifrt.Client``, retries what retrying can fix (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED; e.g. a keepalive
    ping unanswered on an overloaded machine), pausing 10-100 ms; each such error is kept in ``outcome.retried``.
    """
    call = channel.unary_unary(REGISTER)  # raw bytes both ways; decompressing and hashing are timed in check()
    outcome.sent = time.monotonic()
    failures = 0
    while (remaining := deadline - time.monotonic()) > 0:
        outcome.attempts += 1
        try:
            answer = await call(request, timeout=remaining, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            outcome.error = f"{e.code().name}: {e.details()}"
            if e.code() not in RETRYABLE:
                return
            outcome.retried.append(outcome.error)
            failures += 1
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                await asyncio.sleep(random.uniform(0.5, 1.0) * min(0.1, 0.01 * 2 ** min(failures, 16)))
            continue
        outcome.error = ""
        received = time.monotonic()
        if pb.RegisterResponse.FromString(answer).topology:
            outcome.received = received
            outcome.answer = answer
            return
    outcome.error = "DEADLINE: no topology before the benchmark's deadline"


@dataclass
class Payload:
    """One distinct topology payload as sent, decoded once as ``ifrt.Client`` decodes it."""

    encoding: int
    data: bytes
    fingerprint: str = ""
    sha256: str = ""
    decode_s: float = 0.0
    canonical_bytes: int = 0

    def decode(self) -> None:
        """Inflates and fingerprints the payload as ``ifrt.Client`` does; records the time taken."""
        start = time.perf_counter()
        canonical = wire.decompress(self.encoding, self.data)
        self.fingerprint = wire.fingerprint(canonical)
        self.decode_s = time.perf_counter() - start
        self.canonical_bytes = len(canonical)
        self.sha256 = hashlib.sha256(self.data).hexdigest()


def check(outcome: Outcome, payloads: list[Payload]) -> None:
    """Checks one answer: its payload among ``payloads`` (byte for byte; decoded once each), its fingerprint, id."""
    response = pb.RegisterResponse.FromString(outcome.answer)
    data = response.topology
    payload = next((p for p in payloads if p.encoding == response.encoding and p.data == data), None)
    if payload is None:
        payload = Payload(response.encoding, data)
        payload.decode()
        payloads.append(payload)
    if payload.fingerprint != response.fingerprint:
        outcome.error = f"fingerprint mismatch: sent {response.fingerprint}, bytes hash to {payload.fingerprint}"
    if response.process_id != outcome.process_id:
        outcome.error = f"process id {response.process_id} in the answer, expected {outcome.process_id}"
    outcome.facts = {"fingerprint": payload.fingerprint, "payload_sha256": payload.sha256,
                     "canonical_bytes": payload.canonical_bytes, "payload_bytes": len(data),
                     "response_bytes": len(outcome.answer), "encoding": pb.Encoding.Name(response.encoding)}
    outcome.answer = b""


def emit_results(outcomes: list[Outcome], attempts: int, retried: list[str], cpu0: float, **more: object) -> None:
    """The driver's results line: every process's times, errors and what it received (checked first)."""
    payloads: list[Payload] = []  # normally one: every answer carries the same bytes
    for o in outcomes:
        if not o.error:
            check(o, payloads)
    emit({
        "sent": [o.sent for o in outcomes],
        "received": [o.received for o in outcomes],
        "attempts": attempts,
        "decode_s": [p.decode_s for p in payloads],
        "errors": dict(Counter(o.error for o in outcomes if o.error)),
        "retried": dict(Counter(retried)),
        "fingerprints": dict(Counter(o.facts["fingerprint"] for o in outcomes if o.facts)),
        "payloads": dict(Counter(o.facts["payload_sha256"] for o in outcomes if o.facts)),
        **more,
        "facts": next((o.facts for o in outcomes if o.facts), {}),
        "driver_cpu_s": time.process_time() - cpu0,
    })


def emit(record: dict) -> None:
    """One JSON line to the orchestrator."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


async def run(address: str, first: int, count: int, num_processes: int, cluster: Cluster, timeout: float,
              per_host: int = 1) -> None:
    """Opens ``count`` channels, waits for ``go``, registers processes ``first..first+count-1`` (on hosts of
    ``per_host``), reports."""
    requests = [register_request(first + i, num_processes, *on_host(cluster, first + i, per_host))
                for i in range(count)]
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
    emit_results(outcomes, sum(o.attempts for o in outcomes), [e for o in outcomes for e in o.retried], cpu0)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # connections stay up until "exit"
    await asyncio.gather(*(c.close() for c in channels))


def guard_memory(limit_mib: int) -> None:
    """Exits the driver (status 3) once its resident memory passes ``limit_mib``: on a shared machine a runaway
    driver must fail the run, not push others' processes into the OOM killer. Runs on its own thread."""
    page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
    while True:
        rss_mib = int(Path("/proc/self/statm").read_text().split()[1]) * page_mib
        if rss_mib > limit_mib:
            print(f"{Path(sys.argv[0]).stem}: resident memory {rss_mib:.0f} MiB passed the limit of {limit_mib} MiB; "
                  "exiting", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--address", required=True)
    p.add_argument("--first", type=int, required=True, help="first simulated process id")
    p.add_argument("--count", type=int, required=True, help="how many simulated processes")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--devices", type=int, required=True, help="devices per process")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds until every process holds the topology")
    p.add_argument("--processes-per-host", type=int, default=1,
                   help="processes on one host: its name and address, local ranks 0.. (default %(default)s)")
    p.add_argument("--max-rss-mib", type=int, default=6144, help="exit if resident memory passes this (default "
                                                                 "%(default)s)")
    add_content_arguments(p)
    args = p.parse_args()
    threading.Thread(target=guard_memory, args=(args.max_rss_mib,), daemon=True).start()
    cluster = Cluster(args.content, args.num_processes, args.devices,
                      publish_host_attributes=args.publish_host_attributes)
    asyncio.run(run(args.address, args.first, args.count, args.num_processes, cluster, args.timeout,
                    args.processes_per_host))


if __name__ == "__main__":
    main()
