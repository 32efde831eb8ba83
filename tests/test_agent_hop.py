"""At least once across the agent hop: what a worker would see on a direct session it sees through its ``ifrt run``
agent, and what the agent reports of its workers reaches the coordinator, across a reconnect of the host's session,
a leader failover and a new run. Real coordinators (replicas on etcd for the failovers), real agents, real workers."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest

from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import ERROR_TRAILER
from ifrt.protocol import proof_of
from ifrt.run.host_rules import Exits, Silence, Watches, batch_window
from tests.helpers import poll_until
from tests.replicas import Replicas
from tests.run_agents import WAIT_S, RunAgent, loopback_env
from tests.wire_agent import HostAgent

HOP_WORKER = Path(__file__).with_name("agent_hop_worker.py")
LINK_WORKER = Path(__file__).with_name("host_link_worker.py")


def agent(agents, address: str, worker: Path, scenario: str, *flags: str, nproc: int = 2,
          host_rank: int | None = None, **env: str) -> RunAgent:
    ranks = () if host_rank is None else ("--host-rank", str(host_rank), "--num-hosts", "2")
    return agents("--nproc-per-host", str(nproc), *ranks, "--grace-seconds", "1", *flags, "--", sys.executable,
                  str(worker), scenario, env=loopback_env(address, **env))


def started(a: RunAgent, count: int, start: int = 0) -> dict[int, int]:
    """Each worker's pid by process id, once ``count`` workers printed their start from line ``start`` on."""
    def found() -> dict[int, int]:
        lines = (re.search(r"started process (\d+) (?:attempt \d+ )?pid (\d+)", line) for line in a.out[start:])
        return {int(m.group(1)): int(m.group(2)) for m in lines if m}
    return poll_until(found, lambda f: len(f) == count, timeout=WAIT_S, what=f"{count} workers started\n{a.output()}")


def heard(a: RunAgent, pid: int) -> list[re.Match]:
    """Each worker's line saying it heard process ``pid`` failed: (the worker's id, the reason)."""
    found = (re.search(rf"^\[(\d+)\] heard process {pid} failed(?: at [\d.]+)?: (.*)", line) for line in a.out)
    return [m for m in found if m]


class WireHost(HostAgent):
    """An agent over a raw channel whose two workers (``host-0``, ``host-1`` on 127.0.0.1) are registered in one call
    and carried on its host session; the session's events arrive in ``events``."""

    def __init__(self, address: str) -> None:
        super().__init__(address, "host", workers=2)

    def carry(self) -> None:
        """Registers both workers, opens the host session and attaches them (each attach answered)."""
        answer = self.register(self.request(0), self.request(1))
        self.open(pb.RegisterResponse.FromString(answer.answer).event_position)
        assert self.next("attached").attached.client_uid == ""
        for rank in (0, 1):
            self.attach(rank)
            assert self.next("attached").attached.client_uid == f"host-{rank}"

    def kinds(self) -> list[str]:
        """The kinds of the events received and not read yet."""
        return [event.WhichOneof("kind") for event in self.drained()]


@pytest.fixture
def wire_host(start_coordinator):
    """A WireHost of a 2-process job whose coordinator watches at most one prefix per session, carrying both."""
    coordinator = start_coordinator("--max-watches-per-session", "1", num_processes=2)
    with WireHost(coordinator.address) as host:
        host.join()
        host.carry()
        yield host


# A key written while the host's session reconnects.

def test_a_key_written_while_the_hosts_session_reconnects_reaches_the_worker(etcd, agents, tmp_path):
    trigger = tmp_path / "set-now"
    with Replicas(etcd, num_processes=2, heartbeat="10") as replicas:  # long keepalives: a stopped agent is slow
        both = [agent(agents, replicas.addresses, HOP_WORKER, "pushed", nproc=1, host_rank=h,
                      HOP_TRIGGER=str(trigger)) for h in range(2)]
        for a in both:
            a.wait_line(r"view ready")
        slow = both[0].process.pid
        os.kill(slow, signal.SIGSTOP)  # process 0's agent re-opens its host session only after the key is written
        try:
            replicas.kill_leader()
            trigger.touch()
            both[1].wait_line(r"^\[1\] set hop/1")
        finally:
            os.kill(slow, signal.SIGCONT)
        got = both[0].wait_line(r"^\[0\] got hop/1 via (\w+)", timeout=20)
        assert got.group(1) == "coordinator", both[0].output()  # its view ended with the lapse: it asked instead


# What the agent reports is sent again until the coordinator holds it.

def reported_then_failed_over(replicas: Replicas, a: RunAgent, report: str) -> None:
    """The leader stops (a write to it is taken by its socket, never read), the agent's report ``report`` (a line of
    its log) goes out to it, then the leader is killed and a standby serves."""
    os.kill(replicas.leader.process.pid, signal.SIGSTOP)
    poll_until(lambda: [line for line in a.err if re.search(report, line)], timeout=30,
               what=f"the agent's report {report!r}\n{a.output()}")
    time.sleep(0.3)  # written to the stopped leader's socket
    replicas.kill_leader()


