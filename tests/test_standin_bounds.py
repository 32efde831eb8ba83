"""What a caller of a JAX process's coordination socket (ifrt/jax/xla_standin/) can hold: each kind of wait a bounded
number of calls, a wait only as long as its call, and never a heartbeat's or a quick call's thread.

A real coordinator, a real ifrt client and the stand-in's real server; the calls come over a raw gRPC channel on its
socket, as any process of the same Unix user could make them (JAX's own client makes the same calls).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

import ifrt
from ifrt._generated import tensorflow_coordination_pb2 as tf_pb
from ifrt._generated import xla_coordination_pb2 as xla_pb
from ifrt.jax.xla_standin.server import LIMITS, WORKERS, StandInServer
from ifrt.jax.xla_standin.service import CoordinationStandIn
from tests.helpers import poll_until

XLA, TENSORFLOW = "xla.coordination.CoordinationService", "tensorflow.CoordinationService"
ATTACK = 1_100
"""Watches opened at once without a deadline, as the attack on the socket did (the server had 1,024 threads)."""


@pytest.fixture
def standin(start_coordinator) -> Iterator[StandInServer]:
    """The stand-in of process 0 of a one-process job, served on its socket."""
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=30) as client:
        topology = client.discover()
        server = StandInServer(CoordinationStandIn(client, topology, "test/bounds"))
        try:
            yield server
        finally:
            server.close()


def method(channel: grpc.Channel, service: str, name: str, response: type) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(f"/{service}/{name}", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=response.FromString)


def incarnations(server: StandInServer) -> xla_pb.Incarnations:
    return xla_pb.Incarnations(task_id=0, service_incarnation=server.standin.incarnation)


def watches(server: StandInServer, channel: grpc.Channel, layout: str) -> tuple[grpc.UnaryUnaryMultiCallable, object]:
    """The layout's long poll on the tasks' states and a request of it that waits (the version is the current one)."""
    if layout == "xla":
        return (method(channel, XLA, "WatchTasks", xla_pb.WatchTasksResponse),
                xla_pb.WatchTasksRequest(incarnations=incarnations(server), version_number=0))
    return (method(channel, TENSORFLOW, "WatchJobState", tf_pb.WatchJobStateResponse),
            tf_pb.WatchJobStateRequest(job_name="jax_worker", version_number=0))


def heartbeat(server: StandInServer, channel: grpc.Channel, layout: str) -> None:
    if layout == "xla":
        method(channel, XLA, "Heartbeat", xla_pb.HeartbeatResponse)(xla_pb.HeartbeatRequest(
            incarnations=incarnations(server), source_task_id=0), timeout=10)
    else:
        method(channel, TENSORFLOW, "Heartbeat", tf_pb.HeartbeatResponse)(tf_pb.HeartbeatRequest(
            source_task=tf_pb.CoordinatedTask(job_name="jax_worker", task_id=0)), timeout=10)


def set_and_read(server: StandInServer, channel: grpc.Channel, layout: str, key: str) -> bytes:
    """A quick call's answers: sets ``key`` and reads it back without waiting."""
    pb, service = (xla_pb, XLA) if layout == "xla" else (tf_pb, TENSORFLOW)
    extra = {"incarnations": incarnations(server)} if layout == "xla" else {}
    method(channel, service, "InsertKeyValue", pb.InsertKeyValueResponse)(pb.InsertKeyValueRequest(
        kv=pb.KeyValueEntry(key=key, value=b"v"), **extra), timeout=10)
    return method(channel, service, "TryGetKeyValue", pb.TryGetKeyValueResponse)(pb.TryGetKeyValueRequest(
        key=key, **extra), timeout=10).kv.value


@pytest.mark.parametrize("layout", ["xla", "tensorflow"])
def test_watches_past_their_limit_are_refused_naming_it_while_heartbeats_and_quick_calls_answer(standin, layout):
    limit = LIMITS["watch"]
    threads_before = threading.active_count()  # the stand-in serves in this process
    with grpc.insecure_channel(standin.address) as channel:
        watch, request = watches(standin, channel, layout)
        held = [watch.future(request) for _ in range(ATTACK)]  # no deadline, as the attack's
        try:
            refused = poll_until(lambda: [c for c in held if c.done()], lambda d: len(d) >= ATTACK - limit,
                                 timeout=60, what=f"{ATTACK - limit} of {ATTACK} watches refused")
            assert len(refused) == ATTACK - limit
            for call in refused:
                assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, call
                assert f"at most {limit} task-state watches at once" in call.details(), call.details()
            assert standin.slots.held.get("watch") == limit
            began = time.monotonic()
            heartbeat(standin, channel, layout)
            assert set_and_read(standin, channel, layout, f"quick-{layout}") == b"v"
            print(f"{layout}: a heartbeat and a set and read answered in {time.monotonic() - began:.3f}s beside "
                  f"{limit} held watches; this process's threads {threads_before} -> {threading.active_count()}, the "
                  f"stand-in's {standin.threads()} of at most {WORKERS}")
            assert standin.threads() <= WORKERS  # every kind's limit and the spare ones, whatever the attack opens
        finally:
            began = time.monotonic()
            for call in held:
                call.cancel()
        poll_until(lambda: standin.slots.held.get("watch", 0), lambda n: n == 0, timeout=10,
                   what="every cancelled watch's slot given back")
        print(f"{layout}: {limit} cancelled watches ended in {time.monotonic() - began:.3f}s")
        again = [watch.future(request) for _ in range(limit)]  # the room came back whole
        try:
            poll_until(lambda: standin.slots.held.get("watch", 0), lambda n: n == limit, timeout=10,
                       what=f"{limit} new watches held")
            assert not [c for c in again if c.done()]
        finally:
            for call in again:
                call.cancel()


