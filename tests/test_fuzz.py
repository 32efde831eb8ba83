"""Hostile and broken input against a live coordinator: random bytes and random well-formed messages on every RPC,
and junk on its TCP port. It never dies, answers each call with a status its proto documents, and changes nothing:
a real cluster completes afterwards exactly as one that never saw the junk."""

from __future__ import annotations

import json
import socket
import struct
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ifrt._generated import coordinator_pb2 as pb
from tests.helpers import discover_process, finish, free_ports

CLUSTER = "fuzz-target"
PROCESSES = 4
MAX_REQUEST = 64 << 10
LIMITS = ("--max-request-bytes", str(MAX_REQUEST), "--max-devices-per-process", "64", "--max-attributes", "8",
          "--max-string-bytes", "256")
"""Lowered so that the fuzzer crosses every limit often and cheaply."""
SERVICE = "/ifrt.topology.v1.Coordinator/"
C = grpc.StatusCode

# Every status coordinator.proto documents for each RPC, written out: OK and INVALID_ARGUMENT (which every RPC may
# answer), PERMISSION_DENIED where the call acts for a process, NOT_FOUND and FAILED_PRECONDITION where it is for
# processes of the published topology, then the RPC's own list. Left out on purpose, though every RPC may answer
# them: UNAVAILABLE (this single in-memory replica always leads), UNAUTHENTICATED (it runs without --token-file)
# and INTERNAL (documented as a coordinator bug): any of them here is a finding.
COMMON = {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}
OWNED = COMMON | {C.PERMISSION_DENIED}
MEMBERS = OWNED | {C.NOT_FOUND, C.FAILED_PRECONDITION}
DOCUMENTED = {
    "Register": OWNED | {C.ALREADY_EXISTS, C.FAILED_PRECONDITION, C.RESOURCE_EXHAUSTED},
    "Session": OWNED | {C.NOT_FOUND, C.FAILED_PRECONDITION},
    "RegisterHost": OWNED,
    "HostSession": OWNED,
    "Leave": OWNED | {C.NOT_FOUND},
    "Barrier": MEMBERS | {C.DEADLINE_EXCEEDED, C.ABORTED, C.CANCELLED},
    "CancelBarrier": MEMBERS,
    "LiveProcesses": MEMBERS | {C.DEADLINE_EXCEEDED},
    "PreemptionNotice": MEMBERS,
    "PreemptionSync": MEMBERS | {C.DEADLINE_EXCEEDED},
    "KeyValueSet": MEMBERS | {C.ALREADY_EXISTS},
    "KeyValueGet": MEMBERS | {C.DEADLINE_EXCEEDED},
    "KeyValueTryGet": MEMBERS,
    "KeyValueDir": MEMBERS,
    "KeyValueMultiGet": MEMBERS,
    "KeyValueMultiSet": MEMBERS | {C.ALREADY_EXISTS},
    "KeyValueIncrement": MEMBERS,
    "KeyValueCompareSet": MEMBERS,
    "KeyValueDelete": MEMBERS,
    "Status": COMMON,
    "TransferKey": MEMBERS,
}
METHODS = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name
STREAMS = {"Session": pb.SessionRequest, "HostSession": pb.HostSessionRequest}


# Random well-formed messages of any request type, drawn field by field from the descriptor.