def test_a_hung_worker_reported_just_before_a_failover_is_failed_within_its_bound(etcd, agents):
    with Replicas(etcd, "--hung-timeouts", "2", num_processes=2, heartbeat="3") as replicas:  # hung after 6 s
        a = agent(agents, replicas.addresses, LINK_WORKER, "hang", "--recover", "replace", "--max-restarts", "1")
        ids = started(a, 2)
        a.wait_line(r"holding the GIL")
        began = time.monotonic()
        hung = next(pid for pid in ids if f"[{pid}] holding the GIL" in a.out)
        time.sleep(4.5)  # the report comes at 6 s: the leader stops just before
        reported_then_failed_over(replicas, a, r"stopped answering.*: reporting it")
        [found] = poll_until(lambda: [m for m in heard(a, hung) if m.group(1) == str(1 - hung)],
                             timeout=30, what=f"the other worker heard process {hung} hung\n{a.output()}")
        assert found.group(2).startswith("stopped answering"), found.group(0)
        assert time.monotonic() - began < 6 + 12  # its limit, a failover (lease, takeover) and a loaded machine


def test_the_coordinator_acknowledges_each_exit_once_durable_and_a_repeat_changes_nothing(wire_host):
    report = pb.WorkerExit(client_uid="host-1", proof=proof_of(wire_host.secrets[1]), reason="exited with 3")
    wire_host.send(exited=report)
    assert wire_host.next("process_failed").process_failed.process_id == 1
    assert wire_host.next("exit_noted").exit_noted.client_uid == "host-1"
    wire_host.send(exited=report)  # sent again on a new stream, as an agent does until it is acknowledged
    assert wire_host.next("exit_noted").exit_noted.client_uid == "host-1"
    time.sleep(0.5)
    assert "process_failed" not in wire_host.kinds()  # failed once


def test_a_host_session_opened_for_another_run_or_attempt_is_refused_as_stale(wire_host):
    for stale in ({"run": 2}, {"attempt": 1}):  # the job is in run 1 of attempt 0
        opening = pb.HostSessionRequest(open=pb.HostSessionOpen(agent_uid=wire_host.uid, since_event=1, **stale))
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(wire_host.coordinator.HostSession(iter([opening]), metadata=wire_host.metadata, timeout=10)))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(refused.value.trailing_metadata())[ERROR_TRAILER] == "StaleSession"
    current = pb.HostSessionRequest(open=pb.HostSessionOpen(agent_uid=wire_host.uid, since_event=1, run=1))
    call = wire_host.coordinator.HostSession(iter([current]), metadata=wire_host.metadata, timeout=10)
    assert next(iter(call)).attached.run == 1
    call.cancel()


# A new run.

