"""Runtime coordination over the wire, with a real coordinator and real processes: key-value try-get, increments,
deletes and watches; barrier cancel and participant sets; live-set agreement; the preemption sync point; proxies."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time

import grpc
import pytest

import ifrt
from ifrt._generated import coordinator_pb2 as pb
from tests.helpers import (
    BIN,
    SERVICE,
    barrier_started_for,
    clients,
    discover_process,
    finish,
    free_port,
    in_thread,
    register_request,
)

HEARTBEAT_TIMEOUT = 1.0
SLACK = 5.0  # scheduling on a loaded 2-core machine


def test_try_get_increment_delete_and_a_watch_of_a_prefix(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    a, b = clients(coordinator.address, 2)
    with a, b:
        changes = a.kv_watch("cfg/", timeout=30)  # returns once the coordinator watches
        assert a.kv_try_get("cfg/x") is None
        b.kv_set("cfg/x", b"1")
        assert b.kv_increment("cfg/n", 2) == 2
        assert a.kv_increment("cfg/n") == 3
        b.kv_set("other", b"z")  # outside the prefix: not seen
        assert b.kv_delete("cfg/", prefix=True) == 2
        assert b.kv_delete("missing") == 0
        assert list(itertools.islice(changes, 5)) == [("cfg/x", b"1"), ("cfg/n", b"2"), ("cfg/n", b"3"),
                                                      ("cfg/n", None), ("cfg/x", None)]
        assert (a.kv_try_get("cfg/x"), a.kv_try_get("other")) == (None, b"z")
        with pytest.raises(ifrt.InvalidArgument, match="key 'other' holds 1 bytes that are not a decimal integer"):
            a.kv_increment("other")


def test_a_get_whose_time_runs_out_before_it_is_asked_reads_as_unset_not_as_an_unreachable_coordinator(
        start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    (client,) = clients(coordinator.address, 1)
    with client:  # the race of a retried wait: the coordinator answered "not yet" just before the deadline
        for timeout in (0.0, 1e-9):
            with pytest.raises(ifrt.KeyValueTimeout, match=r"key 'never' was not set within 0\.0s"):
                client.kv_get("never", timeout=timeout)
        client.kv_set("now", b"1")
        assert client.kv_get("now", timeout=5) == b"1"


def test_eight_processes_increment_one_key_8000_times(start_coordinator, coordination_workers):
    coordinator = start_coordinator(num_processes=8)
    workers = [coordination_workers(coordinator.address, i, 8, "increment", "counter", "1000") for i in range(8)]
    lasts = [w.expect("incremented", timeout=240)["last"] for w in workers]
    assert max(lasts) == 8000  # every increment counted once: none lost, none applied twice


def test_cancel_ends_current_and_future_waiters(start_coordinator):
    coordinator = start_coordinator(num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        waiting = in_thread(lambda: c0.barrier("step-1", timeout=60))
        barrier_started_for(coordinator.address, c0, "step-1")
        assert c1.cancel_barrier("step-1") is True
        error = waiting.get(timeout=10)
        assert isinstance(error, ifrt.BarrierCancelled)
        assert str(error).startswith("coordinator 127.0.0.1:") and "barrier 'step-1' was cancelled by process 1 (" in \
            str(error) and str(error).endswith("(CANCELLED)")
        with pytest.raises(ifrt.BarrierCancelled, match="was cancelled by process 1"):
            c2.barrier("step-1", timeout=60)  # a future waiter: at once
        assert c1.cancel_barrier("step-1") is False  # already ended
        assert c2.cancel_barrier("not-started") is True
        with pytest.raises(ifrt.BarrierCancelled, match="barrier 'not-started' was cancelled by process 2"):
            c0.barrier("not-started", timeout=60, process_ids=[0, 2])  # process 2 takes part: its cancel counts


def test_a_barrier_named_with_two_participant_sets_is_invalid_naming_both(start_coordinator):
    coordinator = start_coordinator(num_processes=3)
    c0, c1, c2 = clients(coordinator.address, 3)
    with c0, c1, c2:
        waiting = in_thread(lambda: c0.barrier("pair", timeout=60, process_ids=[0, 1]))
        barrier_started_for(coordinator.address, c0, "pair")
        with pytest.raises(ifrt.InvalidArgument) as info:
            c2.barrier("pair", timeout=60, process_ids=[0, 2])
        assert "barrier 'pair' was started for processes [0, 1]; this call names [0, 2]: use a new name for other " \
               "participants (INVALID_ARGUMENT)" in str(info.value)
        c1.barrier("pair", timeout=60, process_ids=[0, 1])  # the refused call changed nothing
        assert waiting.get(timeout=10) is None


def test_live_processes_agree_and_leave_out_a_process_killed_while_they_wait(start_coordinator, coordination_workers):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), num_processes=3)
    w1, w2 = (coordination_workers(coordinator.address, i, 3, "live", "60") for i in (1, 2))
    with ifrt.Client(coordinator.address, process_id=0, num_processes=3, timeout=60) as client:
        client.discover()
        for w in (w1, w2):
            w.expect("topology")
            w.tell("ask")
        assert client.live_processes(60) == {0: 0, 1: 0, 2: 0}
        assert w1.expect("live")["live"] == w2.expect("live")["live"] == {"0": 0, "1": 0, "2": 0}

        w1.tell("ask")
        answer = in_thread(lambda: client.live_processes(60))  # process 2 is alive and awaited
        os.kill(w2.process.pid, signal.SIGKILL)
        w2.process.wait()
        killed_at = time.monotonic()
        assert answer.get(timeout=HEARTBEAT_TIMEOUT + SLACK) == {0: 0, 1: 0}
        line = w1.expect("live", timeout=HEARTBEAT_TIMEOUT + SLACK)
        assert line["live"] == {"0": 0, "1": 0} and line["t"] - killed_at < HEARTBEAT_TIMEOUT + SLACK


def test_a_caller_that_leaves_while_it_waits_for_the_agreement_is_told_why_at_once(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "600", num_processes=2, log_level="DEBUG")
    with grpc.insecure_channel(coordinator.address) as channel:
        def call(method: str, request) -> bytes | grpc.RpcError:
            try:
                return channel.unary_unary(f"{SERVICE}/{method}")(request.SerializeToString(), timeout=60)
            except grpc.RpcError as e:
                return e

        registered = in_thread(lambda: call("Register", register_request(1, wait_ms=60_000)))
        with ifrt.Client(coordinator.address, process_id=0, num_processes=2, timeout=60) as client:
            client.discover()
            assert isinstance(registered.get(timeout=60), bytes)
            # Process 1 (no session: its heartbeat timeout is far away) asks who is alive; the agreement waits for
            # process 0, which never asks, for ten minutes.
            answer = in_thread(lambda: call("LiveProcesses", pb.LiveProcessesRequest(
                client_uid="uid-1", call_id="c1", timeout_ms=600_000)))
            coordinator.wait_for_log("live_processes waits up to")
            assert call("Leave", pb.LeaveRequest(client_uid="uid-1")) == b""
            error = answer.get(timeout=60)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "this process (host-1 (127.0.0.1)) was declared left" in error.details()


def test_every_process_reaches_the_preemption_sync_point_at_the_same_step(start_coordinator, coordination_workers):
    coordinator = start_coordinator(num_processes=4)
    speeds = (0.01, 0.02, 0.04, 0.07)  # seconds per step: four processes at different speeds
    workers = [coordination_workers(coordinator.address, i, 4, "steps", str(s), IFRT_PREEMPTION_SIGNALS="TERM")
               for i, s in enumerate(speeds)]
    for w in workers:
        w.expect("step", step=3)  # every process is stepping
    os.kill(workers[2].process.pid, signal.SIGTERM)
    sync_steps = []
    for w in workers:
        sync_steps.append(w.expect("step", reached=True)["step"])
        w.expect("closed")
        assert [line["step"] for line in w.seen if line.get("reached")] == [sync_steps[-1]]  # none earlier
        assert any(line.get("event") == "PreemptionNotice" and line["process_id"] == 2 for line in w.seen)
    assert len(set(sync_steps)) == 1, sync_steps
    assert workers[2].process.wait(30) == 0  # the signalled process lived until it reached the sync point


def unreachable_proxy() -> str:
    """An http proxy URL on a loopback port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


