"""The host's registrations under ``ifrt run --worker-link agent``: a worker's re-poll rides on the host's call in
flight that carries it instead of a call of its own, and each worker is answered with what the coordinator said of
it. The pure rules (``ifrt.run.host_rules``), the registrar against a scripted coordinator, then real agents whose
workers reach ``discover()`` seconds apart."""

from __future__ import annotations

import queue
import re
import sys
import threading
import time

import grpc
import pytest

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import PermissionDenied, ProcessIdTaken
from ifrt.run.host_register import HostRegistrar, Refused
from ifrt.run.host_rules import Batcher
from tests.helpers import poll_until, rpc_calls
from tests.run_agents import WAIT_S, loopback_env

STAGGER_S = 2.5
"""Seconds between two local ranks' ``discover()``: more than a first long poll (1.5 s), so that each worker's first
call is answered before the next worker asks."""
STAGGERED = ("import os, time\n"
             "import ifrt\n"
             "client = ifrt.Client(transfer=False)\n"
             "rank = int(os.environ['IFRT_LOCAL_RANK'])\n"
             f"time.sleep(max(0.0, float(os.environ['STAGGER_FROM']) + {STAGGER_S} * rank - time.time()))\n"
             "t = client.discover()\n"
             "print(f'topology process {t.process_id} fingerprint {t.fingerprint}', flush=True)\n"
             "time.sleep(120)\n")


# The pure rules: which asks send a call, which call answers them, with what.


def test_a_re_poll_that_a_call_in_flight_carries_sends_nothing_and_that_call_answers_it():
    batcher: Batcher[str] = Batcher(workers=2)
    a1 = batcher.join("a", "A", 0.0, wait_until=5.0, deadline=10.0)
    first = batcher.take(2, "first", now=0.2)
    b1 = batcher.join("b", "B", 1.0, wait_until=2.5, deadline=7.5)
    second = batcher.take(2, "second", now=1.2)
    assert [t.uid for t in second] == ["b", "a"]  # a, still asking, rides on the newer call too
    assert batcher.answered(second, {"a": "progress", "b": "progress"}) == [b1, a1]  # the first to come back
    batcher.leave(a1)
    batcher.leave(b1)
    a2 = batcher.join("a", "A", 1.3, wait_until=6.3, deadline=11.3)  # a's re-poll: the first call still carries a
    b2 = batcher.join("b", "B", 1.3, wait_until=6.3, deadline=11.3)  # b's: nothing carries b any more
    assert batcher.covered("a") and "a" not in batcher.unsent and list(batcher.unsent) == ["b"]
    assert batcher.answered(first, {"a": "a, as the coordinator answered it"}) == [a2]
    assert a2.answer == "a, as the coordinator answered it" and b2.answer is None


def test_each_ask_gets_what_the_call_says_of_its_own_uid_and_a_failure_only_where_no_other_call_carries_it():
    batcher: Batcher[str] = Batcher(workers=2)
    a1, b1 = (batcher.join(uid, uid.upper(), 0.0, wait_until=5.0, deadline=10.0) for uid in "ab")
    first = batcher.take(2, "first", now=0.0)
    refused = Refused(ProcessIdTaken("a is taken"), grpc.StatusCode.ALREADY_EXISTS)
    assert batcher.answered(first, {"a": refused, "b": "b's id and the topology"}) == [a1, b1]
    assert a1.answer is refused and b1.answer == "b's id and the topology"  # never another's
    for t in (a1, b1):
        batcher.leave(t)
    c1 = batcher.join("c", "C", 1.0, wait_until=6.0, deadline=11.0)
    one = batcher.take(2, "one", now=1.0)
    d1 = batcher.join("d", "D", 1.5, wait_until=6.5, deadline=11.5)
    two = batcher.take(2, "two", now=1.5)  # carries d and c
    assert batcher.answered(two, failed="unavailable") == [d1]  # c waits for the call that still carries it
    assert c1.answer is None and batcher.answered(one, {"c": "c's answer"}) == [c1]


