"""Replacement and the multi-key calls behind the cluster token and TLS: ``ifrt run --recover replace`` (NextAttempt
with ``replace``, the ``replaced`` watch event, the new worker's registration as a new incarnation) and
KeyValueMultiGet/KeyValueMultiSet run with both, and a caller that holds the token but not the secret of the agent or
process it acts for is refused, changing nothing. Real agents, workers and clients on loopback."""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
from pathlib import Path

import grpc
import pytest

from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub, JobAgentsStub
from ifrt.protocol import SECRET_METADATA, TOKEN_METADATA
from ifrt.security import _WithMetadata
from tests.helpers import clients, poll_until, secret_file
from tests.run_agents import RUN_WORKER, WAIT_S, loopback_env, own_hostname, started_lines

TOKEN = "the replaced job's token"
HEARTBEAT_S = 1.0


@pytest.fixture
def secured(tmp_path, certs) -> tuple[tuple[str, ...], dict[str, str]]:
    """The coordinator's flags for the token and TLS, and the environment of its agents and processes."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    key = secret_file(tmp_path / "agent-key")
    return (("--token-file", str(token_file), "--agent-key-file", str(key), "--tls-cert", str(certs / "server.pem"),
             "--tls-key", str(certs / "server-key.pem")),
            {"IFRT_TOKEN_FILE": str(token_file), "IFRT_TLS_CA": str(certs / "ca.pem"), "IFRT_AGENT_KEY_FILE": str(key)})


def holder_of_the_token(address: str, certs: Path, secret: str) -> grpc.Channel:
    """A channel over TLS whose calls carry the token and ``secret`` (not that of whom they act for)."""
    credentials = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    channel = grpc.secure_channel(address, credentials)
    return grpc.intercept_channel(channel, _WithMetadata(((SECRET_METADATA, secret), (TOKEN_METADATA, TOKEN))))


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def process_lines(agent, process_id: int) -> list[re.Match]:
    return [m for line in agent.out
            if (m := re.search(rf"^\[{process_id}\] started process {process_id} attempt (\d+) pid (\d+)", line))]


def test_a_worker_is_replaced_behind_the_token_and_tls_and_no_token_holder_can_ask_for_it(
        start_coordinator, agents, secured, certs):
    flags, env = secured
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_S), *flags, num_processes=4,
                                    log_level="DEBUG")
    both = [agents("--nproc-per-host", "2", "--host-rank", str(h), "--num-hosts", "2", "--grace-seconds", "2",
                   "--recover", "replace", "--max-restarts", "2", "--", sys.executable, str(RUN_WORKER), "loop",
                   env=loopback_env(coordinator.address, **env), wrapper=own_hostname(f"host-{h}")) for h in range(2)]
    first = [poll_until(lambda a=a: started_lines(a, 0), lambda f: len(f) == 2, timeout=WAIT_S, what="attempt 0")
             for a in both]
    pids = {pid: int(m.group(3)) for lines in first for pid, m in lines.items()}
    uids = re.findall(r"the agent '?(\w+)'? on ", coordinator.log)  # what an attacker may learn
    assert len(set(uids)) == 2, coordinator.log
    channel = holder_of_the_token(coordinator.address, certs, secrets.token_hex(16))
    with channel:
        job = JobAgentsStub(channel)
        for agent_uid in (*sorted(set(uids)), "intruder"):  # a real agent without its secret, and no agent at all
            request = pb.NextAttemptRequest(ended_attempt=0, request_id=secrets.token_hex(8), agent_uid=agent_uid,
                                            replace=True, failure=pb.AttemptFailure(attempt=0, process_id=3,
                                                                                    host="x", reason="made up"))
            error = refused(lambda r=request: job.NextAttempt(r, timeout=10))
            assert error.code() is grpc.StatusCode.PERMISSION_DENIED, error
            assert ("does not carry its secret" if agent_uid in uids else "is no agent of this job") in \
                error.details(), error
        state = next(job.WatchJob(pb.WatchJobRequest(host="x", agent_uid="onlooker"), timeout=10)).state
        assert (state.attempt, state.replacements, list(state.failures)) == (0, 0, [])
    assert {pid: int(m.group(3)) for a in both for pid, m in started_lines(a, 0).items()} == pids
    assert all(len(process_lines(both[pid // 2], pid)) == 1 for pid in pids)  # nobody was replaced

    os.kill(pids[3], signal.SIGKILL)  # NextAttempt(replace), the `replaced` event and the new registration
    again = poll_until(lambda: process_lines(both[1], 3), lambda ms: len(ms) == 2, timeout=WAIT_S,
                       what="process 3 started anew")
    assert again[1].group(1) == "0" and int(again[1].group(2)) != pids[3], both[1].output()
    for pid in (0, 1, 2):
        assert [int(m.group(2)) for m in process_lines(both[pid // 2], pid)] == [pids[pid]]  # never restarted
    poll_until(lambda: coordinator.log, lambda log: re.search(r"process 3 \(.*\) restarted \(incarnation 1\)", log),
               timeout=WAIT_S, what="the replacement registered as incarnation 1")
    poll_until(lambda: "\n".join(both[0].err), lambda err: "process 3 is replaced by its agent" in err,
               timeout=WAIT_S, what="the other agent's watch told of the replacement")  # the `replaced` event
    assert all(a.process.poll() is None for a in both)
    assert "the call carries no token" not in "\n".join(both[0].err + both[1].err)


def test_multi_key_calls_run_behind_the_token_and_tls_and_no_token_holder_can_make_them_for_a_process(
        start_coordinator, secured, certs):
    flags, env = secured
    coordinator = start_coordinator(*flags, num_processes=2)
    made = clients(coordinator.address, 2, session=False, environ=env)
    try:
        victim, other = made
        victim.kv_multi_set([("a", b"1"), ("b", b"2")])
        assert other.kv_multi_get(["a", "b", "c"]) == [b"1", b"2", None]
        for secret in (other.process_secret, secrets.token_hex(16)):  # a peer's secret, or one of its own
            channel = holder_of_the_token(coordinator.address, certs, secret)
            with channel:
                stub = CoordinatorStub(channel)
                writing = refused(lambda s=stub: s.KeyValueMultiSet(pb.KeyValueMultiSetRequest(
                    client_uid=victim.client_uid, allow_overwrite=True,
                    entries=[pb.KeyValueEntry(key="a", value=b"forged"), pb.KeyValueEntry(key="d", value=b"x")]),
                    timeout=10))
                reading = refused(lambda s=stub: s.KeyValueMultiGet(pb.KeyValueMultiGetRequest(
                    client_uid=victim.client_uid, keys=["a", "b"]), timeout=10))
                for error in (writing, reading):
                    assert error.code() is grpc.StatusCode.PERMISSION_DENIED, error
                    assert "does not carry its process secret" in error.details(), error
        channel = grpc.secure_channel(coordinator.address, grpc.ssl_channel_credentials(
            root_certificates=(certs / "ca.pem").read_bytes()))
        with channel:  # without the token: refused before anything is looked at
            error = refused(lambda: CoordinatorStub(channel).KeyValueMultiGet(pb.KeyValueMultiGetRequest(
                client_uid=victim.client_uid, keys=["a"]), timeout=10))
            assert error.code() is grpc.StatusCode.UNAUTHENTICATED, error
        assert victim.kv_multi_get(["a", "b", "d"]) == [b"1", b"2", None]  # nothing changed
    finally:
        for c in made:
            c.close()
