"""What many test files share (fixtures stay in conftest.py): free loopback ports, polling, health checks, `ifrt
discover` children, Clients in this test and their events, Register requests, and builders of the pure state
machine's scenarios."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ifrt
from coordinator.core.cluster import ClusterConfig
from coordinator.core.effects import Notify
from coordinator.core.registration import Registration
from coordinator.core.state import ClusterState
from coordinator.local import LocalCoordinator
from ifrt import global_device_id
from ifrt._generated import coordinator_pb2 as pb
from ifrt.events import ProcessFailed
from ifrt.protocol import SECRET_METADATA
from ifrt.records import Device, LocalDevice, Process, TopologyContent

BIN = Path(sys.executable).parent
SERVICE = "/ifrt.topology.v1.Coordinator"
"""The coordinator service's path, before a method's name, as gRPC calls it."""
T = TypeVar("T")
TOKEN = "suite-token-5a1f7c1d"
"""The cluster token of the ``token_file`` fixture."""


# Loopback ports and polling.

PORT_BASE = 10_000
PORT_SPAN = 2_000
"""Each pytest-xdist worker takes its ports from its own ``PORT_SPAN`` ports from ``PORT_BASE`` on: below the
kernel's ephemeral range (32768 up), so no bind to port 0 and no outgoing connection is ever given one, and apart
from every other worker's, so two tests running at once never pick the same port."""
_next_port = [0]


def _port_range() -> range:
    """This process's ports: worker gwN of pytest-xdist its own slice, a run without workers the slice before them."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") else 0
    start = PORT_BASE + index * PORT_SPAN
    assert start + PORT_SPAN <= 32_768, f"pytest-xdist worker {worker} has no port range below the ephemeral range"
    return range(start, start + PORT_SPAN)


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports of this worker's own range that nothing is bound to now, none handed out
    before in this process (the range wraps only after ``PORT_SPAN`` ports)."""
    ports = _port_range()
    if not _next_port[0]:
        _next_port[0] = secrets.randbelow(len(ports))  # runs without workers rarely start on each other's ports
    found: list[int] = []
    for _ in range(len(ports)):
        port = ports[_next_port[0] % len(ports)]
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise AssertionError(f"fewer than {count} free loopback ports in {ports.start}-{ports.stop - 1}")


REPLAY_DIFFERS = "replays to another state than the live one"
"""What a daemon started with --check-replay logs when its journal does not replay to its live state."""


def close_checking_replays(coordinators: Sequence[LocalCoordinator], check: bool = True) -> None:
    """Stops and closes each daemon; then (``check``) fails naming every one started with ``--check-replay`` whose
    journal, replayed at its graceful stop, gave another state than its live one (a SIGKILLed one checks nothing)."""
    differs = []
    for coordinator in coordinators:
        coordinator.stop()
        if coordinator.log_path.exists():  # not closed by the test already
            differs += [line for line in coordinator.log.splitlines() if REPLAY_DIFFERS in line]
        coordinator.close()
    assert not check or not differs, "\n".join(differs)


def secret_file(path: Path, text: str | None = None) -> Path:
    """Writes ``text`` (random hex when None) to ``path``, readable by its owner only: a token or an agent key."""
    path.write_text((text or secrets.token_hex(32)) + "\n")
    path.chmod(0o600)
    return path


def free_port() -> int:
    """A loopback port that was free a moment ago (nothing listens there)."""
    return free_ports(1)[0]


def poll_until(probe: Callable[[], T], done: Callable[[T], object] = bool, timeout: float = 30, what: str = "",
               interval: float = 0.05) -> T:
    """Calls ``probe`` until ``done`` holds for its answer, which it returns; fails after ``timeout`` seconds naming
    ``what`` was awaited and the last answer."""
    deadline = time.monotonic() + timeout
    while not done(seen := probe()):
        assert time.monotonic() < deadline, f"{what or 'the condition'} did not hold within {timeout}s; last: {seen!r}"
        time.sleep(interval)
    return seen


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port that a socket of this test listens on while the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def health(address: str, service: str = "", timeout: float = 10) -> str:
    """What the standard gRPC health service at ``address`` says about ``service`` ("" for the server as a whole)."""
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


# Processes of a job: `ifrt discover` children and Clients in this test.

