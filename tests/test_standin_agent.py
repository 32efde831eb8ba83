"""A JAX process's coordination socket under ``ifrt run``: waits opened on its stand-in (ifrt/jax/xla_standin/) never
keep out the worker's calls that do not wait, a cancelled wait stops calling, and the agent's refusal for load is said
as such, never as a failover.

A real coordinator, the agent's real local server forwarding to it (as ``ifrt run --worker-link agent`` serves its
workers), a worker's real ifrt client registered through it, and the stand-in's real server; the waits come over a raw
gRPC channel on the stand-in's socket, as any process of the same Unix user could open them.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

import ifrt
from ifrt._generated import xla_coordination_pb2 as xla_pb
from ifrt.connection import Connection
from ifrt.errors import Overloaded
from ifrt.jax.xla_standin.server import StandInServer
from ifrt.jax.xla_standin.service import WAIT_SLICE_S, CoordinationStandIn
from ifrt.run.host_register import HostRegistrar
from ifrt.run.host_session import HostSession
from ifrt.run.local_server import WAITING_CALLS, LocalServer
from ifrt.settings import AGENT_SOCKET_ENV, FAILOVER_WINDOW_ENV, resolve
from tests.helpers import poll_until
from tests.wire_agent import WireAgent

GET = "/xla.coordination.CoordinationService/GetKeyValue"
FAILOVER_WINDOW_S = 4.0
"""The worker's failover window here: a refusal for load taken for a failover would end a call after it."""


@dataclass
class Worker:
    local: LocalServer
    client: ifrt.Client
    standin: StandInServer

    def waits_held(self) -> int:
        """The worker's forwarded calls that wait, held at its agent now."""
        return sum(n for key, n in list(self.local.slots.held.items()) if key[0] == "waits")


@pytest.fixture
def worker(start_coordinator, monkeypatch) -> Iterator[Worker]:
    """Process 0 of a one-process job, registered through its host's agent, with its JAX stand-in serving."""
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    WireAgent(coordinator.address, socket.gethostname(), uid="agent-uid", secret="agent-secret").join().close()
    connection = Connection(resolve(coordinator.address, environ={}), "agent-secret")
    host = HostSession(connection, "agent-uid")
    registrar = HostRegistrar(connection, "agent-uid", workers=1, per_call=1, expected=lambda: 1,
                              published=host.open)
    local = LocalServer(registrar, host, workers=1, heartbeat_timeout_s=2.0, coordinator=connection)
    monkeypatch.setenv(AGENT_SOCKET_ENV, local.path)
    monkeypatch.setenv(FAILOVER_WINDOW_ENV, str(FAILOVER_WINDOW_S))
    try:
        with ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=30) as client:
            topology = client.discover()
            standin = StandInServer(CoordinationStandIn(client, topology, "test/agent-bounds"))
            try:
                yield Worker(local, client, standin)
            finally:
                standin.close()
    finally:
        local.close()
        host.close()
        connection.close()


def test_gets_that_wait_on_the_stand_in_keep_out_no_set_and_stop_calling_once_cancelled(worker):
    request = xla_pb.GetKeyValueRequest(incarnations=xla_pb.Incarnations(
        task_id=0, service_incarnation=worker.standin.standin.incarnation), key="nobody/sets/this")
    with grpc.insecure_channel(worker.standin.address) as channel:
        get = channel.unary_unary(GET, request_serializer=lambda m: m.SerializeToString(),
                                  response_deserializer=xla_pb.GetKeyValueResponse.FromString)
        held = [get.future(request) for _ in range(WAITING_CALLS + 4)]  # no deadline, as the attack's
        try:
            poll_until(worker.waits_held, lambda n: n == WAITING_CALLS, timeout=30,
                       what=f"the worker's {WAITING_CALLS} waiting calls held at its agent")
            began = time.monotonic()
            worker.client.kv_set("still/set", b"v", timeout=10)  # a set does not wait: it has slots of its own
            assert worker.client.kv_try_get("still/set") == b"v"
            took = time.monotonic() - began
            print(f"a set and a read went through in {took:.3f}s beside {WAITING_CALLS} held waits")
            assert took < FAILOVER_WINDOW_S  # never retried for load until a failover window passed
            with pytest.raises(Overloaded) as refused:  # one wait more: the agent's refusal, said as such
                worker.client.kv_get("another/unset", timeout=2)
            print(f"one wait more: {refused.value}")
            assert "refused the call for load" in str(refused.value), refused.value
            assert "leader" not in str(refused.value) and "failover" not in str(refused.value), refused.value
        finally:
            cancelled = time.monotonic()
            for call in held:
                call.cancel()
        poll_until(worker.waits_held, lambda n: n == 0, timeout=WAIT_SLICE_S + 10,
                   what="every cancelled get's wait at the agent ended")
        print(f"the cancelled gets' waits at the agent ended in {time.monotonic() - cancelled:.3f}s")
        time.sleep(WAIT_SLICE_S + 1)  # a get that went on would ask again within a slice
        assert worker.waits_held() == 0
        assert worker.standin.slots.held.get("get", 0) == 0