def test_both_workers_of_a_host_failing_at_once_under_recover_replace_register_once(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", "2", num_processes=2, log_level="INFO")
    a = agent(agents, coordinator.address, LINK_WORKER, "listen", "--recover", "replace", "--max-restarts", "4")
    first = started(a, 2)
    mark = len(a.out)
    for pid in first.values():  # both at once: no process of run 1 lives, the replacements start run 2
        os.kill(pid, signal.SIGKILL)
    second = started(a, 2, start=mark)
    coordinator.wait_for_log("run 2 starts")
    os.kill(second[1], signal.SIGKILL)  # the host's session of run 2 carries the survivor's events
    poll_until(lambda: [m for m in heard(a, 1) if m.group(1) == "0" and a.out.index(m.string) >= mark],
               timeout=30, what=f"process 0 of run 2 heard of process 1\n{a.output()}")
    assert not [line for line in a.err if "its workers register again" in line], a.output()  # none was told to
    assert "opened from job event" not in coordinator.log
    assert [line for line in a.err if "opens again" in line], a.output()  # for run 2, not run 1's stream carried on


# Busy, not hung.

@pytest.mark.serial  # judges the worker's CPU progress: other tests' load would starve it
def test_a_silent_worker_burning_cpu_is_busy_not_hung(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")  # hung: 3 s
    a = agent(agents, coordinator.address, HOP_WORKER, "busy", "--recover", "replace", "--max-restarts", "1")
    ids = started(a, 2)
    a.wait_line(r"^\[\d\] busy")
    busy = next(pid for pid in ids if f"[{pid}] busy" in a.out)
    poll_until(lambda: [line for line in a.err if "busy" in line and "not hung" in line], timeout=15,
               what=f"the agent said its worker is busy\n{a.output()}")
    time.sleep(3)
    assert not heard(a, busy), a.output()


# The pure rules.

def test_a_prefix_nobody_watches_any_more_is_dropped_and_its_watchers_told_of_a_lapse():
    watches = Watches()
    assert watches.add("a", "job/") and not watches.add("b", "job/") and watches.add("a", "x/")
    assert watches.acknowledge("job/") == {"a", "b"}
    assert watches.drop(["a"]) == ["x/"]  # job/ is still b's
    assert watches.lapse() == {"job/": {"b"}}  # the host's session broke: b's watch lapsed, x/ was never acked
    assert not watches.watching("b", "job/") and watches.prefixes() == ["job/"]
    assert watches.acknowledge("job/") == {"b"} and watches.drop(["b"]) == ["job/"] and watches.prefixes() == []


def test_an_acknowledgement_counts_only_once_every_watch_asked_for_is_answered():
    watches = Watches()
    watches.add("a", "p/")  # asked once
    assert watches.drop(["a"]) == ["p/"]  # dropped before its answer came
    assert watches.add("b", "p/")  # asked again
    assert watches.acknowledge("p/") == set()  # the first ask's answer: the coordinator may not watch it yet
    assert watches.acknowledge("p/") == {"b"} and watches.watching("b", "p/")


def test_a_silent_worker_whose_cpu_time_advances_is_busy_and_one_whose_does_not_is_hung():
    silence = Silence()
    cpu = {"busy": 0.0, "stuck": 5.0}  # CPU seconds
    for uid in cpu:
        silence.start(uid, now=0.0, hung_after_s=4.0)
    assert silence.check(1.9, cpu.get) == ([], [])
    assert silence.check(2.0, cpu.get) == ([], [])  # halfway: its cpu time is read
    cpu["busy"] = 1.5
    hung, busy = silence.check(4.0, cpu.get)
    assert [uid for uid, _ in hung] == ["stuck"] and busy == [("busy", 1.5)]
    assert silence.check(5.9, cpu.get) == ([], [])  # busy: watched afresh from 4.0
    cpu["busy"] = 3.0
    assert silence.check(8.0, cpu.get) == ([], [("busy", 1.5)])
    silence.start("unseen", now=0.0, hung_after_s=1.0)
    assert [uid for uid, _ in silence.silent(9.0)] == ["unseen"]  # no cpu time: hung


def test_a_report_is_kept_until_acknowledged_and_sent_again_on_every_new_stream():
    exits: Exits[str] = Exits(most=2)
    assert exits.add("a", "exited with 1")
    assert not exits.add("a", "killed by SIGKILL")  # the first report stands
    exits.add("b", "stopped answering")
    assert exits.pending() == ["exited with 1", "stopped answering"]
    assert exits.pending() == exits.pending()  # sent again on the next stream, as often as it breaks
    exits.acknowledged("a")
    assert exits.pending() == ["stopped answering"] and "b" in exits and "a" not in exits
    exits.add("c", "exited with 2")
    exits.add("d", "exited with 3")  # bounded: the oldest goes
    assert exits.pending() == ["exited with 2", "exited with 3"]


def test_a_batch_runs_until_its_latest_deadline_and_answers_by_its_shortest_wait():
    assert batch_window([(10.0, 5000), (3.0, 800), (7.0, 2000)]) == (10.0, 800)


# Watches nobody needs are dropped.

def test_a_prefix_no_worker_watches_any_more_is_dropped_from_the_hosts_session(start_coordinator, agents):
    coordinator = start_coordinator("--max-watches-per-session", "2", num_processes=2, log_level="WARNING")
    a = agent(agents, coordinator.address, HOP_WORKER, "own", "--recover", "replace", "--max-restarts", "2")
    for count in (2, 3, 4):  # each incarnation of process 0 watches a prefix of its own, process 1 one throughout
        poll_until(lambda: [line for line in a.out if line.endswith("] watching own")],
                   lambda found, n=count: len(found) >= n, timeout=25, what=f"{count} watches\n{a.output()}")
        if count < 4:
            pids = [int(m.group(1)) for line in a.out if (m := re.search(r"^\[0\] started process 0 pid (\d+)",
                                                                         line))]
            os.kill(pids[-1], signal.SIGKILL)


def test_a_host_session_that_drops_a_prefix_frees_its_watch(wire_host):
    wire_host.send(watch=pb.WatchKeys(prefix="a/"))
    assert wire_host.next("watching").watching.prefix == "a/"
    wire_host.send(watch=pb.WatchKeys(prefix="b/"))  # one more than it may: not watched
    wire_host.send(unwatch=pb.WatchKeys(prefix="a/"))
    wire_host.send(watch=pb.WatchKeys(prefix="b/"))
    assert wire_host.next("watching").watching.prefix == "b/"


def test_a_host_session_that_opens_again_asks_each_watched_prefix_once():
    watches = Watches()
    watches.add("w0", "start/join/")
    watches.add("w1", "start/join/")
    assert watches.reopened() == ["start/join/"]  # a new stream after a failover
    assert watches.acknowledge("start/join/") == {"w0", "w1"}  # answered once: both workers hear it
