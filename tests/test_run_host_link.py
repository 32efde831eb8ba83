"""``ifrt run --worker-link agent`` against a real coordinator: agents on loopback as two hosts of two workers, each
worker reaching its agent over the agent's Unix socket, the agent the coordinator with one registration call and one
session per host."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

from tests.helpers import poll_until, rpc_calls
from tests.replicas import Replicas
from tests.run_agents import WAIT_S, RunAgent, loopback_env

WORKER = Path(__file__).with_name("host_link_worker.py")


def agent(agents, address: str, host_rank: int | None, scenario: str, *flags: str, window: str = "10") -> RunAgent:
    """An agent of two tests/host_link_worker.py workers (as host ``host_rank`` of two; ``window``: the workers'
    failover window)."""
    ranks = () if host_rank is None else ("--host-rank", str(host_rank), "--num-hosts", "2")
    env = {**loopback_env(address), "IFRT_FAILOVER_WINDOW": window}
    return agents("--nproc-per-host", "2", *ranks, "--grace-seconds", "1", *flags, "--", sys.executable,
                  str(WORKER), scenario, env=env)


def started(a: RunAgent, count: int = 2) -> dict[int, re.Match]:
    """Each worker's ``started`` line, by process id, once all ``count`` came."""
    def lines() -> dict[int, re.Match]:
        found = (re.search(r"started process (\d+) pid (\d+) fingerprint (\w+) via (\w+)", line) for line in a.out)
        return {int(m.group(1)): m for m in found if m}
    return poll_until(lines, lambda f: len(f) == count, timeout=WAIT_S, what=f"{count} workers started\n{a.output()}")


def heard(a: RunAgent, pid: int) -> list[re.Match]:
    """Each worker's line saying it heard process ``pid`` failed."""
    found = (re.search(rf"^\[(\d+)\] heard process {pid} failed at ([\d.]+): (.*)", line) for line in a.out)
    return [m for m in found if m]


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_workers_through_agents_discover_the_bytes_direct_workers_do_on_one_call_per_host(start_coordinator,
                                                                                          agents):
    jobs = [("agent", "agent"), ("agent", "direct")]  # the second: a mixed job; both at once
    coordinators = [start_coordinator("--metrics-port", "0", num_processes=4) for _ in jobs]
    runs = [[agent(agents, c.address, h, "listen", "--worker-link", link) for h, link in enumerate(links)]
            for c, links in zip(coordinators, jobs, strict=True)]
    fingerprints = []
    for coordinator, links, both in zip(coordinators, jobs, runs, strict=True):
        lines = [started(a) for a in both]
        assert [{m.group(4) for m in found.values()} for found in lines] == [{link} for link in links]
        fingerprints.append({pid: m.group(3) for found in lines for pid, m in found.items()})
        for a in both:
            a.stop()
        calls = rpc_calls(coordinator)  # streams are counted once they ended
        if links == ("agent", "agent"):  # no worker registered or held a session on its own
            assert calls.get("Register", 0) == 0 and calls.get("Session", 0) == 0, calls
            assert calls.get("RegisterHost", 0) >= 2 and calls.get("HostSession", 0) >= 2, calls
            assert calls.get("Status", 0) <= 2, calls  # an agent reads its workers' ids off RegisterHost's answers
        else:
            assert calls.get("Register", 0) >= 2 and calls.get("Session", 0) >= 2, calls
            assert calls.get("RegisterHost", 0) >= 1 and calls.get("HostSession", 0) >= 1, calls
    assert sorted(fingerprints[0]) == [0, 1, 2, 3]
    assert fingerprints[0] == fingerprints[1] and len(set(fingerprints[0].values())) == 1


def test_a_killed_worker_is_heard_by_every_other_through_its_agent_within_a_second(start_coordinator, agents):
    # a heartbeat timeout whose reconnect grace alone (1/8 of it) is longer than the second: only the agent's
    # waitpid can report the death in time
    coordinator = start_coordinator("--heartbeat-timeout", "10", num_processes=4, log_level="WARNING")
    both = [agent(agents, coordinator.address, h, "listen", "--recover", "replace", "--max-restarts", "1")
            for h in range(2)]
    lines = [started(a) for a in both]
    victim = int(lines[1][3].group(2))
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    for a, others in ((both[0], 2), (both[1], 1)):
        found = poll_until(lambda a=a: heard(a, 3), lambda f, n=others: len(f) >= n, timeout=10,
                           what=f"the other workers heard of process 3\n{a.output()}")
        for m in found:
            assert float(m.group(2)) - killed_at < 1.0, (m.group(0), killed_at)
            assert "killed by SIGKILL" in m.group(3), m.group(0)