def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Edge values (ids at the layout's bounds, the type's own ends), small numbers, and anything in range."""
    edges = [v for v in (lo, hi, -1, 0, 1, 3, 4, 5, 63, 64, 65, (1 << 14) - 1, 1 << 14, (1 << 17) - 1, 1 << 17,
                         (1 << 31) - 1, 1 << 31, (1 << 46) - 1, 1 << 46) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(max(lo, -8), min(hi, 70)), st.integers(lo, hi))


ODD = "\x00\x01\x7f\x80\u0085\u200b\u200e\u202e\ufeff\ufffd\U0001f600\U0010ffff é中/:% \n\t'\"\\"
TEXT = st.one_of(
    st.just(""),
    st.text(max_size=24),
    st.text(alphabet=ODD, max_size=40),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\U0001f600", "\x00", "中"]), st.integers(0, 1200)),
)
SCALARS = {
    FieldDescriptor.TYPE_INT64: integers(-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_INT32: integers(-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_UINT64: integers(0, (1 << 64) - 1),
    FieldDescriptor.TYPE_UINT32: integers(0, (1 << 32) - 1),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: TEXT,
    FieldDescriptor.TYPE_BYTES: st.one_of(st.binary(max_size=64), st.integers(0, 70_000).map(lambda n: b"v" * n)),
}


def many(element: st.SearchStrategy) -> st.SearchStrategy[list]:
    """A few distinct elements, or one element repeated up to past the lowered limits (huge counts, cheaply)."""
    return st.one_of(st.lists(element, max_size=6), st.builds(lambda e, n: [e] * n, element, st.integers(0, 300)))


def messages(descriptor: Descriptor) -> st.SearchStrategy[Message]:
    """Any message of this type: each field unset or drawn (nested messages, repeated fields and maps too)."""
    cls = getattr(pb, descriptor.name)
    fields = {}
    for f in descriptor.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            entries = st.dictionaries(SCALARS[key.type], SCALARS[value.type], max_size=12)
            value_strategy = st.one_of(entries, st.builds(lambda n: {f"key{i}": "v" for i in range(n)},
                                                          st.integers(0, 20)))
        else:
            element = st.deferred(lambda f=f: messages(f.message_type)) if f.message_type else SCALARS[f.type]
            value_strategy = many(element) if f.is_repeated else element
        fields[f.name] = st.one_of(st.none(), value_strategy)

    def build(values: dict) -> Message:
        message = cls()
        for name, value in values.items():
            if value is None:
                continue
            if isinstance(value, dict):
                getattr(message, name).update(value)
            elif isinstance(value, list):
                getattr(message, name).extend(value)
            elif isinstance(value, Message):
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries(fields).map(build)


def serialize(message: Message) -> bytes:
    return message.SerializeToString()


# Keeping the assertion honest.

def cannot_join(payload: bytes) -> bytes:
    """``payload``, unless it is a RegisterRequest that could take a free process id of the cluster under test
    (which uses explicit ids): then the same request without its process id. So every registration the fuzzer
    sends is one the coordinator must refuse: unreadable, malformed, over a limit, for another cluster or process
    count, with an id out of range, or without an id in a cluster of explicit ids."""
    try:
        request = pb.RegisterRequest.FromString(payload)
    except DecodeError:
        return payload  # the coordinator parses with the same protobuf library: it cannot read it either
    fits = request.num_processes in (0, PROCESSES) and request.cluster_id in ("", CLUSTER)
    if fits and request.HasField("process_id") and 0 <= request.process_id < PROCESSES:
        request.ClearField("process_id")
        return request.SerializeToString()
    return payload


PLAUSIBLE = pb.RegisterRequest(client_uid="fuzz", hostname="fuzz-host", plugin="cpu", num_processes=PROCESSES,
                               cluster_id=CLUSTER, devices=[pb.LocalDevice(local_id=0, platform="cpu", kind="cpu")])


def plausible(fuzzed: pb.RegisterRequest) -> pb.RegisterRequest:
    """A registration that would be admitted but for the fields ``fuzzed`` sets (so most reach the cluster checks)."""
    request = pb.RegisterRequest()
    request.CopyFrom(PLAUSIBLE)
    request.MergeFrom(fuzzed)
    return request


class Fuzzer:
    """Calls the coordinator over one channel and checks each answer; counts the inputs tried, and keeps every
    answer a caller could not have expected, one example per (method, status): a status the proto does not
    document for the method, RESOURCE_EXHAUSTED for a request within --max-request-bytes, or a refusal without
    the coordinator's error class (a call that timed out on our side, or died with its connection, has none)."""

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self.channel = grpc.insecure_channel(coordinator.address)
        self.tried: Counter[str] = Counter()
        self.seen: Counter[tuple[str, str]] = Counter()
        self.findings: dict[tuple[str, str, str], str] = {}

    def call(self, method: str, payload: bytes | list[bytes]) -> None:
        if method == "Register":
            payload = cannot_join(payload)  # type: ignore[arg-type]
        self.tried[method] += 1
        try:
            if method in STREAMS:
                for _ in self.channel.stream_stream(SERVICE + method)(iter(payload), timeout=10):
                    pass
            else:
                self.channel.unary_unary(SERVICE + method)(payload, timeout=10)
            code, error_class = C.OK, None
        except grpc.RpcError as e:
            code = e.code()
            error_class = dict(e.trailing_metadata() or ()).get("ifrt-error")
            largest = max((len(p) for p in payload), default=0) if method in STREAMS else len(payload)
            if code == C.RESOURCE_EXHAUSTED and largest <= MAX_REQUEST:  # only gRPC's own size check may say it
                why = "RESOURCE_EXHAUSTED for a request within --max-request-bytes"
            elif code not in DOCUMENTED[method]:
                why = "a status its proto does not document"
            elif code != C.RESOURCE_EXHAUSTED and error_class is None:
                why = "a refusal without the coordinator's error class"
            else:
                why = ""
            if why:
                self.findings.setdefault((method, code.name, why), f"{(e.details() or '')[:300]!r} (error class "
                                         f"{error_class}) for {payload[:200]!r}")
        self.seen[(method, code.name)] += 1
        self.alive()

    def junk(self, data: bytes) -> None:
        """Connects to the coordinator's port, sends ``data``, closes."""
        self.tried["tcp"] += 1
        host, _, port = self.coordinator.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(data)
        self.alive()

    def alive(self) -> None:
        assert self.coordinator.process.poll() is None, f"the coordinator died:\n{self.coordinator.log[-3000:]}"

    def state(self) -> tuple:
        """What the coordinator's Status says about its cluster, but for times (which move on their own)."""
        answer = pb.StatusResponse.FromString(self.channel.unary_unary(SERVICE + "Status")(b"", timeout=10))
        processes = [(p.process_id, p.hostname, p.host_address, p.local_rank, p.address, p.devices, p.phase,
                      p.reason, p.incarnation) for p in answer.processes]
        return (answer.state, answer.generation, answer.registered, answer.expected,
                list(answer.missing_process_ids), processes)

    def close(self) -> None:
        self.channel.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frames() -> st.SearchStrategy[bytes]:
    """HTTP/2 frames with random type, flags, stream and payload, and a length that may lie."""
    return st.builds(lambda length, kind, flags, stream, payload: struct.pack(">I", length)[1:] + bytes([kind, flags])
                     + struct.pack(">I", stream) + payload,
                     integers(0, (1 << 24) - 1), st.integers(0, 255), st.integers(0, 255), integers(0, (1 << 32) - 1),
                     st.binary(max_size=64))


