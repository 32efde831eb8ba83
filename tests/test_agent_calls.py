"""A worker's key-value, barrier and other unary calls through its ``ifrt run`` agent: two real agents of two workers on
loopback, each worker on its agent's Unix socket, each agent on one connection to a real coordinator. The calls
succeed, the coordinator hears them on the agents' connections only (no worker holds a TCP connection to its port),
and what it refuses reaches the worker as a direct call's refusal would."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from coordinator.local import LocalCoordinator
from ifrt._generated import coordinator_pb2 as pb
from ifrt.connection import Connection
from ifrt.errors import ERROR_TRAILER
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA
from ifrt.run.host_register import HostRegistrar
from ifrt.run.host_session import HostSession
from ifrt.run.local_server import STRANGER_CALLS, LocalServer
from ifrt.settings import resolve
from tests.helpers import poll_until, rpc_calls, secret_file
from tests.replicas import Replicas, serving
from tests.run_agents import WAIT_S, RunAgent, loopback_env
from tests.tls import make_certs

WORKER = Path(__file__).with_name("agent_calls_worker.py")
KEY_VALUE_SET = "/ifrt.topology.v1.Coordinator/KeyValueSet"
KEY_VALUE_GET = "/ifrt.topology.v1.Coordinator/KeyValueGet"
ESTABLISHED = "01"


def connections_to(port: int) -> set[int]:
    """The socket inodes of the client ends of established TCP connections to ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == ESTABLISHED and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    found.add(int(fields[9]))
    return found