def test_a_cancelled_get_of_a_key_nobody_sets_ends_and_gives_its_slot_back(standin):
    with grpc.insecure_channel(standin.address) as channel:
        get = method(channel, XLA, "GetKeyValue", xla_pb.GetKeyValueResponse)
        request = xla_pb.GetKeyValueRequest(incarnations=incarnations(standin), key="nobody/sets/this")
        held = [get.future(request) for _ in range(LIMITS["get"] + 1)]
        try:
            poll_until(lambda: [c for c in held if c.done()], lambda d: len(d) == 1, timeout=30,
                       what="the get past the limit refused")
            assert standin.slots.held.get("get") == LIMITS["get"]
        finally:
            began = time.monotonic()
            for call in held:
                call.cancel()
        # each get ends after the slice of ifrt's wait in which it was cancelled
        poll_until(lambda: standin.slots.held.get("get", 0), lambda n: n == 0, timeout=20,
                   what="every cancelled get's slot given back")
        print(f"{LIMITS['get']} cancelled gets ended within {time.monotonic() - began:.3f}s")


# RegisterTask, incarnations and CancelBarrier.

def register(channel: grpc.Channel, incarnation: int) -> int:
    return method(channel, XLA, "RegisterTask", xla_pb.RegisterTaskResponse)(xla_pb.RegisterTaskRequest(
        source_task_id=0, incarnation=incarnation), timeout=30).service_incarnation


def test_a_second_registertask_with_another_incarnation_is_refused_naming_the_registered_one(standin):
    with grpc.insecure_channel(standin.address) as channel:
        assert register(channel, 0x1111) == standin.standin.incarnation
        assert register(channel, 0x1111) == standin.standin.incarnation  # JAX's own retry: the same incarnation
        with pytest.raises(grpc.RpcError) as other:
            register(channel, 0x2222)
        assert register(channel, 0x1111) == standin.standin.incarnation  # the first registration stands
    assert other.value.code() == grpc.StatusCode.ALREADY_EXISTS, other.value
    assert "incarnation 0x2222" in other.value.details() and "registered with incarnation 0x1111" in \
        other.value.details(), other.value.details()


def test_a_request_without_a_service_incarnation_is_refused_saying_which_is_expected(standin):
    client = standin.standin.client
    with grpc.insecure_channel(standin.address) as channel, pytest.raises(grpc.RpcError) as unset:
        method(channel, XLA, "InsertKeyValue", xla_pb.InsertKeyValueResponse)(xla_pb.InsertKeyValueRequest(
            incarnations=xla_pb.Incarnations(task_id=0), kv=xla_pb.KeyValueEntry(key="k", value=b"v")),
            timeout=10)
    assert unset.value.code() == grpc.StatusCode.FAILED_PRECONDITION, unset.value
    assert "no service incarnation (0)" in unset.value.details(), unset.value.details()
    assert f"{standin.standin.incarnation:#x}" in unset.value.details(), unset.value.details()
    assert client.kv_try_get("test/bounds/kv/k") is None  # refused: nothing written


def test_a_cancelbarrier_is_logged_as_a_warning_naming_the_barrier_and_this_processs_socket(standin, caplog):
    logger = "ifrt.jax.xla_standin"
    with caplog.at_level(logging.WARNING, logger=logger), grpc.insecure_channel(standin.address) as channel:
        method(channel, XLA, "CancelBarrier", xla_pb.CancelBarrierResponse)(xla_pb.CancelBarrierRequest(
            incarnations=incarnations(standin), barrier_id="step_barrier", counter=3, source_task_id=0), timeout=10)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'step_barrier' (use 3)" in line and "process 0's coordination socket" in line for line in lines), \
        lines