def test_an_ask_past_its_own_wait_gets_the_hosts_fresh_progress_only_while_a_call_carries_it():
    batcher: Batcher[str] = Batcher(workers=2, kept_s=8.0)
    a1 = batcher.join("a", "A", 0.0, wait_until=1.5, deadline=6.5)
    assert batcher.kept(a1, 1.5) is None  # unsent: it goes, and its call answers it
    call = batcher.take(2, "call", now=0.2)
    batcher.keep("progress", 0.1, batcher.epoch)
    assert batcher.kept(a1, 1.5) == "progress" and batcher.kept(a1, 8.2) is None  # stale: it waits on
    batcher.forget()  # a topology came, or a worker started
    assert batcher.kept(a1, 1.5) is None
    batcher.keep("older run's progress", 0.3, batcher.epoch - 1)  # a call taken before that
    assert batcher.kept(a1, 1.5) is None
    batcher.answered(call, {"a": "answer"})
    batcher.keep("progress", 2.0, batcher.epoch)
    assert batcher.kept(a1, 2.0) is None  # nothing in flight carries it


def test_a_call_waits_the_longest_of_its_asks_only_where_fresh_progress_answers_the_others_meanwhile():
    batcher: Batcher[str] = Batcher(workers=3)
    batcher.join("a", "A", 0.0, wait_until=5.0, deadline=10.0)
    batcher.join("b", "B", 0.0, wait_until=1.5, deadline=6.5)
    taken = batcher.take(3, "call", now=0.0)
    assert batcher.window(taken, 0.0) == (10.0, 1.5)  # nothing kept: the shortest wait, as its own call would be
    batcher.keep("progress", 0.0, batcher.epoch)
    assert batcher.window(taken, 0.0) == (10.0, 5.0)  # b gets the progress at 1.5 and asks again on this call
    short: Batcher[str] = Batcher(workers=3, kept_s=3.0)
    short.keep("progress", 0.0, short.epoch)
    assert short.window(taken, 0.0) == (10.0, 3.0)  # no longer than the progress stays fresh


def test_a_call_carries_the_asking_within_their_wait_up_to_the_workers_the_agent_runs_and_no_exited_one():
    batcher: Batcher[str] = Batcher(workers=3)
    for uid, wait_until in (("a", 5.0), ("b", 0.5), ("c", 5.0)):
        batcher.join(uid, uid.upper(), 0.0, wait_until=wait_until, deadline=10.0)
    batcher.take(3, "first", now=0.0)
    batcher.drop("c")  # its worker exited
    batcher.join("d", "D", 1.0, wait_until=2.5, deadline=7.5)
    batcher.join("e", "E", 1.0, wait_until=2.5, deadline=7.5)
    assert [t.uid for t in batcher.take(3, "second", now=1.0)] == ["d", "e", "a"]  # b's wait is over; c exited
    batcher.join("f", "F", 1.1, wait_until=2.6, deadline=7.6)
    assert [t.uid for t in batcher.take(1, "third", now=1.1)] == ["f"]  # at most one: the news goes first


def test_an_ask_again_shares_its_uids_ticket_so_held_asks_stay_one_per_worker():
    batcher: Batcher[str] = Batcher(workers=1)
    first = batcher.join("a", "A", 0.0, wait_until=1.0, deadline=2.0)
    batcher.take(1, "call", now=0.0)
    again = batcher.join("a", "A", 0.5, wait_until=3.0, deadline=4.0)
    assert again is first and (first.asks, first.wait_until, first.deadline) == (2, 3.0, 4.0)
    assert list(batcher.asking) == ["a"] and not batcher.unsent
    batcher.leave(first)
    batcher.leave(first)
    assert not batcher.asking