def discover_process(address: str, *args: str, devices: int = 1, env: dict[str, str] | None = None,
                     timeout: float = 60) -> subprocess.Popen:
    """`ifrt discover --json` in a child process (its own interpreter, like a job's process)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    full_env.update(IFRT_CPU_DEVICE_COUNT=str(devices), **(env or {}))
    return subprocess.Popen([str(BIN / "ifrt"), "discover", "--coordinator", address, "--timeout", str(timeout),
                             "--json", *args], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_coordinator(*args: str) -> subprocess.CompletedProcess:
    """`ifrt-coordinator` with ``args``, run to its end (60 s at most): for flags that stop it at once."""
    return subprocess.run([str(BIN / "ifrt-coordinator"), *args], capture_output=True, text=True, timeout=60)


def finish(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a child, killing it by pid if it outlives ``timeout``."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"child {process.pid} did not finish within {timeout}s; stderr:\n{err}") from None
    return process.returncode, out, err


def json_answers(children: list[subprocess.Popen], timeout: float) -> list[dict]:
    """Each child's JSON answer (its last line of output), in the order given; fails naming a child that exited
    with an error or did not finish within ``timeout`` seconds (killed by pid)."""
    found = []
    for child in children:
        code, out, err = finish(child, timeout)
        assert code == 0, f"child {child.pid} exited {code}:\n{err[-3000:]}"
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def discover_processes(address: str, n: int, env: dict[str, str], timeout: float = 60) -> list[dict]:
    """Processes 0..n-1 as `ifrt discover` children with ``env``; each one's JSON answer, all of them successes."""
    children = [discover_process(address, "--process-id", str(pid), "--num-processes", str(n), env=env,
                                 timeout=timeout) for pid in range(n)]
    results = [finish(c, timeout + 30) for c in children]
    assert [code for code, _, _ in results] == [0] * n, [err for _, _, err in results]
    return [json.loads(out) for _, out, _ in results]


@contextlib.contextmanager
def survivor_of_a_doomed_peer(address: str) -> Iterator[tuple[ifrt.Client, ifrt.Topology]]:
    """Process 0 of a 2-process job (a Client here) and its topology, once process 1 (a child) has discovered and
    exited (code 3) without a goodbye: the coordinator declares it failed when its heartbeat timeout passes."""
    dies = ("import os, ifrt\n"
            f"ifrt.Client({address!r}, process_id=1, num_processes=2, transfer=False).discover()\n"
            "os._exit(3)\n")
    doomed = subprocess.Popen([sys.executable, "-c", dies], stderr=subprocess.PIPE, text=True)
    with ifrt.Client(address, process_id=0, num_processes=2, transfer=False, timeout=30) as survivor:
        topology = survivor.discover()
        assert doomed.wait(timeout=30) == 3, doomed.stderr.read()
        yield survivor, topology


def together(items: Sequence[T], call: Callable[[T], object], timeout: float = 60) -> list:
    """``call(item)`` for every item at once, each in a thread of its own (as a job's processes act together): the
    results, or the exceptions raised, in the order of ``items``; fails if one has not returned within ``timeout``."""
    results: list = [None] * len(items)

    def one(i: int) -> None:
        try:
            results[i] = call(items[i])
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"a call did not return within {timeout}s"
    return results


def discover_all(address: str, num: int, **options: object) -> list[ifrt.Topology]:
    """Processes 0..num-1 as Clients in this test's threads, discovering at once; their topologies by index (every
    one a success), the clients closed."""
    def discover(i: int) -> ifrt.Topology:
        with ifrt.Client(address, process_id=i, num_processes=num, **{"timeout": 60, **options}) as client:
            return client.discover()

    results = together(range(num), discover, timeout=90)
    errors = [r for r in results if not isinstance(r, ifrt.Topology)]
    assert not errors, errors[:3]
    return results


def clients(address: str, n: int, **options: object) -> list[ifrt.Client]:
    """``n`` processes of one cluster as Clients in this test (with ``options``, e.g. ``attempt``), discovered
    together and left open."""
    made = [ifrt.Client(address, process_id=i, num_processes=n, **{"timeout": 60, **options}) for i in range(n)]
    errors = [r for r in together(made, lambda c: c.discover()) if isinstance(r, Exception)]
    assert not errors and all(c.topology is not None for c in made), errors[:3]
    return made


def barrier_started_for(address: str, client: ifrt.Client, name: str, timeout: float = 30) -> str:
    """Waits until barrier ``name`` exists on the coordinator at ``address``; returns what the coordinator said.

    Asks as process 0 (``client``, with its process secret) arriving at it with participants [1, 2], a list no
    real call uses and that leaves process 0 out: a coordinator that holds the barrier refuses that with
    INVALID_ARGUMENT naming the barrier's own participants, one that does not hold it yet refuses it as
    "process 0 is not a participant"; neither changes anything.
    """
    request = pb.BarrierRequest(client_uid=client.client_uid, name=name, process_ids=[1, 2], timeout_ms=1000)
    metadata = ((SECRET_METADATA, client.process_secret),)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(f"{SERVICE}/Barrier")
        while True:
            with pytest.raises(grpc.RpcError) as info:
                call(request.SerializeToString(), timeout=10, metadata=metadata)
            if "was started for processes" in (info.value.details() or ""):
                return info.value.details()
            assert time.monotonic() < deadline, f"no barrier {name!r} at {address} within {timeout}s: {info.value}"
            time.sleep(0.05)  # polling, until the caller's arrival has reached the coordinator