def test_a_killed_agent_ends_its_workers_and_the_others_hear_of_them(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=4, log_level="WARNING")
    # the survivors' agent waits for the lost host (replace) rather than stopping its workers at once
    both = [agent(agents, coordinator.address, h, scenario, "--recover", "replace", window="2")
            for h, scenario in enumerate(("listen", "failfast"))]
    lines = [started(a) for a in both]
    orphans = [int(m.group(2)) for m in lines[1].values()]
    os.kill(both[1].process.pid, signal.SIGKILL)
    poll_until(lambda: all(gone(pid) for pid in orphans), timeout=15,
               what=f"the killed agent's workers {orphans} ended (fail fast)")
    poll_until(lambda: {(m.group(1), pid) for pid in (2, 3) for m in heard(both[0], pid)}, lambda f: len(f) == 4,
               timeout=15, what=f"each surviving worker heard of both lost processes\n{both[0].output()}")


def test_each_worker_watching_a_key_through_its_agent_hears_its_change(start_coordinator, agents):
    coordinator = start_coordinator(num_processes=4, log_level="WARNING")
    both = [agent(agents, coordinator.address, h, "watch") for h in range(2)]
    for a in both:
        poll_until(lambda a=a: [line for line in a.out if line.endswith("changed k/go = b'1'")],
                   lambda found: len(found) == 2, timeout=WAIT_S, what=f"both workers heard k/go\n{a.output()}")


def test_a_worker_hung_with_its_connection_up_is_reported_by_its_agent(start_coordinator, agents):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")  # hung: 3 s
    a = agent(agents, coordinator.address, None, "hang", "--recover", "replace", "--max-restarts", "1")
    lines = started(a)
    a.wait_line(r"holding the GIL")
    began = time.monotonic()
    hung = next(pid for pid in lines if f"[{pid}] holding the GIL" in a.out)
    survivor = 1 - hung
    [found] = poll_until(lambda: [m for m in heard(a, hung) if m.group(1) == str(survivor)], timeout=30,
                         what=f"process {survivor} heard process {hung} hung\n{a.output()}")
    assert re.fullmatch(r"stopped answering: no heartbeat for [\d.]+s while its connection to its agent stayed up",
                        found.group(3)), found.group(0)
    assert time.monotonic() - began < 3 + 5  # the hung timeouts, and a loaded machine's slack


def test_a_worker_past_the_limits_is_refused_naming_it_and_its_host_mate_goes_on(start_coordinator, agents):
    coordinator = start_coordinator("--max-devices-per-process", "1", num_processes=2, log_level="WARNING")
    a = agent(agents, coordinator.address, None, "greedy")
    refused = a.wait_line(r"^\[local 1\] refused: (\w+): (.*)")
    assert refused.group(1) == "InvalidArgument" and "--max-devices-per-process" in refused.group(2), refused.group(0)
    lines = started(a)  # its host mate's registration stood: the job completes once local rank 1 lists 1 device
    assert sorted(lines) == [0, 1] and len({m.group(3) for m in lines.values()}) == 1
    assert not any("refused" in line for line in a.out if line.startswith("[0]")), a.output()


def test_a_failover_is_no_break_for_the_workers_and_a_later_failure_comes_once(etcd, agents):
    with Replicas(etcd, num_processes=4) as replicas:
        both = [agent(agents, replicas.addresses, h, "listen", "--recover", "replace", "--max-restarts", "1")
                for h in range(2)]
        lines = [started(a) for a in both]
        replicas.kill_leader()  # returns once the standby serves: the host sessions move to it
        os.kill(int(lines[1][3].group(2)), signal.SIGKILL)
        poll_until(lambda: [line for line in both[1].out if line.startswith("[3] started process 3 ")],
                   lambda found: len(found) == 2, timeout=WAIT_S, what=f"process 3 replaced\n{both[1].output()}")
        for a, others in ((both[0], ["0", "1"]), (both[1], ["2"])):
            count = len(others)
            found = poll_until(lambda a=a: heard(a, 3), lambda f, n=count: len(f) >= n, timeout=WAIT_S,
                               what=f"the other workers heard of process 3\n{a.output()}")
            assert sorted(m.group(1) for m in found) == others, a.output()  # each once
        for a in both:
            assert not any("lost the coordinator" in line for line in a.out), a.output()


def test_an_agent_learns_its_workers_ids_from_its_hosts_registration_not_by_polling(start_coordinator, agents):
    coordinator = start_coordinator("--metrics-port", "0", num_processes=2)
    a = agent(agents, coordinator.address, None, "listen")  # ids assigned by the coordinator
    assert sorted(started(a)) == [0, 1]
    a.stop()
    assert rpc_calls(coordinator).get("Status", 0) <= 1  # its heartbeat timeout, read once; no id polling
