"""The discovery path end to end: a real coordinator daemon, real clients, gRPC over loopback."""

from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import pytest

import ifrt
from ifrt import Client, Topology
from ifrt._generated import coordinator_pb2 as pb
from tests.helpers import discover_all, discover_process, finish


def test_four_processes_get_identical_topologies_with_correct_ids(start_coordinator):
    coordinator = start_coordinator(num_processes=4)
    device_counts = [1, 3, 2, 4]
    children = [discover_process(coordinator.address, "--process-id", str(i), "--num-processes", "4", devices=n)
                for i, n in enumerate(device_counts)]
    outputs = []
    for child in children:
        code, out, err = finish(child)
        assert code == 0, err
        outputs.append(json.loads(out))
    topologies = [Topology.from_dict(d) for d in outputs]
    assert len({t.canonical_bytes for t in topologies}) == 1
    assert len({d["fingerprint"] for d in outputs}) == 1
    assert [t.process_id for t in topologies] == [0, 1, 2, 3]
    t = topologies[0]
    assert len(t.devices) == sum(device_counts)
    for process_id, count in enumerate(device_counts):
        owned = [d for d in t.devices if d.process_id == process_id]
        assert [d.local_id for d in owned] == list(range(count))
        assert [d.id for d in owned] == [process_id << 17 | i for i in range(count)]
    assert [len(x.local_devices) for x in topologies] == device_counts
    assert "published generation 1: 4 processes, 10 devices" in coordinator.log


def wait_for_connections(listener: socket.socket, count: int, timeout: float = 30) -> None:
    """Accepts ``count`` connections on ``listener`` and then closes them; AssertionError if they do not come in time.

    A connection stays open (unanswered) until all have come, so a client cannot be counted twice for reconnecting.
    """
    deadline = time.monotonic() + timeout
    connections = []
    try:
        while len(connections) < count:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                connections.append(listener.accept()[0])
            except TimeoutError:
                raise AssertionError(f"{len(connections)} of {count} clients connected within {timeout}s") from None
    finally:
        for connection in connections:
            connection.close()


def test_workers_started_before_the_coordinator_succeed(start_coordinator, free_port):
    address = f"127.0.0.1:{free_port}"
    with socket.socket() as listener:  # stands in the coordinator's place until every worker has tried it
        listener.bind(("127.0.0.1", free_port))
        listener.listen()
        children = [discover_process(address, "--process-id", str(i), "--num-processes", "2") for i in range(2)]
        wait_for_connections(listener, 2)
    assert [c.poll() for c in children] == [None, None]  # still waiting for a coordinator, not given up
    start_coordinator(num_processes=2, bind=address)
    results = [finish(c) for c in children]
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    assert len({json.loads(out)["fingerprint"] for _, out, _ in results}) == 1


def test_sixty_four_concurrent_clients(start_coordinator):
    coordinator = start_coordinator(num_processes=64)
    topologies = discover_all(coordinator.address, 64)
    assert len({t.canonical_bytes for t in topologies}) == 1
    assert [t.process_id for t in topologies] == list(range(64))
    assert topologies[0].global_ids.tolist() == [p << 17 for p in range(64)]


def test_assigned_ids_follow_local_rank_not_arrival_order(start_coordinator):
    coordinator = start_coordinator(num_processes=3)
    children = {}
    for arrived, rank in enumerate((2, 0), start=1):  # arrive in another order than the ranks
        children[rank] = discover_process(coordinator.address, env={"IFRT_LOCAL_RANK": str(rank)}, devices=rank + 1)
        coordinator.wait_for_log(f"local rank {rank} with {rank + 1} devices: {arrived}/3 registered")
    children[1] = discover_process(coordinator.address, env={"IFRT_LOCAL_RANK": "1"}, devices=2)  # the last one
    results = {rank: finish(child) for rank, child in children.items()}
    assert all(code == 0 for code, _, _ in results.values()), results
    for rank, (_, out, _) in results.items():
        t = Topology.from_dict(json.loads(out))
        assert t.process_id == rank
        assert len(t.local_devices) == rank + 1


def test_discover_reads_its_settings_from_the_environment(start_coordinator, monkeypatch, default_client_closed):
    coordinator = start_coordinator(num_processes=1)
    monkeypatch.setenv("IFRT_COORDINATOR", coordinator.address)
    monkeypatch.setenv("IFRT_PROCESS_ID", "0")
    monkeypatch.setenv("IFRT_NUM_PROCESSES", "1")
    monkeypatch.setenv("IFRT_PLUGIN", "cpu")
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "3")
    topology = ifrt.discover(timeout=30)
    assert (topology.process_id, topology.num_processes, len(topology.local_devices)) == (0, 1, 3)
    assert {d.platform for d in topology.devices} == {"cpu"}


def test_timeout_names_missing_processes_and_registered_hosts(start_coordinator):
    coordinator = start_coordinator(num_processes=3)
    started = time.monotonic()
    with pytest.raises(ifrt.DiscoveryTimeout) as info, Client(coordinator.address, process_id=0, timeout=2) as c:
        c.discover()
    waited = time.monotonic() - started
    message = str(info.value)
    assert "1/3 processes registered" in message
    assert "missing process ids [1, 2]" in message
    assert "registered hosts: [" in message
    assert info.value.progress.missing_process_ids == (1, 2)
    assert 1.5 < waited < 10


def test_unreachable_coordinator_times_out_naming_it(free_port):
    address = f"127.0.0.1:{free_port}"
    with pytest.raises(ifrt.DiscoveryTimeout, match=f"coordinator \\({address}\\) was not reachable"):
        ifrt.discover(address, process_id=0, timeout=1)