def watcher(client: ifrt.Client) -> queue.Queue:
    """Every event the client receives, with the time it arrived."""
    received: queue.Queue = queue.Queue()
    client.on_event(lambda e: received.put((time.monotonic(), e)))
    return received


def watched_cluster(start_coordinator, workers, n: int = 3, *flags: str, heartbeat_timeout: float,
                    worker_args: Sequence[str] = ()):
    """A coordinator, process 0 in the test (a Client whose events a ``watcher`` queue receives), processes 1..n-1 as
    worker processes (the ``workers`` fixture), all holding one topology; (coordinator, client, received, workers)."""
    coordinator = start_coordinator("--heartbeat-timeout", str(heartbeat_timeout), *flags, num_processes=n)
    procs = [workers(coordinator.address, i, n, *worker_args) for i in range(1, n)]
    client = ifrt.Client(coordinator.address, process_id=0, num_processes=n, timeout=60)
    received = watcher(client)
    topology = client.discover()
    for w in procs:
        assert w.expect("topology")["topology"] == topology.fingerprint
    return coordinator, client, received, procs


def next_event(received: queue.Queue, kind: type, timeout: float = 30, **match) -> tuple[float, object]:
    """The next (arrival time, event) from a ``watcher`` queue that is a ``kind`` with the ``match`` values, skipping
    others; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            at, event = received.get(timeout=remaining)
        except queue.Empty:
            break
        if isinstance(event, kind) and all(getattr(event, k) == v for k, v in match.items()):
            return at, event
    raise AssertionError(f"no {kind.__name__} {match} within {timeout}s")


def in_thread(call: Callable[[], object]) -> queue.Queue:
    """Runs ``call`` in a thread; its result (or the IfrtError it raised) arrives on the queue returned."""
    result: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            result.put(call())
        except ifrt.IfrtError as e:
            result.put(e)

    threading.Thread(target=run, daemon=True).start()
    return result


# Requests as they travel on the wire.

def device(local_id: int = 0, **fields) -> pb.LocalDevice:
    """One cpu device of a RegisterRequest."""
    return pb.LocalDevice(local_id=local_id, platform="cpu", kind="cpu", **fields)


def register_request(process_id: int | None = None, **fields) -> pb.RegisterRequest:
    """A RegisterRequest of one cpu device as a client sends it: with ``process_id``, that process's own uid, host
    and endpoint; ``fields`` replace any default."""
    defaults: dict = {"client_uid": "uid", "hostname": "host", "plugin": "cpu", "devices": [device()]}
    if process_id is not None:
        defaults.update(client_uid=f"uid-{process_id}", hostname=f"host-{process_id}", process_id=process_id,
                        address=f"127.0.0.1:{7000 + process_id}")
    return pb.RegisterRequest(**{**defaults, **fields})


# The pure state machine, driven with plain values.

TIMEOUT = 1.0
"""The heartbeat timeout of ``published`` clusters: a lost session has 0.125 s of reconnect grace."""


def reg(uid, process_id=None, *, host="h", ip="10.0.0.1", rank=0, devices=2, num_processes=0,
        cluster_id="") -> Registration:
    """A registration as the coordinator parses it, of ``devices`` cpu devices."""
    return Registration(uid, cluster_id, num_processes, process_id, host, ip, rank, f"{host}:9000",
                        tuple(LocalDevice(i, "cpu", "cpu") for i in range(devices)))


def admit(s: ClusterState, r: Registration, now: float):
    """Registers ``r`` at ``now``; the outcome (Waiting or Published), checking that no effect came of it."""
    outcome, effects = s.register(r, now)
    assert effects == []
    return outcome


def published(n=3, **config) -> ClusterState:
    """A cluster of ``n`` processes (uids p0.., hosts h0..), published at t=0, every session attached."""
    s = ClusterState(ClusterConfig(num_processes=n, heartbeat_timeout_s=TIMEOUT, **config))
    for i in range(n):
        admit(s, reg(f"p{i}", i, host=f"h{i}"), 0.0)
    for i in range(n):
        s.current.attach(f"p{i}", 0.0)
    return s


def lose_session(s: ClusterState, process_id: int, at: float = 0.0) -> None:
    """Process ``process_id`` of a ``published`` cluster loses its session at ``at`` and stays away; the others
    keep theirs open, which is what keeps them alive."""
    s.current.detach(f"p{process_id}", at)


def failures(effects) -> list[ProcessFailed]:
    """The ProcessFailed events among a command's effects."""
    return [e.event for e in effects if isinstance(e, Notify) and isinstance(e.event, ProcessFailed)]


