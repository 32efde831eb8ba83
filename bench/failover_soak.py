"""A failover soak: leader kills and SIGSTOPs at random moments while a job's processes call the key-value store, run
start-up exchanges and see one of them killed and restarted; every key's history is checked for linearizability and
every job event for delivery to every process exactly once, in order.

    .venv/bin/python bench/failover_soak.py [--failovers 50] [--processes 4] [--replicas 3] [--seed 1]

A 3-member etcd (tests/etcd_cluster.py) and ``--replicas`` coordinator replicas on it (fixed loopback ports, so a
killed one comes back where the clients look for it); ``--processes`` processes (bench/soak_worker.py, direct
sessions), each with ``--threads`` key-value client threads on ``--keys`` keys. Meanwhile, until ``--failovers``
leader changes happened, at random moments (``--seed``): the leader is SIGKILLed (then started again) or SIGSTOPped
for a while (then SIGCONTed), each by its pid; between them the job either runs a start-up exchange in every process
(``ifrt.startup``, as ``ifrt.torch`` does) or has its last process SIGKILLed and started again once every other
process was told it failed. Prints one JSON object; exits 1 when a history is not linearizable or an event was
lost, repeated or reordered.
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

from soak_history import JOB_EVENTS, delivery, key_values
from soak_processes import Replica, Worker, leader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.etcd_cluster import EtcdCluster
from tests.helpers import free_ports


class Soak:
    """The cluster, its job, the faults and what they caused."""

    def __init__(self, args: argparse.Namespace, etcd: EtcdCluster, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.rng = random.Random(args.seed)
        flags = ("--store", etcd.url, "--leader-ttl", str(args.leader_ttl), "--heartbeat-timeout",
                 str(args.heartbeat_timeout), "--cluster-id", f"soak-{args.seed}")
        self.replicas = [Replica(p, flags, args.processes, tmp / f"replica{i}.log")
                         for i, p in enumerate(free_ports(args.replicas))]
        self.address = ",".join(r.address for r in self.replicas)
        self.workers: dict[int, Worker] = {}
        self.launches = 0
        self.failovers: list[dict[str, Any]] = []
        self.pauses: list[float] = []  # when SIGSTOPs ended before any other replica led
        self.startups: list[dict[str, Any]] = []
        self.victim_cycles: list[dict[str, Any]] = []
        self.done = threading.Event()
        self.stopping_at = math.inf
        self.job_errors: list[str] = []

    @property
    def victim(self) -> int:
        return self.args.processes - 1

    def launch(self, process_id: int) -> Worker:
        self.launches += 1
        name = f"{process_id}.{self.launches}"
        worker = Worker(self.address, process_id, self.args.processes, self.tmp / f"ops-{name}.jsonl", name, self.args)
        self.workers[process_id] = worker
        return worker

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        if leader(self.replicas, None, 60)[0] is None:
            raise RuntimeError("no replica leads within 60 s")
        for p in range(self.args.processes):
            self.launch(p)
        for w in self.workers.values():
            if w.wait(lambda r: "ready" in r, 120) is None:
                raise RuntimeError(f"process {w.process_id} did not discover within 120 s: {w.stderr.read_text()}")

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
                new, seen = leader(self.replicas, None, 30)
                if new is old or new is None:
                    self.pauses.append(round(time.monotonic(), 3))
                    return
        if new is None:
            say(f"no other replica led within {seen - began:.0f} s of the {kind}")
            return
        self.failovers.append({"kind": kind, "seconds": round(seen - began, 3), "at": seen})
        say(f"failover {len(self.failovers)}: {kind}, {seen - began:.2f} s")

    def job(self) -> None:
        """Start-up exchanges and the last process's kill and restart, one at a time, until the faults are over."""
        round_ = 0
        while not self.done.is_set() or round_ == 0 or not self.victim_cycles:
            try:
                if round_ > 0 and (not self.victim_cycles or self.rng.random() < self.args.victim_share):
                    self.kill_victim()
                else:
                    self.startup(round_)
                    round_ += 1
            except Exception as e:  # reported, and the soak goes on
                self.job_errors.append(f"{type(e).__name__}: {e}"[:500])
                say(f"the job's turn failed: {self.job_errors[-1]}")
                if len(self.job_errors) > 5:
                    return
            self.done.wait(self.rng.uniform(0.2, 1.0))

    def startup(self, round_: int) -> None:
        """One start-up exchange in every process; a failed one is checked against what the store held."""
        workers = list(self.workers.values())
        began = time.monotonic()
        for w in workers:
            w.send(f"startup {round_} {self.args.startup_timeout}")
        deadline = began + self.args.startup_timeout + 60
        answers = [w.wait(lambda r: r.get("startup") == round_, deadline - time.monotonic()) for w in workers]
        record: dict[str, Any] = {"round": round_, "seconds": round(time.monotonic() - began, 3),
                                  "failed": {w.process_id: (a or {}).get("error", "no answer")
                                             for w, a in zip(workers, answers, strict=True) if not (a or {}).get("ok")}}
        if record["failed"]:
            record["store"] = (self.workers[0].ask("inspect", "store", 60) or {}).get("store")
        self.startups.append(record)
        say(f"start-up {round_}: {'failed ' + str(record['failed']) if record['failed'] else 'done'} in "
            f"{record['seconds']} s")

    def kill_victim(self) -> None:
        """SIGKILLs the last process, waits until every other process was told it failed, starts it again and waits
        until they are told it came back."""
        victim = self.workers[self.victim]
        began = time.monotonic()
        victim.process.kill()
        victim.process.wait()
        others = [w for p, w in self.workers.items() if p != self.victim]

        def told(kind: str) -> list[float | None]:
            deadline = time.monotonic() + 120
            return [(w.wait(lambda r: r.get("event") == kind and r.get("process_id") == self.victim
                            and r["t"] >= began, deadline - time.monotonic()) or {}).get("t") for w in others]

        failed = told("ProcessFailed")
        ready = self.launch(self.victim).wait(lambda r: "ready" in r, 120)
        restarted = told("ProcessRestarted")
        cycle: dict[str, Any] = {"killed_at": round(began, 3), "restarted": ready is not None,
                                 "restarted_told_all": None not in restarted, "failed_told_all_s": None,
                                 "past_bound_s": None}
        if None not in failed:
            told_all = max(failed)  # type: ignore[type-var]
            # Liveness is not journaled: after a takeover every process has the heartbeat timeout to come back.
            clock = max([began, *(f["at"] for f in self.failovers if f["at"] < told_all)])
            cycle.update(failed_told_all_s=round(told_all - began, 3),
                         past_bound_s=round(told_all - clock - self.args.heartbeat_timeout, 3))
        self.victim_cycles.append(cycle)
        say(f"process {self.victim} killed and started again: {cycle}")

    def settle(self, timeout: float = 15.0) -> None:
        """Waits until every observer holds as many job events as the others (an event sent a moment ago may not
        have reached all yet), at most ``timeout`` seconds; whatever still differs then is reported."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            counts = {sum(e["event"] in JOB_EVENTS for e in w.events())
                      for p, w in self.workers.items() if p != self.victim}
            if len(counts) == 1:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self.settle()
        self.stopping_at = time.monotonic()  # from now on processes leave: ProcessLeft is no fault's doing
        for w in self.workers.values():
            w.send("stop")
        for w in self.workers.values():
            if w.wait(lambda r: "stopped" in r, max(1.0, self.stopping_at + self.args.op_timeout + 30
                                                     - time.monotonic())) is None:
                w.process.kill()
            w.process.wait()
        for r in self.replicas:
            r.close()

    def report(self) -> dict[str, Any]:
        seconds = [f["seconds"] for f in self.failovers]
        streams = {p: [e for e in w.events() if e["t"] < self.stopping_at]
                   for p, w in self.workers.items() if p != self.victim}
        failed_startups = [s for s in self.startups if s["failed"]]
        return {
            "measure": "failover_soak", "seed": self.args.seed, "processes": self.args.processes,
            "replicas": self.args.replicas, "etcd_members": 3, "leader_ttl_s": self.args.leader_ttl,
            "heartbeat_timeout_s": self.args.heartbeat_timeout,
            "failovers": len(self.failovers), "by_kill": sum(f["kind"] == "kill" for f in self.failovers),
            "by_stop": sum(f["kind"] == "stop" for f in self.failovers), "stops_without_failover": len(self.pauses),
            "failover_s_p50": round(statistics.median(seconds), 3) if seconds else None,
            "failover_s_max": max(seconds, default=None),
            "key_values": key_values(sorted(self.tmp.glob("ops-*.jsonl")), self.args.check_budget),
            "events": delivery(streams, self.victim, len(self.victim_cycles),
                               sum(c["restarted"] for c in self.victim_cycles)),
            "victim_failed_told_all_s_max": max((c["failed_told_all_s"] or 0 for c in self.victim_cycles),
                                                default=None),
            "victim_failed_past_bound_s_max": max((c["past_bound_s"] for c in self.victim_cycles
                                                   if c["past_bound_s"] is not None), default=None),
            "victim_failures_not_told": sum(c["failed_told_all_s"] is None for c in self.victim_cycles),
            "startups": len(self.startups), "startups_failed": len(failed_startups),
            "startups_failed_while_store_held_every_answer": sum(held_everything(s) for s in failed_startups),
            "job_errors": self.job_errors,
            "startup_errors": sorted({e.split(":")[0] for s in failed_startups for e in s["failed"].values()}),
        }


def say(line: str) -> None:
    """A progress line on stderr."""
    print(f"[soak {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def held_everything(startup: dict[str, Any]) -> bool:
    """Whether the store held the whole exchange of a failed start-up: its start record, every answer, ready."""
    store = startup.get("store") or {}
    return bool(store.get("start") and store.get("joined") == store.get("followers") and store.get("ready"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--failovers", type=int, default=6, help="leader changes to cause (default %(default)s)")
    p.add_argument("--processes", type=int, default=4, help="processes of the job (default %(default)s)")
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
    p.add_argument("--max-seconds", type=float, default=1800.0, help="the faults stop by then (default %(default)s)")
    p.add_argument("--check-budget", type=int, default=5_000_000, help="search steps per key (default %(default)s)")
    p.add_argument("--keep", type=Path, help="keep the records and logs in this directory")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally clauses stop every child
    with tempfile.TemporaryDirectory(prefix="ifrt-soak-") as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        with EtcdCluster.start(3, tmp_path=tmp) as etcd:
            soak = Soak(args, etcd, tmp)
            try:
                soak.start()
                job = threading.Thread(target=soak.job, daemon=True)
                job.start()
                soak.faults()
                job.join(args.startup_timeout + 180)
            finally:
                soak.stop()
            report = soak.report()
            if args.keep:
                (tmp / "soak.json").write_text(json.dumps({
                    "report": report, "failovers": soak.failovers, "pauses": soak.pauses,
                    "victim_cycles": soak.victim_cycles, "startups": soak.startups,
                    "events": {p: w.events() for p, w in soak.workers.items()}}, indent=1))
    print(json.dumps(report), flush=True)
    kv, events = report["key_values"], report["events"]
    sound = kv["linearizable_keys"] == kv["keys"] and not (events["lost"] or events["duplicated"]
                                                           or events["reordered_at"])
    return 0 if sound else 1


if __name__ == "__main__":
    sys.exit(main())
