"""torchrun with ``--rdzv-backend ifrt``: real torchrun agents and gloo workers, real coordinators on loopback.

Each torchrun runs 2 workers of tests/torchrun_worker.py (plain ``torch.distributed.init_process_group``) as one
"node" with its own loopback address (``--local-addr 127.0.0.x``), as a host would have.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

import ifrt
from coordinator.core.assignment import assign_process_ids
from coordinator.core.registration import Registration
from ifrt.errors import InvalidArgument
from ifrt.torchrun.backend import (
    KEY_PREFIX,
    HostKey,
    IfrtRendezvousBackend,
    agent_position,
    create_rendezvous_handler,
    endpoint_replicas,
    host_entry,
    node_ranks,
)
from tests.helpers import finish, poll_until
from tests.replicas import Replicas

BIN = Path(sys.executable).parent
WORKER = Path(__file__).with_name("torchrun_worker.py")
CONF = "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,read_timeout=30"
RUN_S = 120  # the longest one torchrun may take here (torch imports on 2 shared cores); runs take ~10-30 s
TOKEN = "torchrun-test-token\n"


@dataclass(frozen=True)
class Security:
    """How a test's coordinators run (their flags) and what its agents and workers are given (IFRT_*)."""

    flags: tuple[str, ...]
    env: dict[str, str]


SECURED = pytest.mark.parametrize("security", ["token-tls"], indirect=True)
"""A job test that runs with the cluster token and TLS: the agents' and workers' calls all carry both."""


@pytest.fixture
def security(request, certs, tmp_path) -> Security:
    """A job test's coordinator: plain, or with the cluster token and TLS where the test is marked SECURED."""
    if getattr(request, "param", "plain") == "plain":
        return Security((), {})
    (tmp_path / "token").write_text(TOKEN)
    return Security(("--token-file", str(tmp_path / "token"), "--tls-cert", str(certs / "server.pem"),
                     "--tls-key", str(certs / "server-key.pem")),
                    {"IFRT_TOKEN_FILE": str(tmp_path / "token"), "IFRT_TLS_CA": str(certs / "ca.pem")})


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    """Starts torchrun agents, each ("node" ``node_addr``) with 2 workers writing into ``tmp_path``; any agent
    still running at the end is stopped with its workers (its own session, by its pid)."""
    started: list[subprocess.Popen] = []

    def start(endpoint: str, run_id: str, node_addr: str, *worker_args: str, nnodes: str = "2",
              max_restarts: int = 0, ifrt_env: dict[str, str] | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "TORCHELASTIC_"))}
        env.update(ifrt_env or {})  # the token and TLS settings, for agents and workers alike
        env["TEST_NODE_ADDR"] = node_addr
        env["LOGLEVEL"] = "INFO"  # torch elastic's rendezvous rounds in the agent's output, for a failure's report
        command = [str(BIN / "torchrun"), "--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "ifrt",
                   "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--local-addr", node_addr, "--rdzv-conf", CONF,
                   "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", str(WORKER),
                   "--out", str(tmp_path), *worker_args]
        agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
        started.append(agent)
        return agent

    yield start
    for agent in started:  # its session, also when the agent itself was killed already: it and its workers
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.communicate()


def finish_all(agents: list[subprocess.Popen]) -> None:
    """Waits for every agent; a failure shows what each of them said (a hang in one often starts in another)."""
    outcomes = []
    for agent in agents:
        try:
            code, _, err = finish(agent, RUN_S)
        except AssertionError as e:  # it outlived RUN_S and was killed
            code, err = None, str(e)
        outcomes.append((agent.pid, code, err))
    if any(code != 0 for _, code, _ in outcomes):
        said = "\n".join(f"--- torchrun {pid} exited with {code}:\n{err[-20000:]}" for pid, code, err in outcomes)
        raise AssertionError(f"not every torchrun succeeded:\n{said}")


def results(out: Path, world: int = 4) -> list[dict]:
    """Every worker's report, by rank; checks the DDP step and the all_reduce agree in all of them."""
    reports = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["dist_rank"])
    assert [r["dist_rank"] for r in reports] == list(range(world)), reports
    assert {r["dist_world"] for r in reports} == {world}
    assert {r["all_reduce"] for r in reports} == {world * (world + 1) / 2}
    assert len({tuple(r["params"]) for r in reports}) == 1, "DDP left the workers with different parameters"
    for r in reports:
        assert int(r["RANK"]) == 2 * int(r["GROUP_RANK"]) + int(r["LOCAL_RANK"]) == r["dist_rank"]
    return reports


