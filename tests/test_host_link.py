"""``ifrt run --worker-link agent``: the host link's pure rules (batching, catch-up buffer, silence, watches), and the
agent's local server on a real Unix socket: its modes, its refusals, and a worker whose agent is gone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import grpc
import pytest

import ifrt
from ifrt._generated import coordinator_pb2 as pb
from ifrt.connection import Connection
from ifrt.errors import ERROR_TRAILER, AgentGone, InvalidArgument, ResourceExhausted
from ifrt.hostport import MAX_SOCKET_PATH
from ifrt.protocol import SECRET_METADATA, proof_of
from ifrt.run.host_register import HostRegistrar, Registered
from ifrt.run.host_rules import PENDING_PER_WORKER, Batcher, EventBuffer, Ranks, Silence, Watches, not_its_own
from ifrt.run.host_session import HostSession
from ifrt.run.local_server import LocalServer
from ifrt.settings import resolve
from tests.helpers import BIN

# The pure rules.


def test_registrations_go_once_every_live_worker_asked_or_after_the_wait():
    batcher: Batcher[str] = Batcher(workers=2, wait_s=0.2)
    batcher.join("a", "A", now=0.0)
    assert not batcher.due(0.1, expected=2)  # the other worker has not asked yet
    assert batcher.due(0.2, expected=2)  # a slow worker does not hold the host back
    batcher.join("b", "B", now=0.15)
    assert batcher.due(0.15, expected=2)
    taken = batcher.take(2, "round 1")
    assert [(t.uid, t.entry, t.round) for t in taken] == [("a", "A", "round 1"), ("b", "B", "round 1")]
    assert not batcher.due(10.0, expected=2)  # nothing unsent
    batcher.join("c", "C", now=1.0)
    assert batcher.due(1.0, expected=3)  # a and b in flight count as asked
    batcher.answered(taken)
    assert not batcher.due(1.0, expected=3) and batcher.pending() == 1


def test_one_call_carries_at_most_the_workers_the_agent_runs_and_the_rest_go_next():
    batcher: Batcher[str] = Batcher(workers=2)
    for uid in ("a", "b", "c"):
        batcher.join(uid, uid.upper(), now=0.0)
    assert [t.uid for t in batcher.take(2, 1)] == ["a", "b"]
    assert batcher.due(0.0, expected=2) and [t.uid for t in batcher.take(2, 2)] == ["c"]


def test_a_worker_asking_again_before_it_was_sent_replaces_its_entry():
    batcher: Batcher[str] = Batcher(workers=1)
    first = batcher.join("a", "old", now=0.0)
    assert batcher.join("a", "new", now=0.1) is first and first.entry == "new"
    assert batcher.wait(0.1) == pytest.approx(0.1)
    assert [t.entry for t in batcher.take(1, 1)] == ["new"]


def test_pending_registrations_are_bounded_per_worker_and_a_refusal_changes_nothing():
    batcher: Batcher[str] = Batcher(workers=2)
    limit = 2 * PENDING_PER_WORKER
    for i in range(limit):
        batcher.join(f"uid{i}", "x", now=0.0)
    with pytest.raises(ResourceExhausted, match=f"expected at most {PENDING_PER_WORKER} per worker"):
        batcher.join("one-more", "x", now=0.0)
    assert batcher.pending() == limit and "one-more" not in batcher.unsent
    batcher.join("uid0", "again", now=0.0)  # one already pending may ask again


def test_the_event_buffer_hands_out_what_a_worker_lacks_until_it_no_longer_keeps_it():
    buffer = EventBuffer(floor=5, count=3)
    assert buffer.since(5) == []
    for n in (6, 7, 8):
        assert buffer.add(n, b"%d" % n)
    assert not buffer.add(7, b"again")  # a job event comes once
    assert buffer.since(6) == [(7, b"7"), (8, b"8")]
    buffer.add(9, b"9")  # 6 is no longer kept
    assert buffer.floor == 6 and buffer.since(6) == [(7, b"7"), (8, b"8"), (9, b"9")]
    assert buffer.since(5) is None  # 6 is missing: the worker registers again
    bounded = EventBuffer(floor=0, max_bytes=10)
    bounded.add(1, b"x" * 8)
    bounded.add(2, b"y" * 8)
    assert bounded.since(1) == [(2, b"y" * 8)] and bounded.since(0) is None


def test_a_replacement_catching_up_is_not_told_of_its_predecessors_end_but_of_everything_else():
    events = [(6, "process_failed", 3), (7, "process_failed", 1), (8, "process_restarted", 3),
              (9, "key_changed", -1), (10, "process_failed", 3)]
    assert not_its_own(events, 3) == [7, 9, 10]  # 10: its own failure, after its restart
    assert not_its_own(events, 1) == [6, 7, 8, 9, 10]
    assert not_its_own(events[:2], 3) == [6, 7]  # never restarted: nothing of it is from before


def test_a_workers_exit_names_its_own_registration_even_seen_after_its_successor_registered():
    ranks = Ranks()
    first = ranks.started(0)
    ranks.registered(0, "first")
    second = ranks.started(0)  # the first was stopped; its exit is seen late
    ranks.registered(0, "second")
    assert ranks.exited(0, first) is None  # not its successor's
    assert ranks.exited(0, second) == "second" and ranks.exited(0, second) is None  # once
    never = ranks.started(1)  # exited before it registered
    assert ranks.exited(1, never) is None


def test_a_silent_session_is_reported_once_after_its_limit_and_a_heartbeat_resets_it():
    silence = Silence()
    silence.start("a", now=0.0, hung_after_s=2.0)
    silence.start("off", now=0.0, hung_after_s=0)  # 0: the coordinator does not watch for hung processes
    silence.heard("a", now=1.5)
    assert silence.silent(3.0) == []
    [(uid, why)] = silence.silent(3.6)
    assert uid == "a" and why == ("stopped answering: no heartbeat for 2.1s while its connection to its agent "
                                  "stayed up")
    assert silence.silent(10.0) == []
    silence.start("b", now=0.0, hung_after_s=1.0)
    silence.stop("b")
    assert silence.silent(5.0) == []


def test_a_prefix_is_watched_once_and_a_key_change_goes_only_to_its_watchers():
    watches = Watches()
    assert watches.add("a", "job/")
    assert not watches.add("b", "job/")
    assert watches.add("b", "job/x")
    assert not watches.watching("a", "job/")
    assert watches.acknowledge("job/") == {"a", "b"} and watches.watching("a", "job/")
    assert watches.for_key("job/x1") == {"a", "b"} and watches.for_key("job/y") == {"a", "b"}
    assert watches.for_key("other") == set()
    watches.drop(["a"])
    assert watches.for_key("job/y") == {"b"} and watches.prefixes() == ["job/", "job/x"]


# The local server on a real socket.

@pytest.fixture
def server():
    connection = Connection(resolve("127.0.0.1:1", environ={}), "agent-secret")
    host = HostSession(connection, "agent-uid")
    registrar = HostRegistrar(connection, "agent-uid", workers=1, per_call=1, expected=lambda: 1,
                              published=host.open)
    local = LocalServer(registrar, host, workers=1, heartbeat_timeout_s=2.0)
    yield local, registrar
    local.close()
    host.close()
    connection.close()


def test_the_socket_is_the_users_alone_and_goes_with_the_server():
    connection = Connection(resolve("127.0.0.1:1", environ={}), "agent-secret")
    host = HostSession(connection, "agent-uid")
    local = LocalServer(HostRegistrar(connection, "a", 1, 1, lambda: 1, host.open), host, 1, 2.0)
    try:
        assert stat.S_IMODE(os.stat(local.directory).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(local.path).st_mode) and stat.S_IMODE(os.stat(local.path).st_mode) == 0o600
        assert os.stat(local.directory).st_uid == os.getuid()
    finally:
        local.close()
    assert not os.path.exists(local.directory)


def test_a_socket_path_past_the_kernels_limit_is_refused_naming_it(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH - len(str(tmp_path))))
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    connection = Connection(resolve("127.0.0.1:1", environ={}), "agent-secret")
    host = HostSession(connection, "agent-uid")
    with pytest.raises(InvalidArgument, match=f"bytes long: the kernel takes at most {MAX_SOCKET_PATH}"):
        LocalServer(HostRegistrar(connection, "a", 1, 1, lambda: 1, host.open), host, 1, 2.0)
    assert list(deep.iterdir()) == []  # its directory is gone with it
    env = {**os.environ, "TMPDIR": str(deep), "IFRT_COORDINATOR": "127.0.0.1:1"}
    run = subprocess.run([str(BIN / "ifrt"), "run", "--", sys.executable, "-c", "pass"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--worker-link agent: the agent's socket path" in run.stderr, run.stderr


def _session(path: str, secret: str, uid: str) -> grpc.RpcError:
    with grpc.insecure_channel(f"unix:{path}") as channel:
        call = channel.stream_stream("/ifrt.topology.v1.Coordinator/Session",
                                     request_serializer=pb.SessionRequest.SerializeToString,
                                     response_deserializer=pb.SessionEvent.FromString)
        opening = pb.SessionRequest(open=pb.SessionOpen(client_uid=uid, since_event=1))
        with pytest.raises(grpc.RpcError) as refused:
            list(call(iter([opening]), metadata=((SECRET_METADATA, secret),), timeout=10))
    return refused.value


def test_a_worker_cannot_open_a_session_as_another_or_as_nobody(server):
    local, registrar = server
    registrar.registered["theirs"] = Registered(proof_of("their-secret"), local_rank=0, process_id=3)
    error = _session(local.path, "my-secret", "theirs")
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "is another process's" in error.details()
    assert dict(error.trailing_metadata())[ERROR_TRAILER] == "PermissionDenied"
    unknown = _session(local.path, "my-secret", "nobody")
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "register again" in unknown.details()
    assert dict(unknown.trailing_metadata())[ERROR_TRAILER] == "UnknownClient"  # the client registers again


def test_a_worker_whose_agent_is_gone_is_told_so_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("IFRT_AGENT_SOCKET", str(tmp_path / "agent.sock"))
    began = time.monotonic()
    with pytest.raises(AgentGone, match=f"the ifrt run agent serving {tmp_path / 'agent.sock'} .* is gone"):
        ifrt.Client("127.0.0.1:1", timeout=30, transfer=False).discover()
    assert time.monotonic() - began < 5