def proxy_env(proxy: str) -> dict[str, str]:
    return {"http_proxy": proxy, "https_proxy": proxy, "grpc_proxy": proxy, "no_proxy": "", "NO_PROXY": "",
            "no_grpc_proxy": ""}


def test_discover_dials_the_coordinator_directly_despite_a_proxy(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    proxy = unreachable_proxy()
    code, out, err = finish(discover_process(coordinator.address, env=proxy_env(proxy)))
    assert code == 0, err
    assert json.loads(out)["generation"] == 1
    # Through the proxy (asked for), the same discover cannot reach the coordinator: the proxy was really set.
    code, _, err = finish(discover_process(coordinator.address, env={**proxy_env(proxy), "IFRT_USE_PROXY": "1"},
                                           timeout=3))
    assert code != 0 and "no topology after" in err


def test_ifrt_env_says_the_proxy_is_not_used():
    proxy = unreachable_proxy()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_") and "proxy" not in k.lower()}
    env.update(IFRT_COORDINATOR="c1:8476", https_proxy=proxy)
    out = subprocess.run([str(BIN / "ifrt"), "env"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (f"proxy: https_proxy={proxy} set; the coordinator is dialled directly: ifrt ignores them (set "
            "IFRT_USE_PROXY=1 to go through the proxy)") in out.stdout.splitlines()