def test_cli_failure_exits_non_zero_with_the_error_on_stderr(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    code, out, err = finish(discover_process(coordinator.address, "--process-id", "5"))
    assert code != 0 and out == ""
    assert "InvalidArgument" in err and "process id 5 is out of range" in err


# Bad input over the wire: a clear status, a typed error, and a cluster that still completes.

def raw_register(address: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/ifrt.topology.v1.Coordinator/Register")
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=10)
        return info.value


def request(process_id=None, **fields) -> bytes:
    fields.setdefault("devices", [pb.LocalDevice(local_id=0, platform="cpu", kind="cpu")])
    fields.setdefault("hostname", "raw-host")
    fields.setdefault("plugin", "cpu")
    message = pb.RegisterRequest(client_uid="raw-client", **fields)
    if process_id is not None:
        message.process_id = process_id
    return message.SerializeToString()


BAD_REQUESTS = {
    "garbage bytes": (b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "not a valid"),
    "id out of range": (request(7), grpc.StatusCode.INVALID_ARGUMENT, "process id 7 is out of range"),
    "negative id": (request(-1), grpc.StatusCode.INVALID_ARGUMENT, "process id -1 is negative"),
    "local id out of range": (
        request(1, devices=[pb.LocalDevice(local_id=1 << 17, platform="cpu")]), grpc.StatusCode.INVALID_ARGUMENT,
        "local device id 131072 is out of range: expected 0 <= local_id < 131072"),
    "duplicate local id": (
        request(1, devices=[pb.LocalDevice(local_id=3, platform="cpu")] * 2), grpc.StatusCode.INVALID_ARGUMENT,
        "local device id 3 is listed twice"),
    "empty platform": (request(1, devices=[pb.LocalDevice(local_id=0)]), grpc.StatusCode.INVALID_ARGUMENT,
                       "platform is empty"),
    "no client uid": (pb.RegisterRequest(hostname="h").SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT,
                      "client_uid"),
    "wrong process count": (request(1, num_processes=5), grpc.StatusCode.FAILED_PRECONDITION,
                            "expects 5 processes; this coordinator's cluster has 2"),
    "wrong cluster id": (request(1, cluster_id="other"), grpc.StatusCode.FAILED_PRECONDITION,
                         "asked for cluster 'other'; this coordinator serves cluster 'default'"),
    "assigned id in an explicit cluster": (request(None), grpc.StatusCode.FAILED_PRECONDITION,
                                           "uses explicit process ids"),
    "taken id": (request(0), grpc.StatusCode.ALREADY_EXISTS, "process id 0 is already registered by"),
    # Refused by gRPC itself (--max-request-bytes), before our handler: gRPC's own words.
    "oversized": (request(1, hostname="x" * (2 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"Received message larger than max ({len(request(1, hostname='x' * (2 << 20)))} vs. 1048576)"),
}

ERROR_CLASS_NAMES = {  # the typed error each status comes back as (the "ifrt-error" trailer), written out
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.FAILED_PRECONDITION: "ClusterMismatch",
    grpc.StatusCode.ALREADY_EXISTS: "ProcessIdTaken",
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_clear_status_and_changes_nothing(start_coordinator, case):
    payload, code, message = BAD_REQUESTS[case]
    coordinator = start_coordinator("--max-request-bytes", str(1 << 20), num_processes=2)
    holder = Client(coordinator.address, process_id=0, timeout=30)
    holder_result: list[Topology] = []
    holder_thread = threading.Thread(target=lambda: holder_result.append(holder.discover()))
    holder_thread.start()
    coordinator.wait_for_log("registered process 0")

    error = raw_register(coordinator.address, payload)
    assert error.code() == code
    assert message in error.details()
    trailer = [value for key, value in error.trailing_metadata() or () if key == "ifrt-error"]
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # refused by gRPC itself: no typed error of ours
        assert trailer == []
    else:
        assert trailer == [ERROR_CLASS_NAMES[code]]

    with Client(coordinator.address, process_id=1, timeout=30) as second:
        topology = second.discover()
    holder_thread.join(30)
    holder.close()
    assert holder_result and holder_result[0].canonical_bytes == topology.canonical_bytes
    # Both processes are the two real clients of this host; nothing of the refused "raw-host" request got in.
    assert [p.hostname for p in topology.processes] == [socket.gethostname()] * 2
    assert [p.process_id for p in topology.processes] == [0, 1]
    assert [(d.process_id, d.local_id) for d in topology.devices] == [(0, 0), (1, 0)]


def test_taken_id_is_a_typed_error_naming_the_holder_and_not_retried(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    holder = discover_process(coordinator.address, "--process-id", "0")
    coordinator.wait_for_log("registered process 0")
    started = time.monotonic()
    with pytest.raises(ifrt.ProcessIdTaken, match="process id 0 is already registered by"):
        ifrt.discover(coordinator.address, process_id=0, timeout=60)
    assert time.monotonic() - started < 30  # refused at once, not retried until the 60 s timeout
    with Client(coordinator.address, process_id=1) as c:
        c.discover()
    code, _, err = finish(holder)
    assert code == 0, err


def test_client_checks_its_own_arguments_before_calling(free_port):
    with pytest.raises(ifrt.InvalidArgument, match="process id 4 is out of range"):
        ifrt.discover(f"127.0.0.1:{free_port}", process_id=4, num_processes=4)
    with pytest.raises(ifrt.InvalidArgument, match="is not HOST:PORT"):
        ifrt.discover("no-port-here", process_id=0)
