"""Slots for the job first: whatever callers without the token hold (health watches, checks that never send their
request, silent connections), a token holder's fresh connection gets in, a token holder's connection is never
closed for them, and probes without the token are still answered. A real coordinator on loopback; the attackers
are gRPC clients of their own, one connection each."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from ifrt._generated import coordinator_pb2 as pb
from ifrt.client_config import CHANNEL_OPTIONS
from ifrt.protocol import TOKEN_METADATA
from tests.helpers import TOKEN

HEALTH = "/grpc.health.v1.Health/"
STATUS = "/ifrt.topology.v1.Coordinator/Status"
OWN = (("grpc.use_local_subchannel_pool", 1),)
"""A channel of its own: one connection per attacker."""
JOB_SHARE, STRANGERS = 16, 8
SMALL = ("--max-connections", str(JOB_SHARE), "--max-stranger-connections", str(STRANGERS),
         "--first-message-timeout", "2")
"""A small job's share and strangers' budget: gRPC accepts 16 + 2 x 8 = 32 connections."""
ATTACKERS = 48
"""More than gRPC accepts at once, with or without the strangers' budget."""
GET_IN_S = 8.0
"""A token holder's fresh connection gets in within this long, attack or not."""
SERVING = health_pb2.HealthCheckResponse.SERVING
REQUEST = health_pb2.HealthCheckRequest(service="").SerializeToString()


class Attack:
    """``ATTACKERS`` connections without the token, each running ``hold`` on a channel of its own in a thread's
    event loop; a connection that is closed is opened again after ``again_s`` (gRPC's own reconnect pace)."""

    def __init__(self, address: str, hold: Callable[[grpc.aio.Channel], Coroutine[Any, Any, None]],
                 again_s: float = 1.0) -> None:
        self.address, self.hold, self.again_s = address, hold, again_s
        self.ended: list[grpc.StatusCode] = []
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),), daemon=True)

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        tasks = [asyncio.create_task(self._one()) for _ in range(ATTACKERS)]
        await self._stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self) -> None:
        while True:
            async with grpc.aio.insecure_channel(self.address, options=OWN) as channel:
                try:
                    await self.hold(channel)
                except grpc.RpcError as e:
                    self.ended.append(e.code())
            await asyncio.sleep(self.again_s)

    def __enter__(self) -> Attack:
        self._thread.start()
        time.sleep(3)  # every attacker has connected (or been refused at accept) and holds its call
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)


async def watch_forever(channel: grpc.aio.Channel) -> None:
    """A health watch held open, read to its end."""
    async for _ in channel.unary_stream(HEALTH + "Watch")(REQUEST):
        pass


async def checks_without_requests(channel: grpc.aio.Channel) -> None:
    """Health checks that never send their request, one after another on the same connection (never idle)."""
    async def nothing() -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""

    while True:
        try:
            await channel.stream_unary(HEALTH + "Check")(nothing(), timeout=30)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:  # the first-message deadline: open the next one
                raise


def token_holder_gets_in(address: str, within: float = GET_IN_S) -> float:
    """Seconds a fresh connection with the token took to be answered a Status call (fails past ``within``), on the
    channel options of ifrt's own client (a refused connection is tried again within 80 ms, not gRPC's growing
    1 s and more)."""
    started = time.monotonic()
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        status = channel.unary_unary(STATUS, response_deserializer=pb.StatusResponse.FromString)
        status(pb.StatusRequest().SerializeToString(), metadata=((TOKEN_METADATA, TOKEN),), timeout=within,
               wait_for_ready=True)
    return time.monotonic() - started


def probe(address: str, timeout: float = GET_IN_S) -> int:
    """A Kubernetes-style probe: a fresh connection, no token, one Check."""
    with grpc.insecure_channel(address, options=OWN) as channel:
        answer = channel.unary_unary(HEALTH + "Check")(REQUEST, timeout=timeout, wait_for_ready=True)
    return health_pb2.HealthCheckResponse.FromString(answer).status


# 1. Health watches held by callers without the token.

def test_a_token_holder_gets_in_while_strangers_hold_every_slot_with_health_watches(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), *SMALL, num_processes=2)
    with Attack(coordinator.address, watch_forever):
        assert token_holder_gets_in(coordinator.address) < GET_IN_S
        assert probe(coordinator.address) == SERVING  # a probe gets in too
    assert "callers without the token held" in coordinator.log  # the door named what it closed, and why


# 2. Health checks that never send their request.

def test_a_token_holder_gets_in_while_strangers_hold_every_slot_with_silent_checks(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), *SMALL, num_processes=2)
    with Attack(coordinator.address, checks_without_requests):
        assert token_holder_gets_in(coordinator.address) < GET_IN_S
    assert "no request within 2s" in coordinator.log  # the first-message deadline ended the attackers' checks


# 3. A token holder's connection is never the strangers'.

def test_a_token_holders_long_lived_connection_is_never_closed_for_strangers(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), *SMALL, num_processes=2)

    async def hold() -> list[int]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            status = channel.unary_unary(STATUS)
            await status(pb.StatusRequest().SerializeToString(), metadata=((TOKEN_METADATA, TOKEN),), timeout=10)
            watch = channel.unary_stream(HEALTH + "Watch")(REQUEST)  # same connection, held through the attack
            seen = [health_pb2.HealthCheckResponse.FromString(await watch.read()).status]
            with Attack(coordinator.address, watch_forever):
                await asyncio.sleep(2)  # strangers over their budget for longer than their grace
                assert await asyncio.to_thread(token_holder_gets_in, coordinator.address) < GET_IN_S
                # Still the same connection: the watch is open and a call on it is answered at once.
                await status(pb.StatusRequest().SerializeToString(), metadata=((TOKEN_METADATA, TOKEN),), timeout=2)
                assert not watch.done()
            watch.cancel()
            return seen

    assert asyncio.run(asyncio.wait_for(hold(), 30)) == [SERVING]


# 4. Probes without the token still work; strangers' watches are few and end.

def test_probes_without_the_token_are_answered_and_strangers_watches_are_bounded(start_coordinator, token_file):
    coordinator = start_coordinator("--token-file", str(token_file), "--max-stranger-health-watches", "2",
                                    "--max-connection-idle", "2", num_processes=2)
    assert probe(coordinator.address) == SERVING

    async def watch() -> tuple[list[object], float]:
        async with grpc.aio.insecure_channel(coordinator.address, options=OWN) as channel:
            calls = [channel.unary_stream(HEALTH + "Watch")(REQUEST) for _ in range(3)]
            started, outcomes = time.monotonic(), []
            for call in calls:
                try:
                    outcomes.append([health_pb2.HealthCheckResponse.FromString(m).status async for m in call])
                except grpc.RpcError as e:
                    outcomes.append(e.code())
            return outcomes, time.monotonic() - started

    outcomes, took = asyncio.run(asyncio.wait_for(watch(), 30))
    assert sorted(outcomes, key=str) == sorted([[SERVING], [SERVING], grpc.StatusCode.RESOURCE_EXHAUSTED], key=str)
    assert took < 10  # each stranger's watch ended after --max-connection-idle (2 s), not held for good
    assert "--max-stranger-health-watches" in coordinator.log
