"""A failover soak: leader kills and SIGSTOPs at random moments while a job's processes call the key-value store, run
start-up exchanges and see one of them killed and restarted (and, through agents, their host's agent killed and
started again); every key's history is checked for linearizability and every job event for delivery to every process
exactly once, in order.

    .venv/bin/python bench/failover_soak.py [--link both] [--failovers 50] [--seed 1] [--keep DIR]

A 3-member etcd (tests/etcd_cluster.py) and ``--replicas`` coordinator replicas on it (fixed loopback ports, so a
killed one comes back where the clients look for it), then the job, each ``--link`` in turn on its own etcd and
replicas: ``direct``, ``--processes`` processes the soak starts (bench/soak_worker.py, direct sessions); ``agent``,
``--hosts`` real ``ifrt run`` agents (``--recover replace``, ``--worker-link agent``) of ``--workers-per-host``
workers each (bench/soak_agents.py). Each process runs ``--threads`` key-value client threads on ``--keys`` keys.
Meanwhile, until ``--failovers`` leader changes happened, at random moments (``--seed``): the leader is SIGKILLed
(then started again) or SIGSTOPped for a while (then SIGCONTed), each by its pid; between them, one turn at a time,
the job runs a start-up exchange in every process (``ifrt.startup``, as ``ifrt.torch`` does), or has its last process
SIGKILLed (started again by the soak, or replaced in place by its agent) and waits until every other process was told
it failed and came back, or, with agents, SIGKILLs the last host's agent, checks that its workers are gone within a
second (/proc) and starts an agent for that host again, which takes its processes back. Prints one JSON object, a
report per mode; exits 1 when a mode missed a goal that is no timing (``Soak.sound``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from soak_agents import AgentJob, exceptions
from soak_history import JOB_EVENTS, delivery, key_values
from soak_processes import DirectJob, Records, Replica, leader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.etcd_cluster import EtcdCluster
from tests.helpers import free_ports


class Soak:
    """The cluster, one mode's job (``direct`` or ``agent``), the faults and what they caused."""

    def __init__(self, args: argparse.Namespace, link: str, etcd: EtcdCluster, tmp: Path) -> None:
        self.args, self.link, self.tmp = args, link, tmp
        self.rng = random.Random(args.seed)
        n = args.hosts * args.workers_per_host if link == "agent" else args.processes
        flags = ("--store", etcd.url, "--leader-ttl", str(args.leader_ttl), "--heartbeat-timeout",
                 str(args.heartbeat_timeout), "--cluster-id", f"soak-{args.seed}-{link}")
        self.replicas = [Replica(p, flags, n, tmp / f"replica{i}.log") for i, p in enumerate(free_ports(args.replicas))]
        self.address = ",".join(r.address for r in self.replicas)
        self.job: DirectJob | AgentJob = (AgentJob if link == "agent" else DirectJob)(args, self.address, tmp)
        self.failovers: list[dict[str, Any]] = []
        self.pauses: list[float] = []  # when SIGSTOPs ended before any other replica led
        self.startups: list[dict[str, Any]] = []
        self.cycles: list[dict[str, Any]] = []  # each kill of a worker (or an agent) and its restart
        self.done = threading.Event()
        self.stopping_at = math.inf
        self.job_errors: list[str] = []

    @property
    def victim(self) -> int:
        """The process killed now and then: the last one (with agents, on the last host)."""
        return self.job.processes - 1

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        if leader(self.replicas, None, 60)[0] is None:
            raise RuntimeError("no replica leads within 60 s")
        self.job.start()

    def faults(self) -> None:
        """Leader kills and SIGSTOPs until ``--failovers`` leader changes happened (or time is up)."""
        deadline = time.monotonic() + self.args.max_seconds
        try:
            while len(self.failovers) < self.args.failovers and time.monotonic() < deadline:
                time.sleep(self.rng.uniform(0.5, self.args.gap))
                self.fault()
        finally:
            self.done.set()

    def fault(self) -> None:
        """One leader kill or SIGSTOP, and the failover it caused, if any."""
        old, _ = leader(self.replicas, None, 30)
        if old is None:
            say("no replica leads: no fault this time")
            return
        kind = self.rng.choice(("kill", "stop"))
        began = time.monotonic()
        if kind == "kill":
            old.signal(signal.SIGKILL)
            new, seen = leader(self.replicas, old, 60)
            old.close()
            try:
                old.start()
            except (RuntimeError, TimeoutError) as e:  # its port taken meanwhile: the others go on without it
                say(f"replica {old.address} did not start again: {str(e)[:300]}")
        else:
            hold = self.rng.uniform(0.5, 2.5 * self.args.leader_ttl)
            old.signal(signal.SIGSTOP)
            try:
                new, seen = leader(self.replicas, old, hold)
                time.sleep(max(0.0, began + hold - time.monotonic()))
            finally:
                old.signal(signal.SIGCONT)
            if new is None:
                # A resumed leader answers SERVING until it notices that its lease ran out meanwhile, then steps
                # down and another takes over: only a leader still serving after the lease's time kept its lead.
                new, seen = leader(self.replicas, old, self.args.leader_ttl + 3)
                if new is None:
                    if old.serving(1.0):
                        self.pauses.append(round(time.monotonic(), 3))
                        return
                    new, seen = leader(self.replicas, None, 30)
        if new is None:
            say(f"no other replica led within {seen - began:.0f} s of the {kind}")
            return
        self.failovers.append({"kind": kind, "seconds": round(seen - began, 3), "at": seen})
        say(f"{self.link}: failover {len(self.failovers)}: {kind}, {seen - began:.2f} s")

    def job_turns(self) -> None:
        """Start-up exchanges, the last process's kill and restart and (with agents) the last host's agent's kill and
        restart, one at a time, until the faults are over and each happened at least once."""
        round_ = 0
        while (not self.done.is_set() or round_ == 0 or not self.kinds_done("worker")
               or (self.link == "agent" and not self.kinds_done("agent"))):
            draw = self.rng.random()
            try:
                if round_ > 0 and not self.kinds_done("worker"):
                    self.kill_worker()
                elif round_ > 0 and self.link == "agent" and not self.kinds_done("agent"):
                    self.kill_agent()
                elif round_ > 0 and draw < self.args.victim_share:
                    self.kill_worker()
                elif round_ > 0 and self.link == "agent" and draw < self.args.victim_share + self.args.agent_share:
                    self.kill_agent()
                else:
                    self.startup(round_)
                    round_ += 1
            except Exception as e:  # reported, and the soak goes on
                self.job_errors.append(f"{type(e).__name__}: {e}"[:500])
                say(f"the job's turn failed: {self.job_errors[-1]}")
                if len(self.job_errors) > 5:
                    return
            self.done.wait(self.rng.uniform(0.2, 1.0))

    def kinds_done(self, kind: str) -> bool:
        return any(c["kind"] == kind for c in self.cycles)

    def startup(self, round_: int) -> None:
        """One start-up exchange in every process; a failed one is checked against what the store held."""
        workers = list(self.job.workers.values())
        began = time.monotonic()
        for w in workers:
            w.send(f"startup {round_} {self.args.startup_timeout}")
        deadline = began + self.args.startup_timeout + 60
        answers = [w.wait(lambda r: r.get("startup") == round_, deadline - time.monotonic()) for w in workers]
        record: dict[str, Any] = {"round": round_, "seconds": round(time.monotonic() - began, 3),
                                  "failed": {w.process_id: (a or {}).get("error", "no answer")
                                             for w, a in zip(workers, answers, strict=True) if not (a or {}).get("ok")}}
        if record["failed"]:
            record["store"] = (self.job.workers[0].ask("inspect", "store", 60) or {}).get("store")
        self.startups.append(record)
        say(f"{self.link}: start-up {round_}: {'failed ' + str(record['failed']) if record['failed'] else 'done'} "
            f"in {record['seconds']} s")

    def kill_worker(self) -> None:
        """SIGKILLs the last process, waits until every other process was told it failed, then for its replacement
        (started by the soak, or by its agent in place), and until the others are told it came back."""
        began = time.monotonic()
        self.job.workers[self.victim].kill()
        others = [w for p, w in self.job.workers.items() if p != self.victim]
        failed = told(others, "ProcessFailed", [self.victim], began)
        back = [self.victim] if self.job.replacement(self.victim, 120) is not None else []
        self.record("worker", [self.victim], began, failed, back, told(others, "ProcessRestarted", back, began))

    def kill_agent(self) -> None:
        """SIGKILLs the last host's agent and watches its workers go (bench/soak_agents.py: each must be gone within
        a second), waits until every other process was told they failed, starts an agent for that host again (it
        takes its processes back: docs/failures.md, "A lost host") and waits until the others are told they came
        back."""
        assert isinstance(self.job, AgentJob)
        host = self.args.hosts - 1
        ids = self.job.ids_of(host)
        outcome = self.job.agents[host].kill()
        began = outcome.pop("killed_at")
        others = [w for p, w in self.job.workers.items() if p not in ids]
        failed = told(others, "ProcessFailed", ids, began)
        self.job.start_agent(host)
        back = [p for p in ids if self.job.replacement(p, 180) is not None]
        self.record("agent", ids, began, failed, back, told(others, "ProcessRestarted", back, began), outcome)

    def record(self, kind: str, ids: list[int], began: float, failed: list[float | None], back: list[int],
               restarted: list[float | None], extra: dict[str, Any] | None = None) -> None:
        """One kill cycle: who was killed and came back, and when every other process was told, against the bound."""
        cycle: dict[str, Any] = {"kind": kind, "ids": ids, "killed_at": round(began, 3), "restarted": back,
                                 "restarted_told_all": None not in restarted, "failed_told_all_s": None,
                                 "past_bound_s": None, **(extra or {})}
        if None not in failed:
            told_all = max(failed)  # type: ignore[type-var]
            # Liveness is not journaled: after a takeover every process has the heartbeat timeout to come back.
            clock = max([began, *(f["at"] for f in self.failovers if f["at"] < told_all)])
            cycle.update(failed_told_all_s=round(told_all - began, 3),
                         past_bound_s=round(told_all - clock - self.args.heartbeat_timeout, 3))
        self.cycles.append(cycle)
        say(f"{self.link}: {kind} of {ids} killed and started again: {cycle}")

    def observers(self) -> dict[int, Records]:
        """The processes never killed, each its one incarnation."""
        started = self.job.started_per_process()
        return {p: w for p, w in self.job.workers.items() if started[p] == 1}

    def settle(self, timeout: float = 15.0) -> None:
        """Waits until every observer holds as many job events as the others (an event sent a moment ago may not
        have reached all yet), at most ``timeout`` seconds; whatever still differs then is reported."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len({sum(e["event"] in JOB_EVENTS for e in w.events()) for w in self.observers().values()}) <= 1:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self.settle()
        self.stopping_at = time.monotonic()  # from now on processes leave: ProcessLeft is no fault's doing
        self.job.stop(self.args.op_timeout + 30)
        for r in self.replicas:
            r.close()

    def report(self) -> dict[str, Any]:
        seconds = [f["seconds"] for f in self.failovers]
        before_stop = lambda w: [e for e in w.events() if e["t"] < self.stopping_at]  # noqa: E731
        observers = self.observers()
        expected = {p: (sum(p in c["ids"] for c in self.cycles), sum(p in c["restarted"] for c in self.cycles))
                    for p in {p for c in self.cycles for p in c["ids"]}}
        partial = {f"{w.process_id}/{w.pid}": before_stop(w) for w in self.job.incarnations
                   if w.process_id not in observers}
        failed_startups = [s for s in self.startups if s["failed"]]
        bounded = [c for c in self.cycles if c["past_bound_s"] is not None]
        agents = [c for c in self.cycles if c["kind"] == "agent"]
        started = self.job.started_per_process()
        return {
            "link": self.link, "processes": self.job.processes,
            **({"hosts": self.args.hosts, "workers_per_host": self.args.workers_per_host,
                "hostnames": "own" if self.args.own_hostnames else "shared"} if self.link == "agent" else {}),
            "failovers": len(self.failovers), "by_kill": sum(f["kind"] == "kill" for f in self.failovers),
            "by_stop": sum(f["kind"] == "stop" for f in self.failovers), "stops_without_failover": len(self.pauses),
            "failover_s_p50": round(statistics.median(seconds), 3) if seconds else None,
            "failover_s_max": max(seconds, default=None),
            "key_values": key_values(self.job.ops_files(), self.args.check_budget),
            "events": delivery({p: before_stop(w) for p, w in observers.items()}, expected, partial),
            "worker_kills": sum(c["kind"] == "worker" for c in self.cycles), "agent_kills": len(agents),
            "replacements_started_more_than_once": sum(max(0, started[p] - 1 - expected.get(p, (0, 0))[0])
                                                       for p in started),
            "workers_outliving_their_agent_past_1s": sum(c["outlived_s"] for c in agents),
            "agent_kill_to_workers_gone_s_max": max((c["gone_s_max"] or 0 for c in agents), default=None),
            "failures_declared": len(bounded), "failures_declared_within_bound": sum(c["past_bound_s"] <= 0
                                                                                      for c in bounded),
            "failures_not_told": len(self.cycles) - len(bounded),
            "failed_told_all_s_max": max((c["failed_told_all_s"] for c in bounded), default=None),
            "failed_past_bound_s_max": max((c["past_bound_s"] for c in bounded), default=None),
            "restarts_not_told": sum(not c["restarted_told_all"] or len(c["restarted"]) < len(c["ids"])
                                     for c in self.cycles),
            "startups": len(self.startups), "startups_failed": len(failed_startups),
            "startups_failed_while_store_held_every_answer": sum(held_everything(s) for s in failed_startups),
            "log_exceptions": exceptions(sorted(self.tmp.glob("agent-*.log")) + sorted(self.tmp.glob("replica*.log"))),
            "job_errors": self.job_errors,
            "startup_errors": sorted({e.split(":")[0] for s in failed_startups for e in s["failed"].values()}),
        }

    def sound(self, report: dict[str, Any]) -> bool:
        """Whether the mode met every goal that is no timing: linearizable keys, every event once and in order at
        every process never killed (at least one), no process failed but those the soak killed, no replacement
        registered twice, no worker outliving its agent, no start-up failed while the store held its every answer,
        no traceback in an agent's or a replica's log."""
        kv, events = report["key_values"], report["events"]
        return (kv["linearizable_keys"] == kv["keys"] and not (events["lost"] or events["duplicated"]
                                                               or events["reordered_at"])
                and events["observers"] > 0 and not events["others_declared_failed_or_left"]
                and not events["killed_incarnations_out_of_order"] and events["failed_events_match_kills"]
                and events["restarted_events_match_restarts"] and events["alternate"]
                and not events["replacements_registered_more_than_once"]
                and not report["replacements_started_more_than_once"]
                and not report["workers_outliving_their_agent_past_1s"]
                and not report["startups_failed_while_store_held_every_answer"] and not report["log_exceptions"])


def told(others: list[Records], kind: str, ids: list[int], began: float) -> list[float | None]:
    """When each of ``others`` had received a ``kind`` event since ``began`` about every one of ``ids`` (None: not
    within 120 s)."""
    if not ids:
        return []
    deadline = time.monotonic() + 120
    times: list[float | None] = []
    for w in others:
        hits = [w.wait(lambda r, p=p: r.get("event") == kind and r.get("process_id") == p and r["t"] >= began,
                       deadline - time.monotonic()) for p in ids]
        times.append(None if None in hits else max(h["t"] for h in hits))  # type: ignore[index]
    return times


def say(line: str) -> None:
    """A progress line on stderr."""
    print(f"[soak {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def held_everything(startup: dict[str, Any]) -> bool:
    """Whether the store held the whole exchange of a failed start-up: its start record, every answer, ready."""
    store = startup.get("store") or {}
    return bool(store.get("start") and store.get("joined") == store.get("followers") and store.get("ready"))


def run_mode(args: argparse.Namespace, link: str, tmp: Path) -> dict[str, Any]:
    """One mode's soak on its own etcd and replicas: its report, and whether it met its goals (``sound``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    with EtcdCluster.start(3, tmp_path=tmp) as etcd:
        soak = Soak(args, link, etcd, tmp)
        try:
            soak.start()
            job = threading.Thread(target=soak.job_turns, daemon=True)
            job.start()
            soak.faults()
            job.join(args.startup_timeout + 240)
        finally:
            stop_whole(soak)
        report = soak.report()
        report["sound"] = soak.sound(report)
        if args.keep:
            (tmp / "soak.json").write_text(json.dumps({
                "report": report, "failovers": soak.failovers, "pauses": soak.pauses, "cycles": soak.cycles,
                "startups": soak.startups,
                "events": {f"{w.process_id}/{w.pid}": w.events() for w in soak.job.incarnations}}, indent=1))
    return report


