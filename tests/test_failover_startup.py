"""Start-ups, key-value waits, barriers and increments ride through a leader failover: a call whose own timeout is
shorter than the failover waits for the standby to take over (up to the failover window) instead of failing while
the store holds every answer. Real replicas on a real etcd, the leader killed with SIGKILL."""

from __future__ import annotations

import importlib.util
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

import ifrt
from coordinator.local import LocalCoordinator
from ifrt import failfast
from ifrt._generated import coordinator_pb2 as pb
from ifrt.client_config import DEFAULTS, ClientConfig
from ifrt.startup import StartupExchange
from tests.helpers import clients, free_port, poll_until
from tests.replicas import Replicas, serving

SHORT = 1.3
"""A call's own timeout, shorter than any failover: a lease of 2 s (tests/replicas.py) expires at the earliest 4/3 s
after the kill (it is renewed every third of its TTL), so a call begun before the kill ends its own time within it.
What is left of it after the takeover must still cover the other process's arrival at the new leader, which its
retry backoff (up to 1 s) may delay: the most that stays under 4/3 s."""


class Start(StartupExchange):
    """The start-up exchange as ``ifrt.torch`` and ``ifrt.jax`` run it, under keys of its own."""

    runtime, what = "failover-test", "the test's start-up"

    def run(self) -> tuple[dict, dict, str | None]:
        """Process 0's record, every process's answer and process 0's nonce: what every process must agree on."""
        record = self.exchange({"rank": self.topology.process_id}, lambda: {"address": f"here:{uuid.uuid4().hex}"})
        return record, self.answers, self.leader_nonce


@pytest.fixture
def pair(etcd) -> Iterator[tuple[Replicas, list[ifrt.Client]]]:
    """Two replicas of a 2-process job on etcd and its two processes as Clients here, discovered."""
    with Replicas(etcd, num_processes=2, cluster_id="riding", heartbeat="10") as replicas:
        made = clients(replicas.addresses, 2)
        try:
            yield replicas, made
        finally:
            for c in made:
                c.close()


def in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list]:
    """Runs ``call`` in a thread once it is about to be made; its result or exception lands in the list."""
    outcome: list = []
    began = threading.Event()

    def run() -> None:
        began.set()
        try:
            outcome.append(call())
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    began.wait(10)
    return thread, outcome


def kill_the_leader(replicas: Replicas) -> LocalCoordinator:
    """SIGKILLs the leader by pid and returns at once (nobody leads until the standby's lease wait is over)."""
    dead = replicas.leader
    dead.stop(signal.SIGKILL)
    return dead


def after_the_failover(replicas: Replicas, dead: LocalCoordinator, *threads: threading.Thread) -> float:
    """Joins ``threads`` and notes the replica that took over; returns how long the joins took."""
    began = time.monotonic()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a call did not return within 60s"
    replicas.leader = serving(*(c for c in replicas.all if c is not dead))
    return time.monotonic() - began


def test_a_direct_start_up_across_a_leader_kill_completes_alike_in_both(pair):
    replicas, (first, second) = pair
    deadline = time.monotonic() + 30
    leading, led = Start(first, first.topology, deadline), Start(second, second.topology, deadline)
    lead_thread, lead_outcome = in_thread(leading.run)
    # Process 0 has published its start and waits for process 1's answer when the leader dies.
    poll_until(lambda: second.kv_try_get(f"{leading.prefix}/start"), what="process 0's start record")
    dead = kill_the_leader(replicas)
    follow_thread, follow_outcome = in_thread(led.run)  # process 1 begins during the failover
    after_the_failover(replicas, dead, lead_thread, follow_thread)
    (lead,), (follow,) = lead_outcome, follow_outcome
    assert not isinstance(lead, Exception), lead
    assert not isinstance(follow, Exception), follow
    assert lead == follow  # the same record, answers and nonce in both
    record, answers, nonce = lead
    assert answers == {0: {"rank": 0}, 1: {"rank": 1}} and nonce == leading.nonce and record["address"]


def test_a_key_value_wait_and_a_barrier_that_straddle_a_leader_kill_complete(pair):
    replicas, (first, second) = pair
    getting, got = in_thread(lambda: first.kv_get("straddled", timeout=SHORT))
    arriving, arrived = in_thread(lambda: first.barrier("straddled", timeout=SHORT, process_ids=[0, 1]))
    dead = kill_the_leader(replicas)
    setting, _ = in_thread(lambda: second.kv_set("straddled", b"v", timeout=SHORT))
    joining, joined = in_thread(lambda: second.barrier("straddled", timeout=SHORT, process_ids=[0, 1]))
    after_the_failover(replicas, dead, getting, arriving, setting, joining)
    assert got == [b"v"] and arrived == [None] and joined == [None], (got, arrived, joined)
    assert second.kv_get("straddled", timeout=SHORT) == b"v"


def test_an_increment_retried_across_the_failover_applies_once(pair):
    replicas, (first, second) = pair
    # A call the leader applied and answered, and whose answer is then lost with it: the client sends it again, with
    # the same request id, as its retry loop does.
    lost = pb.KeyValueIncrementRequest(client_uid=first.client_uid, key="count", amount=1, request_id=uuid.uuid4().hex)
    assert first._unary("KeyValueIncrement", lambda _: lost, time.monotonic() + 30).value == 1
    dead = kill_the_leader(replicas)
    retrying, retried = in_thread(lambda: first._unary("KeyValueIncrement", lambda _: lost,
                                                        time.monotonic() + SHORT))
    adding, added = in_thread(lambda: second.kv_increment("count", timeout=SHORT))  # a new call, in the failover
    after_the_failover(replicas, dead, retrying, adding)
    assert [getattr(r, "value", r) for r in retried] == [1]  # answered as before, not applied again
    assert added == [2]
    assert second.kv_get("count", timeout=SHORT) == b"2"
    assert first.kv_increment("count") == 3


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_a_torch_store_wait_rides_through_a_failover(pair):
    import ifrt.torch

    replicas, (first, second) = pair
    reading, read = in_thread(lambda: ifrt.torch.Store(first, "c10d/", timeout=SHORT).get("rank/1"))
    dead = kill_the_leader(replicas)
    writing, _ = in_thread(lambda: ifrt.torch.Store(second, "c10d/", timeout=SHORT).set("rank/1", b"addr"))
    after_the_failover(replicas, dead, reading, writing)
    assert read == [b"addr"]


def test_past_the_failover_window_a_call_names_the_failover_what_it_waited_for_and_the_replicas():
    nobody = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    config = ClientConfig(failover_window_s=1.0)
    with ifrt.Client(nobody, process_id=0, num_processes=1, transfer=False, session=False, config=config) as client:
        began = time.monotonic()
        with pytest.raises(ifrt.CoordinatorUnavailable) as info:
            client.kv_get("nccl/id", timeout=0.2)
        waited = time.monotonic() - began
        message = str(info.value)
        assert 1.0 <= waited < 3.0, waited  # the failover window, not the call's own 0.2 s
        for said in ("key 'nccl/id'", "failover window", "IFRT_FAILOVER_WINDOW", *nobody):
            assert said in message, message
        began = time.monotonic()
        with pytest.raises(ifrt.CoordinatorUnavailable, match="barrier 'step-1'"):
            client.barrier("step-1", timeout=2.0)  # its own timeout is longer: it bounds the whole wait
        assert 2.0 <= time.monotonic() - began < 2.9


def test_the_failover_window_is_the_one_fail_fast_allows():
    assert DEFAULTS.failover_window_s == failfast.FAILOVER_WINDOW_S