TCP_JUNK = st.one_of(
    st.binary(max_size=512),
    st.integers(0, len(PREFACE)).map(lambda n: PREFACE[:n]),
    st.builds(lambda fs: PREFACE + b"".join(fs), st.lists(frames(), max_size=6)),
    st.builds(lambda junk: PREFACE + junk, st.binary(max_size=256)),
    st.sampled_from([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03"]),
)


def run_processes(address: str, ports: list[int], ids: range) -> Iterator:
    """``ifrt discover`` for process ids ``ids``, each with its fixed transfer port, so every run describes the
    same processes."""
    for i in ids:
        yield discover_process(address, "--process-id", str(i), "--num-processes", str(PROCESSES),
                               "--transfer-bind", f"127.0.0.1:{ports[i]}", env={"IFRT_CLUSTER_ID": CLUSTER},
                               devices=2, timeout=240)


def topologies(children: list) -> list[dict]:
    outputs = []
    for child in children:
        code, out, err = finish(child, timeout=240)
        assert code == 0, err
        outputs.append(json.loads(out))
    return outputs


LONG = "\U0001f600" * 1500
"""6 KB of UTF-8; a status message quoting it is three times that percent-encoded, past gRPC's 8 KiB of metadata."""
WRITTEN_OUT = {
    **{name: [getattr(pb, method.input_type.name)(client_uid=LONG).SerializeToString()]
       for name, method in METHODS.items() if name != "Register" and "client_uid" in method.input_type.fields_by_name},
    "Session": [[pb.SessionRequest(open=pb.SessionOpen(client_uid=LONG)).SerializeToString()]],
    # Another plugin with 64 platforms of 256 bytes each, in a cluster of cpu processes.
    "Register": [plausible(pb.RegisterRequest(plugin="other", devices=[
        pb.LocalDevice(local_id=i, platform=f"{i:02d}" + "\U0001f600" * 63) for i in range(1, 64)]))
        .SerializeToString()],
}
"""Inputs whose refusal could quote a lot of the request, each sent once besides the drawn ones."""


def fuzz(examples: int, strategy: st.SearchStrategy, check: Callable) -> None:
    """Runs ``check`` on ``examples`` inputs drawn from ``strategy`` (no shrinking database, no deadline)."""
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(strategy)
    def run(value) -> None:
        check(value)

    run()


def test_junk_on_every_rpc_and_the_port_changes_nothing(start_coordinator):
    """Fuzzes a coordinator while processes 0 and 1 of its cluster wait in it, then lets processes 2 and 3 join.

    Its Status (who registered, with what, in which phase) is the same after the fuzzing as before.

    Nothing the fuzzer sends may join the cluster: every registration is one the coordinator must refuse
    (``cannot_join``: the cluster uses explicit ids, so one without an id is refused, and none takes a free id),
    and every other call names a client uid that collides with none (the real processes' uids are random), so
    the only correct outcome is the cluster of the four real processes, published once. Its topology must be
    byte-identical (same fingerprint, generation 1) to that of the same four processes (same ids, devices and
    transfer ports) against a fresh coordinator that saw no junk; any admission, replacement or lost process
    would change it, or stop it from completing.
    """
    assert set(DOCUMENTED) == set(METHODS), "every RPC of the proto is fuzzed, with its documented statuses"
    ports = free_ports(PROCESSES)
    reference = start_coordinator("--cluster-id", CLUSTER, *LIMITS, num_processes=PROCESSES)
    expected = topologies(list(run_processes(reference.address, ports, range(PROCESSES))))
    reference.stop()

    coordinator = start_coordinator("--cluster-id", CLUSTER, *LIMITS, num_processes=PROCESSES)
    children = list(run_processes(coordinator.address, ports, range(2)))
    fuzzer = Fuzzer(coordinator)
    try:
        coordinator.wait_for_log("registered process 0")
        coordinator.wait_for_log("registered process 1")
        before = fuzzer.state()
        assert before[2:5] == (2, PROCESSES, [2, 3])
        for name in DOCUMENTED:
            if name in STREAMS:
                fuzz(30, st.lists(st.binary(max_size=300), max_size=4), lambda b, name=name: fuzzer.call(name, b))
                fuzz(50, st.lists(messages(STREAMS[name].DESCRIPTOR).map(serialize),
                                   max_size=4), lambda b, name=name: fuzzer.call(name, b))
                continue
            request_type = METHODS[name].input_type
            fuzz(40, st.one_of(st.binary(max_size=300), st.integers(0, 70_000).map(lambda n: b"\x0a" * n)),
                 lambda b, name=name: fuzzer.call(name, b))
            fuzz(100 if name == "Register" else 50, messages(request_type).map(serialize),
                 lambda b, name=name: fuzzer.call(name, b))
            if name == "Register":
                fuzz(100, messages(request_type).map(plausible).map(serialize), lambda b: fuzzer.call("Register", b))
        for name, inputs in WRITTEN_OUT.items():
            for payload in inputs:
                fuzzer.call(name, payload)
        fuzz(100, TCP_JUNK, fuzzer.junk)
        fuzzer.call("Register", b"\xff")  # still answering after the junk connections
        after = fuzzer.state()
        print(f"\nfuzzed the coordinator with {sum(fuzzer.tried.values())} inputs: {dict(fuzzer.tried)}; answers: "
              f"{dict(fuzzer.seen)}")
        children += run_processes(coordinator.address, ports, range(2, PROCESSES))
        outputs = topologies(children)
    finally:
        fuzzer.close()
        for child in children:  # only if the test failed before they finished
            if child.poll() is None:
                child.kill()
                child.communicate()

    assert after == before
    assert [o["process_id"] for o in outputs] == [0, 1, 2, 3]
    assert {(o["generation"], o["fingerprint"]) for o in outputs} == {(1, expected[0]["fingerprint"])}
    assert outputs == expected
    assert coordinator.log.count("published generation") == 1
    assert not fuzzer.findings, "\n".join(f"{method} answered {code}, {why}: {example}"
                                          for (method, code, why), example in fuzzer.findings.items())