def test_an_ask_with_another_secrets_proof_for_a_uid_waiting_or_in_flight_is_refused_and_changes_nothing():
    batcher: Batcher[str] = Batcher(workers=1)
    mine = batcher.join("a", "A", 0.0, wait_until=5.0, deadline=10.0, owner="my proof")
    with pytest.raises(PermissionDenied, match="'a' is another process's"):
        batcher.join("a", "stolen", 0.1, wait_until=5.0, deadline=10.0, owner="their proof")
    assert mine.entry == "A" and mine.asks == 1
    call = batcher.take(1, "call", now=0.2)
    batcher.leave(mine)  # answered, say, from the host's progress: the call in flight still carries a
    with pytest.raises(PermissionDenied):  # it would have been answered with a's answer
        batcher.join("a", "stolen", 0.3, wait_until=5.0, deadline=10.0, owner="their proof")
    assert batcher.join("a", "A", 0.3, wait_until=5.0, deadline=10.0, owner="my proof").owner == "my proof"
    batcher.answered(call, {"a": "a's answer"})
    assert batcher.join("a", "other", 0.4, owner="their proof").uid == "a"  # nothing waits: it goes, and the
    assert list(batcher.unsent) == ["a"]  # coordinator answers it by its proof


# The registrar against a scripted coordinator.