def sockets_of(pid: int) -> set[int]:
    """The socket inodes process ``pid`` holds (none once it is gone)."""
    found = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def children_of(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from each process's parent in ``/proc/<pid>/stat``)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [child for child, p in parents.items() if p == parent]
        found += kids
        todo += kids
    return found


class ConnectionWatch:
    """Samples, every 20 ms until stopped, which TCP connections to the coordinator's ``port`` each agent and its
    workers hold: ``agent[i]`` and ``workers[i]`` are every socket seen, ``agent_peak[i]`` the most at once."""

    def __init__(self, port: int, agent_pids: list[int]) -> None:
        self._port, self._pids = port, agent_pids
        self.agent: list[set[int]] = [set() for _ in agent_pids]
        self.agent_peak = [0 for _ in agent_pids]
        self.workers: list[set[int]] = [set() for _ in agent_pids]
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            clients = connections_to(self._port)
            for i, pid in enumerate(self._pids):
                held = sockets_of(pid) & clients
                self.agent[i] |= held
                self.agent_peak[i] = max(self.agent_peak[i], len(held))
                for child in children_of(pid):  # a worker between fork and exec holds its agent's sockets too
                    self.workers[i] |= (sockets_of(child) & clients) - held
            self.samples += 1
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Job:
    """What one job of two agents of two ``calls`` workers showed."""

    results: dict[int, dict]
    watch: ConnectionWatch
    calls: dict[str, float]
    codes: list[int]
    probes: dict[str, tuple] = field(default_factory=dict)


def socket_of(a: RunAgent) -> str:
    """The agent's local socket, as its log names it."""
    return poll_until(lambda: next((m.group(1) for line in a.err
                                    if (m := re.search(r"serving this host's workers on (\S+)", line))), ""),
                      what=f"the agent's socket\n{a.output()}")


def refused(channel: grpc.Channel, uid: str, secret: str | None, token: str | None = None) -> tuple:
    """A KeyValueSet for ``uid``'s key carrying ``secret`` (and ``token``), made once: its status, details and
    ``ifrt-error``."""
    metadata = (() if secret is None else ((SECRET_METADATA, secret),)) + (() if token is None else
                                                                          ((TOKEN_METADATA, token),))
    request = pb.KeyValueSetRequest(client_uid=uid, key="stolen", value=b"x").SerializeToString()
    try:
        channel.unary_unary(KEY_VALUE_SET)(request, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details(), dict(e.trailing_metadata() or ()).get(ERROR_TRAILER)
    return (grpc.StatusCode.OK,)


def run_job(link: str) -> Job:
    """Two agents (``--worker-link link``) of two tests/agent_calls_worker.py ``calls`` workers against a coordinator
    of their own; the connections their processes hold sampled throughout."""
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCoordinator("--metrics-port", "0", num_processes=4) as coordinator:
        release = Path(tmp, "release")
        env = loopback_env(coordinator.address, AGENT_CALLS_RELEASE=str(release))
        hosts = [RunAgent("--nproc-per-host", "2", "--host-rank", str(h), "--num-hosts", "2", "--worker-link", link,
                          "--grace-seconds", "1", "--", sys.executable, str(WORKER), "calls", env=env)
                 for h in range(2)]
        try:
            watch = ConnectionWatch(int(coordinator.address.rsplit(":", 1)[1]), [a.process.pid for a in hosts])

            def found(pattern: str) -> dict[int, re.Match]:
                lines = (re.search(pattern, line) for a in hosts for line in a.out)
                return {int(m.group(1)): m for m in lines if m}

            started = poll_until(lambda: found(r"started process (\d+) pid (\d+) uid (\w+)"), lambda f: len(f) == 4,
                                 timeout=WAIT_S, what=f"4 workers started\n{hosts[0].output()}\n{hosts[1].output()}")
            results = poll_until(lambda: found(r"^\[\d+\] result (\d+) (.*)"), lambda f: len(f) == 4, timeout=WAIT_S,
                                 what=f"4 results\n{hosts[0].output()}\n{hosts[1].output()}")
            job = Job({p: json.loads(m.group(2)) for p, m in results.items()}, watch, {}, [])
            if link == "agent":  # while the workers still run: their uids are registered
                uid = started[1].group(3)
                with grpc.insecure_channel(f"unix:{socket_of(hosts[0])}") as agent, \
                        grpc.insecure_channel(coordinator.address) as direct:
                    for name, secret in (("wrong secret", "not-this-workers-secret"), ("no secret", None)):
                        job.probes[name] = (refused(agent, uid, secret), refused(direct, uid, secret))
            time.sleep(0.2)
            watch.stop()
            release.touch()
            job.codes = [a.wait(WAIT_S) for a in hosts]
            job.calls = rpc_calls(coordinator)
            return job
        finally:
            for a in hosts:
                a.stop()


@pytest.fixture(scope="module")
def through_agents() -> Job:
    return run_job("agent")


@pytest.fixture(scope="module")
def direct() -> Job:
    return run_job("direct")


def test_key_values_barriers_and_waiting_gets_of_workers_of_two_agents_succeed_through_them(through_agents):
    results = through_agents.results
    assert sorted(results) == [0, 1, 2, 3] and through_agents.codes == [0, 0], through_agents.codes
    cas = {r["cas"] for r in results.values()}
    assert len(cas) == 1 and cas <= {"0", "1", "2", "3"}  # one compare-set won, every process reads its value
    for r in results.values():
        assert r["keys"] == {f"k/{i}": f"v{i}" for i in range(4)}
        assert r["count"] == 4  # four increments, once each
        assert r["many"] == ["v0", "v1", "v2", "v3", None]
    assert results[0]["late"] == "here" and results[0]["late_waited_s"] >= 0.5, results[0]


def test_the_coordinator_hears_the_workers_calls_on_their_agents_connections_only(through_agents):
    watch, calls = through_agents.watch, through_agents.calls
    assert watch.samples > 20, watch.samples
    assert watch.workers == [set(), set()], watch.workers  # no worker held a TCP connection to the coordinator
    assert watch.agent_peak == [1, 1] and [len(s) for s in watch.agent] == [1, 1], watch.agent  # one per host
    for method in ("KeyValueSet", "KeyValueGet", "KeyValueIncrement", "KeyValueCompareSet", "KeyValueDir",
                   "KeyValueMultiGet", "KeyValueMultiSet", "KeyValueTryGet", "KeyValueDelete", "Barrier", "Leave"):
        assert calls.get(method, 0) >= 1, (method, calls)
    assert calls["Barrier"] >= 4 * 3 and calls["KeyValueSet"] >= 4 * 2, calls
    assert calls.get("Register", 0) == 0 and calls.get("Session", 0) == 0, calls


def test_eight_waits_of_one_worker_at_once_are_none_of_them_refused_by_its_agent(through_agents):
    for r in through_agents.results.values():
        assert r["waits"] == ["1"] * 8, r["waits"]  # one attempt each: a refusal for load would show here


def test_large_requests_and_replies_pass_both_hops_whole(through_agents):
    big = [[f"big/{i}", 1_000_000, f"{i:02x}"] for i in range(6)]
    for r in through_agents.results.values():
        assert r["big_dir"] == big  # 6 MB in one answer, past gRPC's 4 MiB default, through the agent
        assert r["big_many"] == [1_000_000] * 6
    assert through_agents.results[0]["deleted"] == 6


def test_a_call_for_another_workers_uid_is_refused_permission_denied_as_a_direct_call_is(through_agents):
    for r in through_agents.results.values():  # a worker's own secret, another worker's uid
        assert r["as_other"]["code"] == "PERMISSION_DENIED" and r["as_other"]["trailer"] == "PermissionDenied", r
    probes = through_agents.probes  # a caller on the agent's socket that is none of its workers
    for name, (agent, direct) in probes.items():
        assert agent == direct, name  # status, details and trailer, word for word
    assert probes["wrong secret"][0][0] == grpc.StatusCode.PERMISSION_DENIED, probes
    assert probes["wrong secret"][0][2] == "PermissionDenied", probes
    assert probes["no secret"][0][0] != grpc.StatusCode.OK, probes


def test_a_refused_calls_error_reaches_the_worker_as_a_direct_calls_does(through_agents, direct):
    assert direct.codes == [0, 0] and all(len(s) == 2 for s in direct.watch.workers), direct.watch.workers
    for p, r in through_agents.results.items():
        alone = direct.results[p]
        assert r["exists"]["class"] == alone["exists"]["class"] == "KeyExists", r["exists"]
        assert r["barrier"]["class"] == alone["barrier"]["class"] == "BarrierTimeout", r["barrier"]
        for kind in ("exists", "barrier"):
            assert (r[kind]["status"], r[kind]["retryable"]) == (alone[kind]["status"], alone[kind]["retryable"])
        # the coordinator's own words, after the name of where the worker's call went
        assert r["exists"]["message"].partition(": ")[2] == alone["exists"]["message"].partition(": ")[2]
        assert (r["as_other"]["code"], r["as_other"]["trailer"]) == (alone["as_other"]["code"],
                                                                     alone["as_other"]["trailer"])


def test_calls_made_while_no_replica_leads_are_retried_by_the_worker_through_its_agent_until_one_does(etcd, agents,
                                                                                                      tmp_path):
    release = tmp_path / "release"
    with Replicas(etcd, num_processes=2) as replicas:
        a = agents("--nproc-per-host", "2", "--grace-seconds", "1", "--", sys.executable, str(WORKER), "failover",
                   env=loopback_env(replicas.addresses, AGENT_CALLS_RELEASE=str(release)))
        poll_until(lambda: [line for line in a.out if "started process" in line], lambda f: len(f) == 2,
                   timeout=WAIT_S, what=f"2 workers started\n{a.output()}")
        dead = replicas.leader
        dead.stop(signal.SIGKILL)
        release.touch()  # the workers' calls go out while no replica leads (a standby takes over after its TTL)
        serving(*(c for c in replicas.all if c is not dead))
        results = [json.loads(a.wait_line(rf"^\[\d+\] result {p} (.*)").group(1)) for p in (0, 1)]
        assert a.wait(WAIT_S) == 0, a.output()
    print(f"through the failover: {results}")
    for r in results:  # each increment applied once, though its attempts met a dead leader and a standby
        assert r["n"] == 2 and r["keys"] == ["after/0", "after/1"] and r["took_s"] >= 1.0, r
    assert not [line for line in a.out + a.err if "AgentGone" in line], a.output()


def test_a_coordinator_out_of_reach_is_retried_by_the_worker_and_never_taken_for_its_agent_gone(start_coordinator,
                                                                                                agents):
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    with tempfile.TemporaryDirectory() as tmp:
        release = Path(tmp, "release")
        a = agents("--grace-seconds", "1", "--", sys.executable, str(WORKER), "lost",
                   env=loopback_env(coordinator.address, AGENT_CALLS_RELEASE=str(release)))
        a.wait_line(r"started process 0")
        coordinator.stop(signal.SIGKILL)
        release.touch()
        result = json.loads(a.wait_line(r"^\[0\] result 0 (.*)").group(1))
    # the agent answered each forwarded attempt as the coordinator's unavailability; the worker's own loop waited out
    # its failover window (2 s) and gave up naming it, as a direct call does
    assert result["class"] == "CoordinatorUnavailable" and result["retryable"], result
    assert "no coordinator replica answered as the leader" in result["message"], result
    assert result["took_s"] >= 2.0, result


def test_behind_the_token_and_tls_a_workers_calls_go_through_its_agent_and_a_wrong_token_is_refused_as_direct(
        start_coordinator, agents, tmp_path):
    certs = make_certs(tmp_path)
    token = tmp_path / "token"
    token.write_text("the job's token\n")
    token.chmod(0o600)
    key = secret_file(tmp_path / "agent-key")
    coordinator = start_coordinator("--token-file", str(token), "--agent-key-file", str(key), "--tls-cert",
                                    str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                                    num_processes=1, log_level="WARNING")
    release = tmp_path / "release"
    a = agents("--grace-seconds", "1", "--", sys.executable, str(WORKER), "secured", env=loopback_env(
        coordinator.address, IFRT_TOKEN_FILE=str(token), IFRT_TLS_CA=str(certs / "ca.pem"),
        IFRT_AGENT_KEY_FILE=str(key), AGENT_CALLS_RELEASE=str(release)))
    uid = a.wait_line(r"started process 0 pid \d+ uid (\w+)").group(1)
    watch = ConnectionWatch(int(coordinator.address.rsplit(":", 1)[1]), [a.process.pid])
    result = json.loads(a.wait_line(r"^\[0\] result 0 (.*)").group(1))
    credentials = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    with grpc.insecure_channel(f"unix:{socket_of(a)}") as agent, \
            grpc.secure_channel(coordinator.address, credentials) as direct:
        probes = {name: (refused(agent, uid, "not-its-secret", given), refused(direct, uid, "not-its-secret", given))
                  for name, given in (("wrong token", "not the token"), ("no token", None),
                                      ("the token", "the job's token"))}
    time.sleep(0.2)
    watch.stop()
    release.touch()
    assert a.wait(WAIT_S) == 0, a.output()
    assert result == {"get": "secured", "count": 1}, result
    assert watch.workers == [set()] and watch.agent_peak == [1], (watch.workers, watch.agent)
    for name, (through, alone) in probes.items():
        assert through == alone, name
    assert probes["wrong token"][0][0] == probes["no token"][0][0] == grpc.StatusCode.UNAUTHENTICATED, probes
    assert probes["the token"][0][0] == grpc.StatusCode.PERMISSION_DENIED, probes


def test_forwarded_calls_that_no_workers_secret_proves_hold_at_most_their_slots_and_one_more_is_refused_for_load(
        start_coordinator):
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    connection = Connection(resolve(coordinator.address, environ={}), "agent-secret")
    host = HostSession(connection, "agent-uid")
    registrar = HostRegistrar(connection, "agent-uid", workers=1, per_call=1, expected=lambda: 1,
                              published=host.open)
    local = LocalServer(registrar, host, workers=1, heartbeat_timeout_s=2.0, coordinator=connection)
    # a key any caller past the token may wait for (torchrun's rendezvous keys): each wait holds its slot
    wait = pb.KeyValueGetRequest(client_uid="nobody", key="torchrun/never", wait_ms=20_000).SerializeToString()
    try:
        with grpc.insecure_channel(f"unix:{local.path}") as channel:
            get = channel.unary_unary(KEY_VALUE_GET)
            held = [get.future(wait, timeout=30, metadata=((SECRET_METADATA, f"stranger-{i}"),))
                    for i in range(STRANGER_CALLS)]
            poll_until(lambda: local.slots.held.get(("stranger",), 0) == STRANGER_CALLS, timeout=10,
                       what="every stranger's slot held")
            began = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused_call:
                get(wait, timeout=30, metadata=((SECRET_METADATA, "one-more"),))
            assert refused_call.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused_call.value
            assert dict(refused_call.value.trailing_metadata())[ERROR_TRAILER] == "Overloaded"
            assert time.monotonic() - began < 2.0
            for call in held:
                call.cancel()  # the worker gives up: the agent's wait on the coordinator ends with it
            poll_until(lambda: not local.slots.held, timeout=10, what="every slot given back")
    finally:
        local.close()
        host.close()
        connection.close()
