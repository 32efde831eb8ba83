"""Nothing is visible before it is durable: with a real etcd whose journal write is held and then fails, no
caller is ever answered a topology, a value or a barrier result that the next leader does not reproduce.

The coordinator runs in this test's event loop (``coordinator.server.serve``) on a real etcd, behind a store
wrapper that can hold an append in flight; callers are plain gRPC stubs on loopback, one call each, so what
the coordinator answered is exactly what they hold.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.cluster import ClusterConfig
from coordinator.core.kv_calls import KeyValueCalls
from coordinator.server import serve
from coordinator.store import EtcdStore
from ifrt import wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from tests.helpers import health, poll_until, register_request

NUM = 2
WAIT_S = 30
HOLD_WINDOW_S = 1.0
"""How long a call answered from undurable state would take at most (it would answer at once)."""


class HeldStore:
    """A real store whose appends can be held in flight, to fail them at the worst moment."""

    def __init__(self, inner: EtcdStore) -> None:
        self.inner = inner
        self.holding = False
        self.held = asyncio.Event()
        self.let_go = asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def append(self, entries: list[bytes]) -> None:
        if self.holding:
            self.holding = False
            self.held.set()
            await self.let_go.wait()
        await self.inner.append(entries)


class Harness:
    """One coordinator on a real etcd, in this event loop, and raw stubs to call it."""

    def __init__(self, etcd, tmp_path: Path) -> None:
        self.etcd = etcd
        self.cluster_id = f"durable-{uuid.uuid4().hex[:8]}"
        self.store = HeldStore(EtcdStore(etcd.endpoints, self.cluster_id, lease_ttl_s=2, timeout_s=1))
        self._ready = tmp_path / f"{self.cluster_id}.address"
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.address = ""
        self._channel: grpc.Channel | None = None

    async def __aenter__(self) -> Harness:
        config = CoordinatorConfig(cluster=ClusterConfig(num_processes=NUM, cluster_id=self.cluster_id),
                                   bind="127.0.0.1:0", ready_file=str(self._ready), leader_ttl_s=2)
        self._task = asyncio.create_task(serve(config, self._stop, store=self.store))  # type: ignore[arg-type]
        await until(self._ready.exists, "the coordinator to listen")
        self.address = self._ready.read_text().strip()
        self._channel = grpc.insecure_channel(self.address)
        self.stub = CoordinatorStub(self._channel)
        await self.wait_serving()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 30)
        if self._channel is not None:
            self._channel.close()

    async def wait_serving(self, timeout: float = 30) -> None:
        await until(lambda: health(self.address, timeout=5) == "SERVING", "the coordinator to serve", timeout)

    def call(self, method: str, request) -> asyncio.Task:
        """One call of ``method`` in a thread, as a task whose result is the answer or the RpcError."""
        def once():
            try:
                return getattr(self.stub, method)(request, timeout=WAIT_S)
            except grpc.RpcError as e:
                return e

        return asyncio.create_task(asyncio.to_thread(once))

    async def fail_the_held_append(self) -> None:
        """Stops etcd while the held append is in flight, then lets it go: it fails and the replica steps down."""
        await asyncio.to_thread(self.etcd.stop, 0)
        self.store.let_go.set()

    async def bring_etcd_back(self) -> None:
        await asyncio.to_thread(self.etcd.restart, 0)
        await self.wait_serving(timeout=60)  # the old lease expires, the replica leads again and replays

    async def next_leaders_journal(self) -> list[bytes]:
        """The journal as a replica taking over now would replay it."""
        reader = EtcdStore(self.etcd.endpoints, self.cluster_id, timeout_s=5)
        try:
            return await reader.load()
        finally:
            await reader.close()


async def until(condition, what: str, timeout: float = 30) -> None:
    """Polls ``condition`` off the event loop until it holds; a call refused by a connection counts as not yet."""
    await asyncio.to_thread(poll_until, lambda: _safely(condition), timeout=timeout, what=what)


def _safely(condition) -> bool:
    try:
        return bool(condition())
    except (OSError, grpc.RpcError):
        return False


async def published(h: Harness) -> bytes:
    """Registers processes 0 and 1 (durably); returns the topology bytes they hold."""
    answers = await asyncio.gather(*(h.call("Register", register_request(pid, wait_ms=10_000)) for pid in range(NUM)))
    assert all(isinstance(a, pb.RegisterResponse) and a.topology for a in answers), answers
    return wire.decompress(answers[0].encoding, answers[0].topology)


def status(answer) -> grpc.StatusCode:
    return answer.code() if isinstance(answer, grpc.RpcError) else grpc.StatusCode.OK


async def not_answered_while_held(task: asyncio.Task, what: str) -> None:
    done, _ = await asyncio.wait({task}, timeout=HOLD_WINDOW_S)
    assert not done, f"{what} was answered while the journal entry it depends on was not durable: {task.result()}"


def run(scenario) -> None:
    asyncio.run(scenario())


@pytest.fixture
def harness(etcd, tmp_path):
    return lambda: Harness(etcd, tmp_path)


def test_a_value_is_not_read_before_it_is_durable(harness):
    async def scenario():
        async with harness() as h:
            await published(h)
            h.store.holding = True
            setting = h.call("KeyValueSet", pb.KeyValueSetRequest(client_uid="uid-0", key="nccl/id", value=b"v1"))
            await asyncio.wait_for(h.store.held.wait(), WAIT_S)
            reading = h.call("KeyValueGet", pb.KeyValueGetRequest(client_uid="uid-1", key="nccl/id", wait_ms=0))
            await not_answered_while_held(reading, "a read of the value")
            await h.fail_the_held_append()
            assert status(await setting) == grpc.StatusCode.UNAVAILABLE
            assert await asyncio.to_thread(health, h.address, timeout=5) == "NOT_SERVING"  # as callers hear of it
            assert status(await reading) == grpc.StatusCode.UNAVAILABLE
            await h.bring_etcd_back()
            assert not any(b"nccl/id" in entry for entry in await h.next_leaders_journal())
            again = await h.call("KeyValueGet", pb.KeyValueGetRequest(client_uid="uid-1", key="nccl/id", wait_ms=0))
            assert status(again) == grpc.StatusCode.DEADLINE_EXCEEDED  # the next leader never had it

    run(scenario)


def test_a_retried_registration_is_not_answered_before_the_topology_is_durable(harness):
    async def scenario():
        async with harness() as h:
            first = await h.call("Register", register_request(0))
            assert first.progress.registered == 1
            h.store.holding = True
            completing = h.call("Register", register_request(1, wait_ms=10_000))
            await asyncio.wait_for(h.store.held.wait(), WAIT_S)
            retry = h.call("Register", register_request(0))
            await not_answered_while_held(retry, "process 0's retried registration")
            await h.fail_the_held_append()
            assert status(await retry) == grpc.StatusCode.UNAVAILABLE
            assert status(await completing) == grpc.StatusCode.UNAVAILABLE
            await h.bring_etcd_back()
            after = await h.call("Register", register_request(0))
            assert after.progress.registered == 1 and not after.topology  # generation 1 was never published
            held = await published(h)
            assert wire.decode(held).generation == 1

    run(scenario)


def test_a_repeated_barrier_arrival_is_not_answered_before_the_result_is_durable(harness):
    async def scenario():
        async with harness() as h:
            await published(h)

            def arrive(pid: int):
                return h.call("Barrier", pb.BarrierRequest(client_uid=f"uid-{pid}", name="step-1",
                                                           timeout_ms=WAIT_S * 1000))

            waiting = arrive(0)  # pending (in either order of arrival, one call completes and one repeats)
            h.store.holding = True
            last = arrive(1)
            await asyncio.wait_for(h.store.held.wait(), WAIT_S)
            repeated = arrive(0)
            await not_answered_while_held(repeated, "a repeated barrier arrival")
            assert not waiting.done() and not last.done()
            await h.fail_the_held_append()
            for call in (waiting, last, repeated):
                assert status(await call) == grpc.StatusCode.UNAVAILABLE
            await h.bring_etcd_back()
            assert not any(b"BarrierFinished" in entry for entry in await h.next_leaders_journal())

    run(scenario)


def test_a_burst_queued_behind_a_failed_append_is_never_written(harness):
    """More callers at once than the writer lets through unspaced (CoordinatorConfig.busy_callers): none is
    answered while an append is held, and once it fails, none of their entries is ever written."""
    callers = 2 * CoordinatorConfig.busy_callers

    async def scenario():
        async with harness() as h:
            await published(h)
            h.store.holding = True
            async with grpc.aio.insecure_channel(h.address) as channel:  # as many calls at once as it takes
                stub = CoordinatorStub(channel)

                async def set_one(i: int):
                    try:
                        return await stub.KeyValueSet(pb.KeyValueSetRequest(client_uid=f"uid-{i % NUM}",
                                                                            key=f"burst/{i}", value=b"v"),
                                                      timeout=WAIT_S)
                    except grpc.RpcError as e:
                        return e

                setting = [asyncio.create_task(set_one(i)) for i in range(callers)]
                await asyncio.wait_for(h.store.held.wait(), WAIT_S)
                answered, _ = await asyncio.wait(setting, timeout=HOLD_WINDOW_S)
                assert not answered, "a value set in a burst was answered while the journal was not durable"
                await h.fail_the_held_append()
                assert [status(await call) for call in setting] == [grpc.StatusCode.UNAVAILABLE] * callers
            await h.bring_etcd_back()
            assert not any(b"burst/" in entry for entry in await h.next_leaders_journal())
            listed = await h.call("KeyValueDir", pb.KeyValueDirRequest(client_uid="uid-0", prefix="burst/"))
            assert status(listed) == grpc.StatusCode.OK and not listed.entries

    run(scenario)


def test_an_unexpected_store_error_is_unavailable_not_a_hang(harness):
    async def scenario():
        async with harness() as h:
            await published(h)

            async def broken(entries: list[bytes]) -> None:
                raise ZeroDivisionError("a bug in a store")

            h.store.inner.append = broken  # type: ignore[method-assign]
            answer = await asyncio.wait_for(h.call("KeyValueSet", pb.KeyValueSetRequest(
                client_uid="uid-0", key="k", value=b"v")), WAIT_S)
            assert status(answer) == grpc.StatusCode.UNAVAILABLE
            assert "a bug in a store" in answer.details()

    run(scenario)


def test_a_bug_in_a_handler_is_internal_not_unknown(harness, monkeypatch):
    async def scenario():
        async with harness() as h:
            await published(h)

            def broken(*args, **kwargs):
                raise KeyError("a bug in a handler")

            monkeypatch.setattr(KeyValueCalls, "dir", broken)
            answer = await h.call("KeyValueDir", pb.KeyValueDirRequest(client_uid="uid-0", prefix=""))
            assert status(answer) == grpc.StatusCode.INTERNAL
            assert "KeyError" in answer.details() and "a bug in a handler" in answer.details()
            assert await asyncio.to_thread(health, h.address, timeout=5) == "SERVING"  # the others are still served
            monkeypatch.undo()
            assert status(await h.call("KeyValueDir", pb.KeyValueDirRequest(client_uid="uid-0"))) == grpc.StatusCode.OK

    run(scenario)
