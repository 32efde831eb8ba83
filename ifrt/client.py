"""``Client``: registers this process with the coordinator and holds the published topology."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any

import grpc

from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.errors import DiscoveryTimeout, IfrtError, InvalidArgument, from_rpc_error
from ifrt.progress import Progress
from ifrt.settings import Settings, resolve
from ifrt.topology import Topology
from plugins import get_plugin

log = logging.getLogger("ifrt.client")

POLL_S = 5.0
"""Longest one Register call waits on the coordinator; a progress line is logged after each."""
WARN_AFTER_S = 30.0
"""Progress lines are INFO until discover() has waited this long, then WARNING (shown without logging setup)."""
RETRY_BACKOFF_S = (0.01, 0.1)
"""First and largest pause between retries of a failed call (doubling, with jitter)."""
CHANNEL_OPTIONS = (
    # Reconnect to a coordinator that is not up yet within ~100 ms of it starting (gRPC's default: ~1 s, growing).
    ("grpc.initial_reconnect_backoff_ms", 10),
    ("grpc.max_reconnect_backoff_ms", 100),
    # One connection per client, as separate processes have; topologies of large clusters exceed 4 MiB.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", wire.MAX_TOPOLOGY_BYTES),
)


class Client:
    """One process's link to the coordinator. ``discover()`` registers and returns the topology.

    Arguments fall back to ``IFRT_COORDINATOR``, ``IFRT_PROCESS_ID``, ``IFRT_NUM_PROCESSES``, ``IFRT_PLUGIN``,
    ``IFRT_LOCAL_RANK`` and ``IFRT_CLUSTER_ID`` (see ``ifrt.settings``).
    """

    def __init__(self, coordinator: str | Sequence[str] | None = None, **kwargs: Any) -> None:
        self.settings: Settings = resolve(coordinator, **kwargs)
        self.client_uid = uuid.uuid4().hex
        self.topology: Topology | None = None
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, CoordinatorStub] = {}

    def discover(self) -> Topology:
        """Registers this process and waits until the coordinator publishes the complete topology.

        Raises DiscoveryTimeout (naming who is missing) after ``timeout`` seconds, and at once the typed error
        for anything retrying cannot fix (InvalidArgument, ProcessIdTaken, ClusterMismatch).
        """
        if self.topology is None:
            self.topology = self._register(self._request())
        return self.topology

    def close(self) -> None:
        """Closes the connections to the coordinator."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        self._stubs.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self) -> pb.RegisterRequest:
        s = self.settings
        try:
            devices = get_plugin(s.plugin).local_devices(s.local_device_ids)
        except ValueError as e:
            raise InvalidArgument(f"device plugin {s.plugin!r}: {e}") from e
        request = pb.RegisterRequest(cluster_id=s.cluster_id, num_processes=s.num_processes or 0,
                                     client_uid=self.client_uid, hostname=s.hostname, local_rank=s.local_rank)
        if s.process_id is not None:
            request.process_id = s.process_id
        for d in devices:
            request.devices.add(local_id=d.local_id, platform=d.platform, kind=d.kind, slice_index=d.slice_index,
                                attributes=d.attributes)
        return request

    def _register(self, request: pb.RegisterRequest) -> Topology:
        coordinators = self.settings.coordinators
        start = time.monotonic()
        deadline = start + self.settings.timeout
        progress: Progress | None = None
        last_error: IfrtError | None = None
        attempt = failures = 0
        while (remaining := deadline - time.monotonic()) > 0:
            target = coordinators[attempt % len(coordinators)]
            # Ask the coordinator to answer a little before our deadline, so the last answer names who is missing.
            wait_s = min(POLL_S, max(0.0, remaining - min(0.5, remaining / 4)))
            request.wait_ms = int(wait_s * 1000)
            try:
                response = self._stub(target).Register(request, timeout=min(remaining, wait_s + POLL_S),
                                                       wait_for_ready=len(coordinators) == 1)
            except grpc.RpcError as e:
                last_error = from_rpc_error(e, target)
                if not last_error.retryable:
                    raise last_error from None
                attempt += 1
                failures += 1
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    backoff = min(RETRY_BACKOFF_S[1], RETRY_BACKOFF_S[0] * 2 ** min(failures, 10))
                    time.sleep(min(random.uniform(0.5, 1.0) * backoff, max(0.0, deadline - time.monotonic())))
                continue
            failures = 0
            if response.topology:
                canonical = wire.decompress(response.encoding, response.topology)
                return Topology(canonical, response.process_id, expected_fingerprint=response.fingerprint)
            progress = _progress(response.progress)
            waited = time.monotonic() - start
            log.log(logging.WARNING if waited >= WARN_AFTER_S else logging.INFO,
                    "waiting for the topology from %s (%.0fs so far): %s", target, waited, progress.describe())
        raise self._timeout(time.monotonic() - start, progress, last_error)

    def _stub(self, target: str) -> CoordinatorStub:
        stub = self._stubs.get(target)
        if stub is None:
            self._channels[target] = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
            stub = self._stubs[target] = CoordinatorStub(self._channels[target])
        return stub

    def _timeout(self, waited: float, progress: Progress | None, last_error: IfrtError | None) -> DiscoveryTimeout:
        where = ", ".join(self.settings.coordinators)
        if progress is None:
            cause = f"the coordinator ({where}) was not reachable"
            if last_error is not None:
                cause += f"; last error: {last_error}"
        else:
            cause = f"the cluster is incomplete: {progress.describe()} (coordinator {where})"
        return DiscoveryTimeout(f"no topology after {waited:.1f}s: {cause}", progress=progress)


def _progress(p: pb.Progress) -> Progress:
    return Progress(p.registered, p.expected, tuple(p.missing_process_ids), tuple(p.registered_hosts), p.waited_seconds)