# `ifrt status` and the metrics endpoint of a running coordinator.

IFRT = str(BIN / "ifrt")
HOST = socket.gethostname()
FAILED_REASON = re.compile(r"lost its connection and did not come back within (0\.125|1)s")
"""What a process killed with kill -9 is failed for, under --heartbeat-timeout 1: its stream breaks at once and it
is not back within the reconnect grace (1/8 of the timeout), or, killed before its session attached, within the
timeout."""
METRICS_LINE = re.compile(r"serving metrics on http://[^ ]+:(\d+)/metrics")


def ifrt_status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `ifrt status` with ``args`` and no IFRT_* setting of this test's environment but ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    return subprocess.run([IFRT, "status", *args], capture_output=True, text=True, timeout=60,
                          env={**clean, **(env or {})})


def status_json(address: str, env: dict[str, str] | None = None) -> dict:
    """What `ifrt status --json` reports of the coordinator at ``address`` (``env``: its IFRT_* settings)."""
    result = ifrt_status("--coordinator", address, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_status(address: str, done: Callable[[dict], bool], timeout: float = 30) -> dict:
    """What `ifrt status --json` reports once ``done(status)`` holds; fails with the last answer after ``timeout``
    seconds. The looks until then ask in this process (``ifrt.status.query``, what the command prints, with the
    same settings), not with a process each; the answer returned is the command's own."""
    from ifrt import status
    from ifrt.settings import resolve

    settings = resolve(address, environ={k: v for k, v in os.environ.items() if not k.startswith("IFRT_")})
    deadline = time.monotonic() + timeout
    while True:
        poll_until(lambda: json.loads(json.dumps(status.query(settings, 10))), done,
                   max(deadline - time.monotonic(), 0.0), "the status", interval=0.1)
        if done(view := status_json(address)):
            return view
        assert time.monotonic() < deadline, f"the status did not hold within {timeout}s; last: {view!r}"


def metrics_port(coordinator: LocalCoordinator) -> int:
    """The port a coordinator started with ``--metrics-port 0`` serves its metrics on (read off its log)."""
    found = METRICS_LINE.search(coordinator.log)
    assert found, coordinator.log
    return int(found.group(1))


def rpc_calls(coordinator: LocalCoordinator) -> dict[str, float]:
    """How many calls of each Coordinator method a coordinator started with ``--metrics-port 0`` has answered (any
    status), read off its /metrics; a call is counted before its answer leaves."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port(coordinator)}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    calls: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ifrt_rpcs_total" and sample.labels.get("service") == "ifrt.topology.v1.Coordinator":
                calls[sample.labels["method"]] = calls.get(sample.labels["method"], 0.0) + sample.value
    return calls


# Values the tests of several layers share.

def content(num_processes=4, devices_per_process=8, attributes=False, kind="tpu-v5e") -> TopologyContent:
    """A generation-1 topology of job "job": hosts host0.., ``devices_per_process`` simulated devices each."""
    processes = tuple(Process(p, f"host{p}", f"10.0.0.{p}:9000") for p in range(num_processes))
    devices = tuple(
        Device(global_device_id(p, i), p, i, "tpu", kind, p // 2,
               {"uuid": f"dev-{p}-{i}", "memory": "16G"} if attributes else {}, "sim", (i // 2, i % 2))
        for p in range(num_processes) for i in range(devices_per_process))
    return TopologyContent("job", 1, num_processes, processes, devices)


UNSET = None
COMPARE_SET_TABLE = [
    pytest.param(UNSET, b"", b"new", b"new", b"new", id="unset, empty expected: created"),
    pytest.param(UNSET, b"old", b"new", UNSET, UNSET, id="unset, expected a value: nothing"),
    pytest.param(b"old", b"old", b"new", b"new", b"new", id="holds expected: swapped"),
    pytest.param(b"old", b"other", b"new", b"old", b"old", id="holds another value: nothing"),
    pytest.param(b"old", b"", b"new", b"old", b"old", id="holds a value, empty expected: not created again"),
    pytest.param(b"", b"", b"new", b"new", b"new", id="holds empty, empty expected: swapped"),
    pytest.param(b"old", b"old", b"", b"", b"", id="swapped to empty"),
    pytest.param(b"\x00\xff", b"\x00\xff", b"\xfe\x00", b"\xfe\x00", b"\xfe\x00", id="binary values"),
]
"""(what the key holds before, expected, desired) -> (the answer, what it holds after). TCPStore's own table: an
empty ``expected`` creates only; a mismatch changes nothing and answers what is there."""