# The contract: node ranks are ifrt's host order, the same order the coordinator gives process ids in.
def test_node_ranks_give_workers_the_process_ids_the_coordinator_would_assign():
    hosts = [HostKey("b", "10.0.0.10"), HostKey("b", "10.0.0.9"), HostKey("a", "fe80::1"), HostKey("a", "10.0.0.11"),
             HostKey("a", "node-x"), HostKey("b", "::1")]
    ranks = node_ranks({f"agent{i}": h for i, h in enumerate(hosts)})
    registrations = [Registration(f"{i}/{local}", "", 12, None, h.hostname, h.address, local, "", ())
                     for i, h in enumerate(hosts) for local in range(2)]
    assigned = assign_process_ids(registrations)
    for uid, process_id in assigned.items():
        agent, local = uid.split("/")
        assert ranks[f"agent{agent}"] * 2 + int(local) == process_id, (uid, ranks, assigned)


def test_endpoint_names_replicas_with_ifrts_default_port():
    assert endpoint_replicas("c1, c2:9000") == ("c1:8476", "c2:9000")
    assert endpoint_replicas("::1") == ("[::1]:8476",)
    with pytest.raises(ifrt.InvalidArgument, match="--rdzv-endpoint is empty"):
        endpoint_replicas(" , ")
    with pytest.raises(ifrt.InvalidArgument, match="port from 1 to 65535"):
        endpoint_replicas("c1:0")


@pytest.mark.parametrize("key, value", [("read_timeout", "0"), ("join_timeout", "soon"),
                                        ("keep_alive_interval", "-1")])
def test_a_bad_rdzv_conf_value_is_named_and_changes_nothing(monkeypatch, key, value):
    monkeypatch.delenv("IFRT_COORDINATOR", raising=False)
    params = RendezvousParameters("ifrt", "127.0.0.1:8476", "job", 1, 2, **{key: value})
    with pytest.raises(ifrt.InvalidArgument, match=f"--rdzv-conf {key}='{value}': expected a positive integer"):
        create_rendezvous_handler(params)
    assert "IFRT_COORDINATOR" not in os.environ  # nothing handed on to workers


def state_of_round(round_: int) -> bytes:
    """torch's rendezvous state at ``round_``, as its state holder pickles it."""
    state = _RendezvousState()
    state.round = round_
    return pickle.dumps(state)


def test_backend_fences_writes_with_the_stored_state(start_coordinator):
    """torch's backend contract: set with no token creates only; a stale token loses and gets the current state."""
    coordinator = start_coordinator(num_processes=4)
    s1, s2, s3, other = map(state_of_round, (1, 2, 3, 4))
    with ifrt.Client(coordinator.address, session=False, transfer=False) as a, \
            ifrt.Client(coordinator.address, session=False, transfer=False) as b:
        first, second = (IfrtRendezvousBackend(c, f"{KEY_PREFIX}job/state") for c in (a, b))
        assert first.get_state() is None
        assert first.set_state(s1) == (s1, s1, True)
        assert second.set_state(other) == (s1, s1, False)  # no token: creates only
        assert second.set_state(s2, s1) == (s2, s2, True)
        assert first.set_state(s3, s1) == (s2, s2, False)  # a stale token
        assert first.get_state() == (s2, s2)