def stop_whole(soak: Soak) -> None:
    """Stops everything the soak started; a SIGTERM meanwhile waits until it is done (then ends the soak)."""
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _: terminated.append(signum))
    try:
        soak.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        sys.exit(143)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", choices=("direct", "agent", "both"), default="both",
                   help="the job's processes on their own sessions, under ifrt run agents, or both, one after the "
                        "other (default %(default)s)")
    p.add_argument("--failovers", type=int, default=6, help="leader changes to cause, per mode (default %(default)s)")
    p.add_argument("--processes", type=int, default=4, help="processes of the direct job (default %(default)s)")
    p.add_argument("--hosts", type=int, default=3, help="agents of the agent job (default %(default)s)")
    p.add_argument("--workers-per-host", type=int, default=2, help="workers per agent (default %(default)s)")
    p.add_argument("--replicas", type=int, default=3, help="coordinator replicas (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="key-value threads per process (default %(default)s)")
    p.add_argument("--keys", type=int, default=3, help="keys they call on (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--leader-ttl", type=int, default=2, help="the replicas' --leader-ttl (default %(default)s)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="theirs (default %(default)s)")
    p.add_argument("--op-timeout", type=float, default=20.0, help="each key-value call's (default %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=30.0, help="each start-up's (default %(default)s)")
    p.add_argument("--gap", type=float, default=6.0,
                   help="longest pause between a failover and the next fault (default %(default)s)")
    p.add_argument("--victim-share", type=float, default=0.3,
                   help="share of the job's turns that kill and restart its last process (default %(default)s)")
    p.add_argument("--agent-share", type=float, default=0.15,
                   help="with agents: share of the turns that kill the last host's agent (default %(default)s)")
    p.add_argument("--own-hostnames", action="store_true",
                   help="with agents: each agent and its workers in a UTS namespace with a hostname of their own "
                        "(needs root and util-linux's unshare); by default they share this machine's")
    p.add_argument("--max-restarts", type=int, default=10_000,
                   help="the agents' --max-restarts: every replacement spends one (default %(default)s)")
    p.add_argument("--max-seconds", type=float, default=1800.0,
                   help="the faults stop by then, per mode (default %(default)s)")
    p.add_argument("--check-budget", type=int, default=5_000_000, help="search steps per key (default %(default)s)")
    p.add_argument("--keep", type=Path, help="keep the records and logs in this directory")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally clauses stop every child
    links = ("direct", "agent") if args.link == "both" else (args.link,)
    modes: dict[str, Any] = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ifrt-soak-") as scratch:
        tmp = args.keep or Path(scratch)
        for link in links:
            modes[link] = run_mode(args, link, tmp / link)
            say(f"{link}: {json.dumps(modes[link])}")
    print(json.dumps({"measure": "failover_soak", "seed": args.seed, "replicas": args.replicas, "etcd_members": 3,
                      "leader_ttl_s": args.leader_ttl, "heartbeat_timeout_s": args.heartbeat_timeout,
                      "seconds": round(time.monotonic() - began, 1), "modes": modes}), flush=True)
    return 0 if all(m["sound"] for m in modes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