class ScriptedConnection:
    """Stands for the agent's connection: each RegisterHost waits until the test answers it (``answer``)."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[pb.RegisterHostRequest, queue.Queue]] = queue.Queue()

    def call(self, method, request, deadline, *, timeout=None, wait_for_ready=None):
        assert method == "RegisterHost"
        sent, answer = pb.RegisterHostRequest(), queue.Queue()
        sent.CopyFrom(request(deadline - time.monotonic()))
        self.calls.put((sent, answer))
        return answer.get(timeout=30)

    def next(self) -> tuple[list[str], int, queue.Queue]:
        sent, answer = self.calls.get(timeout=10)
        return [p.request.client_uid for p in sent.processes], sent.wait_ms, answer


def progress(count: int, registered: int) -> pb.RegisterHostResponse:
    shared = pb.RegisterResponse(progress=pb.Progress(registered=registered, expected=4))
    return pb.RegisterHostResponse(processes=[pb.HostRegistration(process_id=-1)] * count,
                                   answer=shared.SerializeToString())


def asking(registrar: HostRegistrar, uid: str, wait_s: float, answers: queue.Queue) -> threading.Thread:
    request = pb.RegisterRequest(client_uid=uid, num_processes=4, wait_ms=int(wait_s * 1000))

    def ask() -> None:
        try:
            answers.put((uid, registrar.register(request, "proof-" + uid, time.monotonic() + wait_s + 5)))
        except Refused as e:
            answers.put((uid, e))
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    return thread


def test_the_registrar_answers_a_late_workers_wait_from_the_hosts_progress_and_both_from_one_call():
    connection = ScriptedConnection()
    published: list[tuple] = []
    registrar = HostRegistrar(connection, "agent", workers=2, per_call=2, expected=lambda: 2,  # type: ignore[arg-type]
                              published=lambda *about: published.append(about))
    answers: queue.Queue = queue.Queue()
    asking(registrar, "a", 0.3, answers)
    uids, _, first = connection.next()
    assert uids == ["a"]
    first.put(progress(1, 1))
    assert answers.get(timeout=10)[0] == "a"
    asking(registrar, "a", 5.0, answers)  # a's re-poll: nothing carries it, it goes
    uids, _, a_call = connection.next()
    assert uids == ["a"]
    asking(registrar, "b", 0.3, answers)  # news: it goes at once, and a rides along
    uids, wait_ms, both = connection.next()
    assert uids == ["b", "a"] and wait_ms > 3000, wait_ms  # as long as a's wait: b hears the host's progress
    uid, answer = answers.get(timeout=10)
    assert (uid, answer) == ("b", pb.RegisterResponse(process_id=-1).SerializeToString()
                             + progress(1, 1).answer)
    asking(registrar, "b", 5.0, answers)  # b's re-poll rides on the call in flight: no call of its own
    time.sleep(0.5)
    assert connection.calls.empty()
    topology = pb.RegisterResponse(topology=b"T", generation=1, event_position=7, run=1, attempt=0)
    both.put(pb.RegisterHostResponse(processes=[pb.HostRegistration(code=6, error="ProcessIdTaken",
                                                                    message="b's id is taken"),
                                                pb.HostRegistration(process_id=0)],
                                     answer=topology.SerializeToString()))
    heard = dict(answers.get(timeout=10) for _ in range(2))
    assert heard["a"] == pb.RegisterResponse(process_id=0).SerializeToString() + topology.SerializeToString()
    assert isinstance(heard["b"], Refused) and isinstance(heard["b"].error, ProcessIdTaken)  # its own refusal
    assert published == [(1, 7, 1, 0)] and registrar.registered["a"].process_id == 0 and "b" not in registrar.registered
    a_call.put(progress(1, 1))  # nobody waits on it any more
    assert connection.calls.empty()


def test_workers_that_ask_seconds_apart_cost_their_host_about_one_call_each(start_coordinator, agents):
    hosts, workers = 2, 4
    coordinator = start_coordinator("--metrics-port", "0", num_processes=hosts * workers)
    started = [agents("--nproc-per-host", str(workers), "--host-rank", str(h), "--num-hosts", str(hosts),
                      "--grace-seconds", "1", "--", sys.executable, "-c", STAGGERED,
                      env=loopback_env(coordinator.address, STAGGER_FROM=str(time.time() + 5.0)))
               for h in range(hosts)]

    def held() -> dict[int, str]:
        found = (re.search(r"^\[\d+\] topology process (\d+) fingerprint (\w+)", line) for a in started
                 for line in a.out)
        return {int(m.group(1)): m.group(2) for m in found if m}

    topologies = poll_until(held, lambda f: len(f) == hosts * workers, timeout=WAIT_S,
                            what="every worker's topology\n" + "\n".join(a.output() for a in started))
    assert sorted(topologies) == list(range(hosts * workers)) and len(set(topologies.values())) == 1, topologies
    calls = rpc_calls(coordinator)
    assert calls.get("Register", 0) == 0, calls
    # each worker's first registration is news; its re-polls ride on the host's call in flight
    assert calls["RegisterHost"] <= hosts * (workers + 2), calls


def test_a_lone_replacement_among_running_workers_is_sent_at_once_not_after_the_batch_window():
    connection = ScriptedConnection()
    registrar = HostRegistrar(connection, "agent", workers=2, per_call=2, expected=lambda: 2,  # type: ignore[arg-type]
                              published=lambda *about: None, clock=lambda: 100.0)  # no batch window ever passes
    serials = {rank: registrar.started(rank) for rank in (0, 1)}
    answers: queue.Queue = queue.Queue()

    def ask(uid: str, rank: int) -> None:
        request = pb.RegisterRequest(client_uid=uid, num_processes=2, local_rank=rank, wait_ms=5000)
        threading.Thread(target=lambda: answers.put(registrar.register(request, "proof-" + uid, time.monotonic() + 30)),
                         daemon=True).start()

    ask("a", 0)
    ask("b", 1)
    uids, _, call = connection.next()  # both asked: the host's registrations go together
    topology = pb.RegisterResponse(topology=b"T", generation=1, event_position=2, run=1, attempt=0)
    call.put(pb.RegisterHostResponse(processes=[pb.HostRegistration(process_id=int(u == "b")) for u in uids],
                                     answer=topology.SerializeToString()))
    answers.get(timeout=10), answers.get(timeout=10)
    assert registrar.exited(1, serials[1]) == ("b", "proof-b")
    registrar.started(1)
    ask("c", 1)  # the replacement: the other worker runs, admitted, and asks nothing
    uids, _, call = connection.next()
    assert uids == ["c"]
    shared = topology.SerializeToString()
    call.put(pb.RegisterHostResponse(processes=[pb.HostRegistration(process_id=1)], answer=shared))
    assert answers.get(timeout=10) == pb.RegisterResponse(process_id=1).SerializeToString() + shared