class WritesMarker:
    """Unpickled, it creates ``path`` through os.system: a stand-in for any command an attacker would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_pickle_planted_at_the_state_key_runs_nothing_and_the_agent_names_the_key(start_coordinator, torchrun,
                                                                                  tmp_path):
    """Any holder of the token can write under torchrun/ (the agents are no processes of the topology): the agent
    refuses what it finds there before torch unpickles it, and says where it found it."""
    (tmp_path / "token").write_text(TOKEN)
    token_env = {"IFRT_TOKEN_FILE": str(tmp_path / "token")}
    coordinator = start_coordinator("--token-file", str(tmp_path / "token"), num_processes=4)
    marker, key = tmp_path / "ran", f"{KEY_PREFIX}planted/state"
    with ifrt.Client(coordinator.address, session=False, transfer=False, environ=token_env) as attacker:
        attacker.kv_set(key, pickle.dumps(WritesMarker(marker)))
    started = time.monotonic()
    agent = torchrun(coordinator.address, "planted", "127.0.0.2", ifrt_env=token_env)
    code, _, err = finish(agent, RUN_S)
    assert code != 0 and not marker.exists()
    assert f"RendezvousStateError: refused the rendezvous state at '{key}'" in err, err[-5000:]
    assert f"it names {os.system.__module__}.system, which is no class of torch's rendezvous state" in err
    assert time.monotonic() - started < 90, "the agent waited out its join_timeout instead of failing at once"


@SECURED
def test_two_agents_of_two_workers_train_a_ddp_step_with_nodes_in_ifrt_host_order(start_coordinator, torchrun,
                                                                                   security, tmp_path):
    coordinator = start_coordinator(*security.flags, num_processes=4)
    # torch's own rendezvous sorts nodes by address text ("127.0.0.10" < "127.0.0.9"); ifrt's order is numeric.
    agents = [torchrun(coordinator.address, "ddp", addr, "--ifrt", ifrt_env=security.env)
              for addr in ("127.0.0.10", "127.0.0.9")]
    finish_all(agents)
    reports = results(tmp_path)
    assert [r["process_id"] for r in reports] == [0, 1, 2, 3]  # ifrt.torch in the workers: the same ranks
    assert {r["node_addr"]: r["GROUP_RANK"] for r in reports} == {"127.0.0.9": "0", "127.0.0.10": "1"}
    assert {r["MASTER_ADDR"] for r in reports} == {"127.0.0.9"}  # node rank 0 hosts the workers' store


@SECURED
def test_rendezvous_completes_after_the_leading_replica_is_killed(etcd, torchrun, security, tmp_path):
    replicas = Replicas(etcd, *security.flags)
    try:
        first = torchrun(replicas.addresses, "failover", "127.0.0.2", ifrt_env=security.env)
        with ifrt.Client(replicas.addresses, session=False, transfer=False, environ=security.env) as probe:
            poll_until(lambda: probe.kv_try_get(f"{KEY_PREFIX}failover/state", timeout=10) is not None,
                       timeout=RUN_S, what="rendezvous state from the first agent")
        replicas.kill_leader()  # the first agent waits in the rendezvous, its state on the killed leader
        second = torchrun(replicas.addresses, "failover", "127.0.0.3", ifrt_env=security.env)
        finish_all([first, second])
        results(tmp_path)
    finally:
        replicas.close()


def test_a_killed_worker_restarts_the_group_within_max_restarts(start_coordinator, torchrun, security, tmp_path):
    coordinator = start_coordinator(*security.flags, num_processes=4)
    agents = [torchrun(coordinator.address, "restart", addr, "--hang-node", "1", max_restarts=1,
                       ifrt_env=security.env)
              for addr in ("127.0.0.2", "127.0.0.3")]
    poll_until((tmp_path / "hang.pid").exists, timeout=RUN_S, what="a worker waiting to be killed")
    os.kill(int((tmp_path / "hang.pid").read_text()), signal.SIGKILL)
    finish_all(agents)
    reports = results(tmp_path)
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in reports if r["GROUP_RANK"] == "1"} == {"1"}


def test_a_killed_worker_with_ifrt_torch_restarts_the_group_as_a_new_run_on_every_node(start_coordinator, torchrun,
                                                                                      tmp_path):
    """torchrun restarts every node's workers (--max-restarts 1) after one worker of a started group is killed: the
    restarted workers (restart count 1 on the failed node, 0 on the other) form a new run of the job together."""
    coordinator = start_coordinator(num_processes=4)
    agents = [torchrun(coordinator.address, "rerun", addr, "--hang-after-start", "1", "--ifrt", max_restarts=1)
              for addr in ("127.0.0.2", "127.0.0.3")]
    poll_until((tmp_path / "hang.pid").exists, timeout=RUN_S, what="a worker of a started group waiting to be killed")
    os.kill(int((tmp_path / "hang.pid").read_text()), signal.SIGKILL)
    finish_all(agents)  # bounded: every agent ends within RUN_S, or the test fails naming what each said
    reports = results(tmp_path)
    assert [r["process_id"] for r in reports] == [0, 1, 2, 3]
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in reports if r["GROUP_RANK"] == "1"} == {"1"}
    assert "run 2 starts" in coordinator.log, coordinator.log[-5000:]


def test_nnodes_min_max_starts_with_one_node_and_admits_a_late_one(start_coordinator, torchrun, security, tmp_path):
    coordinator = start_coordinator(*security.flags, num_processes=4)
    first = torchrun(coordinator.address, "elastic", "127.0.0.2", "--until-world", "4", nnodes="1:2",
                     ifrt_env=security.env)
    poll_until(lambda: any(tmp_path.glob("waiting*")), timeout=RUN_S, what="a group of the first node alone")
    second = torchrun(coordinator.address, "elastic", "127.0.0.3", "--until-world", "4", nnodes="1:2",
                      ifrt_env=security.env)
    finish_all([first, second])
    reports = results(tmp_path)
    assert {r["node_addr"] for r in reports} == {"127.0.0.2", "127.0.0.3"}


# Node ranks in network order.
def test_node_ranks_follow_the_network_then_natural_hostnames():
    hosts = {"a": HostKey("node10", "10.0.0.1", ("spine", "rack2")), "b": HostKey("node2", "10.0.0.2", ("spine",
             "rack10")), "c": HostKey("node9", "10.0.0.3", ("spine", "rack2")), "d": HostKey("node1", "10.0.0.4")}
    # no position first (XLA's empty path), then rack2 before rack10, node9 before node10 inside rack2
    assert node_ranks(hosts) == {"d": 0, "c": 1, "a": 2, "b": 3}


def test_an_agent_reads_its_position_as_its_workers_do_and_refuses_a_bad_one():
    assert agent_position({"IFRT_NETWORK_NODES": "spine1, block2,rack7"}) == ("spine1", "block2", "rack7")
    assert agent_position({"XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES": "s,r1"}) == ("s", "r1")
    assert agent_position({}) == ()
    with pytest.raises(InvalidArgument, match=r"IFRT_NETWORK_NODES: level 1 of the network path .* is empty"):
        agent_position({"IFRT_NETWORK_NODES": "spine1,,rack7"})
    with pytest.raises(InvalidArgument, match="IFRT_NETWORK_NODES: a network path of 9 levels"):
        agent_position({"IFRT_NETWORK_NODES": ",".join(f"l{i}" for i in range(9))})


def test_a_published_position_is_read_back_and_a_bad_one_refused_naming_the_key():
    key = "torchrun/job/hosts/n1"
    entry = {"hostname": "node7", "address": "10.0.0.7", "network": ["spine", "rack3"]}
    assert host_entry(key, json.dumps(entry).encode()) == HostKey("node7", "10.0.0.7", ("spine", "rack3"))
    old = {"hostname": "node7", "address": "10.0.0.7"}  # an agent of a version without positions
    assert host_entry(key, json.dumps(old).encode()) == HostKey("node7", "10.0.0.7")
    for bad in ({**entry, "network": "spine,rack3"}, {**entry, "network": [1]}, {**entry, "extra": 1}):
        with pytest.raises(RendezvousStateError, match=f"refused the node's host at '{key}'"):
            host_entry(key, json.dumps(bad).encode())
    with pytest.raises(RendezvousStateError, match=r"refused the node.s host: .*level 0 of the network path"):
        host_entry(key, json.dumps({**entry, "network": [" ", "rack3"]}).encode())


def test_agents_in_two_racks_get_node_ranks_in_rack_order_not_address_order(start_coordinator, torchrun,
                                                                            tmp_path):
    coordinator = start_coordinator(num_processes=4)
    # by address 127.0.0.9 would be node 0 (ifrt's order without positions); its rack, rack10, comes after rack2
    placed = {"127.0.0.9": "spine,rack10", "127.0.0.10": "spine,rack2"}
    agents = [torchrun(coordinator.address, "racks", addr, "--ifrt", ifrt_env={"IFRT_NETWORK_NODES": rack})
              for addr, rack in placed.items()]
    finish_all(agents)
    reports = results(tmp_path)
    assert {r["node_addr"]: r["GROUP_RANK"] for r in reports} == {"127.0.0.10": "0", "127.0.0.9": "1"}
    assert [r["process_id"] for r in reports] == [0, 1, 2, 3]  # the workers' ids, in the same network order
    assert {r["MASTER_ADDR"] for r in reports} == {"127.0.0.10"}
