"""Partition trials, in the tradition of Jepsen: a 3-member etcd, two coordinator replicas and the job's processes,
each in its own network namespace on one bridge (tests/netns.py), cut by iptables DROP rules inside a namespace while
every key-value call is recorded with the replica that answered it (bench/partition_worker.py).

Hosts: e1..e3 (etcd), c1 c2 (replicas, c1 leads first), w1..wN (the job's processes, and a spare). Nemeses
(``NEMESES``), each bounded in time, each rule removed in ``finally`` and every namespace with its processes (by pid)
when the trial closes:

- ``gray_leader``: the leader cut from every job process, not from etcd nor the standby;
- ``leader_etcd``: the leader cut from every etcd member, not from the job;
- ``host_cut``: process 1's host cut from both replicas, not from its peer; once process 0 hears it failed, a
  replacement for id 1 starts on a spare host; both incarnations send transfer frames to process 0;
- ``etcd_minority``: e1 (first on both replicas' lists) cut from e2 and e3, which keep quorum;
- ``flapping``: process 1's link to both replicas down and up, each outage shorter than ``--heartbeat-timeout``;
- ``lost_reply``: an increment whose reply a one-way cut drops, other calls that fill ``--max-answer-bytes``, then
  the increment's retry (the same request id).

Each trial reports what the job's processes observed (``COUNTS``, each 0 when the job is safe): jobs ended that
should have survived, keys whose history is not linearizable (bench/linearizable.py), reads answered by a deposed
leader with a value older than one the new leader had acknowledged, transfer frames accepted from an old
incarnation after its peer knew it had failed, retries applied twice.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path += [p for p in (str(BENCH), str(BENCH.parent)) if p not in sys.path]  # bench/ imports by file name

from soak_history import key_values, lines  # noqa: E402

from coordinator.local import LocalCoordinator  # noqa: E402
from tests.etcd_cluster import _etcd_env, etcd_binary  # noqa: E402
from tests.netns import Hosts  # noqa: E402

WORKER = BENCH / "partition_worker.py"
ETCD_CLIENT, ETCD_PEER, COORDINATOR_PORT = 2379, 2380, 8476
ETCD, REPLICAS = (1, 2, 3), (4, 5)
"""Host numbers (tests/netns.py's Hosts): the etcd members and the replicas; the job's hosts follow."""
COUNTS = ("jobs_ended", "non_linearizable_keys", "deposed_leader_reads", "old_incarnation_frames",
          "retries_applied_twice")
FATAL = ("CoordinatorUnavailable", "ProcessDeclaredFailed", "AttemptEnded", "StaleSession", "JobFailed",
         "UnknownClient", "AgentGone")
"""Errors after which a process of the job cannot go on: its job ended."""
OLD, NEW = 1, 2
"""The tags of process 1's frames: its first incarnation's, its replacement's (bench/partition_worker.py)."""
FENCE_SLACK_S = 0.3
"""A frame of the old incarnation counts once sent this long after its peer heard of the failure (the event reaches
the program a moment after the library)."""
LEADERSHIP = ("serving:", "stepping down", "standing aside", "standing by")


@dataclass
class Timing:
    """How long each part of a trial lasts (seconds) and the replicas' timeouts; ``short`` is the tests' size."""

    leader_ttl: int = 2
    heartbeat_timeout: float = 3.0
    cut: float = 7.0
    settle: float = 4.0
    steady: float = 1.5
    failover_window: float = 6.0
    """The workers' IFRT_FAILOVER_WINDOW in ``etcd_minority``: a job without a leader longer than this ends."""
    flap_down: tuple[float, float] = (1 / 3, 2 / 3)
    """How long each outage of ``flapping`` holds, as shares of ``heartbeat_timeout`` (drawn uniformly)."""
    seed: int = 1


def short() -> Timing:
    """The tests' size: each trial in about half a minute."""
    return Timing(cut=5.0, settle=3.0, steady=1.0, flap_down=(1 / 6, 1 / 3))


def say(line: str) -> None:
    print(f"[partitions {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


class Worker:
    """bench/partition_worker.py inside a host's namespace: its stdout's JSON records, commands on its stdin."""

    def __init__(self, hosts: Hosts, host: int, argv: list[str], ops: Path, env: dict[str, str]) -> None:
        self.ops, self.host = ops, host
        self.records: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self.stderr = ops.with_suffix(".stderr")
        with self.stderr.open("ab") as err:
            self.process = subprocess.Popen(hosts.command(host, [sys.executable, str(WORKER), "--ops", str(ops),
                                                                 *argv]),
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                            bufsize=1, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.ops.with_suffix(".records").open("a") as kept:
            for line in self.process.stdout:
                kept.write(line)
                with contextlib.suppress(ValueError), self._changed:
                    self.records.append(json.loads(line))
                    self._changed.notify_all()

    def wait(self, found: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any] | None:
        """The first record ``found`` accepts within ``timeout`` seconds (None: none came, or the process ended)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while time.monotonic() < deadline:
                hit = next((r for r in self.records if found(r)), None)
                if hit is not None or (self.process.poll() is not None and time.monotonic() > deadline - timeout + 1):
                    return hit
                self._changed.wait(0.2)
        return None

    def send(self, line: str) -> None:
        with contextlib.suppress(BrokenPipeError, ValueError, OSError):
            assert self.process.stdin is not None
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()

    def ask(self, command: str, timeout: float = 40) -> dict[str, Any]:
        """Sends a probe command and returns its answer ({} if none came)."""
        with self._changed:
            before = sum("probe" in r for r in self.records)
        self.send(command)
        deadline = time.monotonic() + timeout
        with self._changed:
            while time.monotonic() < deadline:
                probes = [r for r in self.records if "probe" in r]
                if len(probes) > before:
                    return probes[before]
                if self.process.poll() is not None:
                    return {"error": f"the worker exited {self.process.returncode}: {self.stderr_tail()[-300:]}"}
                self._changed.wait(0.2)
        return {}

    def events(self, kind: str) -> list[dict[str, Any]]:
        with self._changed:
            return [r for r in self.records if r.get("event") == kind]

    def stop(self, timeout: float = 25) -> None:
        """Asks it to stop (it finishes its calls), then SIGKILLs it by pid if it has not exited."""
        self.send("stop")
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def stderr_tail(self) -> str:
        return self.stderr.read_text(errors="replace")[-1500:]


@dataclass
class Cluster:
    """The namespaces, etcd members, replicas and workers of one trial; ``close`` removes all of it."""

    tmp: Path
    timing: Timing
    job_hosts: int
    hosts: Hosts = field(init=False)
    etcd: list[subprocess.Popen] = field(default_factory=list)
    replicas: list[LocalCoordinator] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    stopping_at: float = math.inf
    """When the trial began to stop its processes: events after it are theirs leaving."""

    def __post_init__(self) -> None:
        if self.tmp.exists():  # a kept directory of an earlier trial: its etcd data would name other members
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.hosts = Hosts(len(ETCD) + len(REPLICAS) + self.job_hosts)

    def address(self, host: int) -> str:
        return self.hosts.address(host)

    def job_host(self, i: int) -> int:
        """The host number of the job's ``i``th host (1-based: w1, w2, ...)."""
        return len(ETCD) + len(REPLICAS) + i

    @property
    def store(self) -> str:
        return "etcd://" + ",".join(f"{self.address(h)}:{ETCD_CLIENT}" for h in ETCD)

    @property
    def coordinators(self) -> str:
        return ",".join(f"{self.address(h)}:{COORDINATOR_PORT}" for h in REPLICAS)

    def start_etcd(self, timeout: float = 30) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("no etcd binary")
        peers = ",".join(f"e{h}=http://{self.address(h)}:{ETCD_PEER}" for h in ETCD)
        for h in ETCD:
            a = self.address(h)
            with (self.tmp / f"e{h}.log").open("ab") as log:
                self.etcd.append(subprocess.Popen(self.hosts.command(h, [
                    binary, "--name", f"e{h}", "--data-dir", str(self.tmp / f"e{h}.etcd"),
                    "--listen-client-urls", f"http://{a}:{ETCD_CLIENT}",
                    "--advertise-client-urls", f"http://{a}:{ETCD_CLIENT}",
                    "--listen-peer-urls", f"http://{a}:{ETCD_PEER}",
                    "--initial-advertise-peer-urls", f"http://{a}:{ETCD_PEER}", "--initial-cluster", peers,
                    "--initial-cluster-state", "new", "--initial-cluster-token", f"part-{os.getpid()}",
                    "--heartbeat-interval", "50", "--election-timeout", "500", "--max-request-bytes", "4194304"]),
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_etcd_env()))
        deadline = time.monotonic() + timeout
        for h in ETCD:
            while not self.etcd_healthy(h):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd e{h} not healthy within {timeout}s: "
                                       f"{(self.tmp / f'e{h}.log').read_text()[-2000:]}")
                time.sleep(0.2)

    def etcd_healthy(self, h: int) -> bool:
        probe = subprocess.run(self.hosts.command(h, ["curl", "-s", "--max-time", "1", "--noproxy", "*",
                                                      f"http://{self.address(h)}:{ETCD_CLIENT}/health"]),
                               capture_output=True, text=True, timeout=10)
        return '"health":"true"' in probe.stdout

    def start_replicas(self, num_processes: int, *flags: str) -> None:
        args = ("--store", self.store, "--leader-ttl", str(self.timing.leader_ttl), "--heartbeat-timeout",
                str(self.timing.heartbeat_timeout), "--cluster-id", "partitions", *flags)
        for i, h in enumerate(REPLICAS):
            self.replicas.append(LocalCoordinator(*args, num_processes=num_processes, bind=f"{self.address(h)}:"
                                                  f"{COORDINATOR_PORT}", wrapper=self.hosts.command(h, [])))
            self.replicas[-1].wait_for_log("serving:" if i == 0 else "standing by", timeout=30)

    def leader(self) -> int | None:
        """The replica (index) whose log says last that it serves."""
        for i, r in enumerate(self.replicas):
            log = r.log
            if r.process.poll() is None and max(LEADERSHIP, key=log.rfind) == "serving:" and "serving:" in log:
                return i
        return None

    def start_worker(self, i: int, process_id: int, n: int, *args: str, env: dict[str, str] | None = None) -> Worker:
        """Process ``process_id`` of an ``n``-process job on the job's host ``i``."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
        ops = self.tmp / f"ops-{process_id}-{len(self.workers)}.jsonl"
        worker = Worker(self.hosts, self.job_host(i), ["--address", self.coordinators, "--process-id",
                                                       str(process_id), "--num-processes", str(n), "--seed",
                                                       str(self.timing.seed), *args], ops, {**base, **(env or {})})
        self.workers.append(worker)
        return worker

    def wait_ready(self, *workers: Worker, timeout: float = 60) -> None:
        for w in workers:
            if w.wait(lambda r: "ready" in r, timeout) is None:
                raise RuntimeError(f"worker on host {w.host} did not discover within {timeout}s: {w.stderr_tail()}")

    def close(self) -> None:
        """Stops the workers, replicas and etcd members by pid, then removes the namespaces."""
        for w in self.workers:
            if w.process.poll() is None:
                w.process.kill()
                w.process.wait(10)
        for r in self.replicas:
            with contextlib.suppress(Exception):
                with (self.tmp / f"replica-{r.address.replace(':', '-')}.log").open("w") as log:
                    log.write(r.log)
                r.stop(signal.SIGKILL)
                r.close()
        for p in self.etcd:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.hosts.close()


@contextlib.contextmanager
def cluster(tmp: Path, timing: Timing, job_hosts: int) -> Iterator[Cluster]:
    c = Cluster(tmp, timing, job_hosts)
    try:
        yield c
    finally:
        c.close()


def iptables(c: Cluster, host: int, action: str, chain: str, peer: str) -> None:
    side = "-s" if chain == "INPUT" else "-d"
    subprocess.run(c.hosts.command(host, ["iptables", action, chain, side, peer, "-j", "DROP"]), check=True,
                   capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def cut(c: Cluster, host: int, peers: list[int], chains: tuple[str, ...] = ("INPUT", "OUTPUT")) -> Iterator[None]:
    """Inside ``host``'s namespace, every packet from and to ``peers`` is dropped (silence, no reset) until exit."""
    rules = [(chain, c.address(p)) for p in peers for chain in chains]
    added = []
    try:
        for chain, peer in rules:
            iptables(c, host, "-I", chain, peer)
            added.append((chain, peer))
        yield
    finally:
        for chain, peer in added:
            with contextlib.suppress(subprocess.CalledProcessError):
                iptables(c, host, "-D", chain, peer)


def flap(c: Cluster, host: int, peers: list[int], seconds: float, down: tuple[float, float],
         up: tuple[float, float], rng: random.Random, max_flaps: int = 50) -> list[list[float]]:
    """``host``'s link to ``peers`` down and up at random (each outage in ``down``, each up-time in ``up``) for about
    ``seconds``, at most ``max_flaps`` times; each outage as [when it began (monotonic), how long it held]."""
    outages: list[list[float]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and len(outages) < max_flaps:
        hold = rng.uniform(*down)
        began = time.monotonic()
        with cut(c, host, peers):
            time.sleep(hold)
        outages.append([round(began, 2), round(time.monotonic() - began, 2)])
        time.sleep(rng.uniform(*up))
    return outages


# --- what the job observed ---------------------------------------------------------------------------------------


def operations(workers: list[Worker]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Every recorded key-value call with its return (None: none recorded)."""
    calls: dict[str, dict[str, Any]] = {}
    rets: dict[str, dict[str, Any]] = {}
    for w in workers:
        if w.ops.exists():
            for r in lines(w.ops):
                (rets if "ret" in r else calls)[r["id"]] = r
    return [(call, rets.get(i)) for i, call in calls.items()]


def written(call: dict[str, Any], ret: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether an acknowledged call wrote its key, and what the key held after it."""
    kind, result = call["kind"], ret.get("result")
    if kind == "set":
        return result == "ok", call["args"][0]
    if kind == "cas":
        return True, result
    if kind == "incr":
        return result != "invalid", None if result == "invalid" else str(result)
    if kind == "delete":
        return True, None
    return False, None


def deposed_reads(ops: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> tuple[int, int]:
    """Reads answered by a replica after a replica that first answered later than it (a newer leader) had
    acknowledged a write of that key, returning a value older than that write's (no write of the value was under way
    since); and every call answered by an older replica after a newer one answered."""
    ok = [(c, r) for c, r in ops if r is not None and r.get("outcome") == "ok" and r.get("via")]
    first: dict[str, float] = {}
    for _, r in ok:
        first[r["via"]] = min(first.get(r["via"], r["ret"]), r["ret"])
    stale = after = 0
    for c, r in ok:
        newer = {v for v, t in first.items() if v != r["via"] and t > first[r["via"]]}
        if any(first[v] < c["call"] for v in newer):
            after += 1
        if c["kind"] != "get":
            continue
        acked = [(r2["ret"], value) for c2, r2 in ok if r2["via"] in newer and c2["key"] == c["key"]
                 and r2["ret"] < c["call"] for wrote, value in [written(c2, r2)] if wrote]
        if not acked:
            continue
        since, value = max(acked, key=lambda a: a[0])
        if r.get("result") == value:
            continue
        underway = [c2 for c2, r2 in ops if c2["key"] == c["key"] and c2["kind"] != "get" and c2["call"] < r["ret"]
                    and (r2 is None or r2.get("outcome") != "ok" or r2["ret"] > since)]
        if any(c2["kind"] == "incr" for c2 in underway):
            continue  # an increment under way could have made any number: not decided here
        possible = {c2["args"][0] if c2["kind"] == "set" else c2["args"][1] if c2["kind"] == "cas" else None
                    for c2 in underway}
        if r.get("result") not in possible:
            stale += 1
    return stale, after


def fatal_errors(ops: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> list[str]:
    """The errors of ``ops`` after which a process cannot go on (``FATAL``)."""
    return [r["error"] for _, r in ops if r is not None and r.get("outcome") != "ok"
            and r.get("error", "").split(":")[0] in FATAL]


def judge(c: Cluster, survivors: list[Worker], healed: float, budget: int = 2_000_000,
          expected_failed: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The counts every trial reports: the job ended (a process declared failed or left that should not have been,
    a call failed for good, a survivor exited or made no call after the heal), each key's linearizability over every
    incarnation's calls, and the deposed leader's reads."""
    ops = operations(c.workers)
    survivor_ops = operations(survivors)
    reasons: list[str] = []
    for w in survivors:
        for e in w.events("ProcessFailed") + w.events("ProcessLeft"):
            if e.get("process_id") not in expected_failed and e["t"] < c.stopping_at:
                reasons.append(f"process {e.get('process_id')} {e['event']}: {str(e.get('reason'))[:200]}")
        if w.process.poll() not in (None, 0):
            reasons.append(f"worker on host {w.host} exited {w.process.returncode}: {w.stderr_tail()[-300:]}")
    ids = {c_["id"].rsplit(".", 2)[0] for c_, _ in survivor_ops}
    reasons += [e[:200] for e in fatal_errors(survivor_ops)][:5]
    after_heal = {c_["id"].rsplit(".", 2)[0] for c_, r in survivor_ops if r is not None and r.get("outcome") == "ok"
                  and c_["call"] > healed}
    reasons += [f"no call of {name} answered after the heal" for name in sorted(ids - after_heal)]
    kv = key_values([w.ops for w in c.workers if w.ops.exists()], budget)
    stale, after = deposed_reads(ops)
    return {"jobs_ended": int(bool(reasons)), "ended_because": reasons[:6],
            "non_linearizable_keys": kv["keys"] - kv["linearizable_keys"] - sum(
                v == "undecided" for v in kv["verdicts"].values()),
            "undecided_keys": sum(v == "undecided" for v in kv["verdicts"].values()),
            "deposed_leader_reads": stale, "answers_by_an_older_replica_after_a_newer_one": after,
            "calls": kv["calls"], "calls_ok": kv["ok"], "errors": kv["errors"],
            "first_violations": kv["first_violations"], "old_incarnation_frames": None,
            "retries_applied_twice": None}


def old_frames(frames: list[list[float]], fenced_at: float) -> list[list[float]]:
    """The frames ([tag, seq, sent, received]) of process 1's old incarnation (tag ``OLD``) sent after ``fenced_at``:
    after its peer had heard that it failed, so each was accepted from an incarnation known to be gone."""
    return [f for f in frames if f[0] == OLD and f[2] > fenced_at]


def leaderless_s(ops: list[tuple[dict[str, Any], dict[str, Any] | None]], since: float, until: float) -> float:
    """The longest time between two answered calls (of any process) within [since, until]."""
    times = sorted(r["ret"] for _, r in ops
                   if r is not None and r.get("outcome") == "ok" and since <= r["ret"] <= until)
    marks = [since, *times, until]
    return round(max(b - a for a, b in itertools.pairwise(marks)), 2)


# --- the nemeses -------------------------------------------------------------------------------------------------


def kv_job(c: Cluster, n: int, *flags: str, env: dict[str, str] | None = None, readers: int = 0,
           worker_args: tuple[str, ...] = ()) -> list[Worker]:
    """etcd, the replicas and ``n`` key-value processes on w1..wN (the last ``readers`` of them only read), each
    discovered."""
    c.start_etcd()
    c.start_replicas(n, *flags)
    workers = [c.start_worker(i + 1, i, n, "--mix", "reads" if i >= n - readers else "mixed", *worker_args, env=env)
               for i in range(n)]
    c.wait_ready(*workers)
    time.sleep(c.timing.steady)
    return workers


def stop_all(c: Cluster, workers: list[Worker]) -> None:
    """Stops ``workers``; from now on a process that leaves is no nemesis' doing (``Cluster.stopping_at``)."""
    c.stopping_at = min(c.stopping_at, time.monotonic())
    for w in workers:
        w.send("stop")
    for w in workers:
        w.stop()


def gray_leader(c: Cluster) -> dict[str, Any]:
    """The leader cut from every job process (not from etcd nor the standby) for ``cut`` seconds."""
    workers = kv_job(c, 3)
    leader = REPLICAS[c.leader() or 0]
    with cut(c, leader, [c.job_host(i + 1) for i in range(3)]):
        time.sleep(c.timing.cut)
    healed = time.monotonic()
    time.sleep(c.timing.settle)
    stop_all(c, workers)
    return {**judge(c, workers, healed), "leader_after": c.leader()}


def leader_etcd(c: Cluster) -> dict[str, Any]:
    """The leader cut from every etcd member (not from the job) for ``cut`` seconds. Processes 1 and 2 only read;
    process 0 writes, and from a moment before the cut to its heal its key-value calls go to the standby only (a writer
    that reaches a new leader at once; no write is pending at the old leader, which a read would wait for)."""
    workers = kv_job(c, 3, readers=2)
    index = c.leader() or 0
    workers[0].send(f"pin {c.address(REPLICAS[1 - index])}:{COORDINATOR_PORT}")
    time.sleep(0.5)
    with cut(c, REPLICAS[index], list(ETCD)):
        time.sleep(c.timing.cut)
    workers[0].send("unpin")
    healed = time.monotonic()
    time.sleep(c.timing.settle)
    stop_all(c, workers)
    return {**judge(c, workers, healed), "leader_after": c.leader()}


def etcd_minority(c: Cluster) -> dict[str, Any]:
    """e1, first on both replicas' lists, cut from e2 and e3 (not from the replicas) for ``cut`` plus half
    ``failover_window`` seconds; the processes' calls wait ``failover_window`` seconds for a replica to answer."""
    window = str(c.timing.failover_window)  # a call ends once no replica answered it for so long
    workers = kv_job(c, 3, env={"IFRT_FAILOVER_WINDOW": window}, readers=1, worker_args=("--op-timeout", window))
    began = time.monotonic()
    with cut(c, ETCD[0], list(ETCD[1:])):
        time.sleep(c.timing.cut + c.timing.failover_window / 2)
    healed = time.monotonic()
    time.sleep(c.timing.settle)
    stop_all(c, workers)
    ops = operations(workers)
    return {**judge(c, workers, healed), "leaderless_s_max": leaderless_s(ops, began, healed),
            "leader_after": c.leader()}


def flapping(c: Cluster) -> dict[str, Any]:
    """Process 1's link to both replicas down and up, each outage within ``Timing.flap_down`` of
    ``--heartbeat-timeout``."""
    workers = kv_job(c, 2)
    hb = c.timing.heartbeat_timeout
    low, high = c.timing.flap_down
    outages = flap(c, c.job_host(2), list(REPLICAS), c.timing.cut + 4, (low * hb, high * hb), (hb / 3, hb / 2),
                   random.Random(c.timing.seed))
    healed = time.monotonic()
    time.sleep(c.timing.settle)
    stop_all(c, workers)
    return {**judge(c, workers, healed), "outages_s": outages}


def host_cut(c: Cluster) -> dict[str, Any]:
    """Process 1's host cut from both replicas (not from process 0); once process 0 hears it failed, a replacement
    for id 1 starts on a spare host; both incarnations send frames to process 0, which records each."""
    c.start_etcd()
    c.start_replicas(2)
    receiver = c.start_worker(1, 0, 2, "--role", "recv", "--threads", "1")
    old = c.start_worker(2, 1, 2, "--role", "send", "--tag", str(OLD), "--threads", "1")
    c.wait_ready(receiver, old)
    time.sleep(c.timing.steady)
    replacement = None
    began = time.monotonic()
    with cut(c, c.job_host(2), list(REPLICAS)):
        failed = receiver.wait(lambda r: r.get("event") == "ProcessFailed" and r.get("process_id") == 1,
                               c.timing.cut + 3 * c.timing.heartbeat_timeout)
        if failed is not None:
            replacement = c.start_worker(3, 1, 2, "--role", "send", "--tag", str(NEW), "--threads", "1")
            replacement.wait(lambda r: "ready" in r, 40)
        time.sleep(max(2.0, began + c.timing.cut - time.monotonic()))
    healed = time.monotonic()
    time.sleep(c.timing.settle)
    survivors = [receiver] + ([replacement] if replacement else [])
    stop_all(c, [*survivors, old])
    report = judge(c, survivors, healed, expected_failed=frozenset({1}))
    frames = (receiver.wait(lambda r: "frames" in r, 5) or {}).get("frames", [])
    fenced_at = failed["t"] + FENCE_SLACK_S if failed else float("inf")
    old_after = old_frames(frames, fenced_at)
    new = [f for f in frames if f[0] == NEW]
    if failed is None:
        report["ended_because"].append("process 1 was never declared failed: no replacement")
    elif replacement is None or not new:
        report["ended_because"].append("no frame of the replacement reached process 0")
    report["jobs_ended"] = int(bool(report["ended_because"]))
    return {**report, "old_incarnation_frames": len(old_after),
            "old_frames_while_cut": sum(f[2] < healed for f in old_after),
            "old_frames_after_heal": sum(f[2] >= healed for f in old_after), "new_frames": len(new),
            "old_frames_before_the_fence": sum(f[0] == OLD and f[2] <= fenced_at for f in frames),
            "declared_failed_after_s": round(failed["t"] - began, 2) if failed else None,
            "sent": [r for w in (old, replacement) if w for r in w.records if "frames_sent" in r]}


def lost_reply(c: Cluster) -> dict[str, Any]:
    """Process 0 increments ``retry/k`` while the leader's packets to it are dropped (the reply is lost, the call
    applied); process 1 then sets more than ``--max-answer-bytes`` holds; process 0 retries the increment (same
    request id). Applied twice: the retry answers 2, or the key holds 2."""
    workers = kv_job(c, 2, "--max-answer-bytes", str(4 << 20))
    leader = REPLICAS[c.leader() or 0]
    with cut(c, leader, [c.job_host(1)], chains=("OUTPUT",)):
        lost = workers[0].ask("incr-lost retry/k")
    applied = workers[1].ask("get retry/k")
    flood = workers[1].ask(f"flood 8 {(1 << 20) - 4096}", timeout=90)
    healed = time.monotonic()
    retry = workers[0].ask("incr-retry retry/k")
    final = workers[1].ask("get retry/k")
    time.sleep(c.timing.settle / 2)
    stop_all(c, workers)
    twice = applied_twice(retry, final)
    return {**judge(c, workers, healed), "retries_applied_twice": twice,
            "retry_probe": {"lost": lost, "applied_before_retry": applied, "flood": flood, "retry": retry,
                            "final": final},
            "retry_probe_conclusive": lost.get("answer") is None and applied.get("value") == "1"}


def applied_twice(retry: dict[str, Any], final: dict[str, Any]) -> int:
    """1 when an increment applied once (to 1) shows a second application: its retry answered 2, or the key holds 2;
    a retry answered 1 or refused is 0."""
    return int(retry.get("answer") == 2 or final.get("value") == "2")


NEMESES: dict[str, tuple[Callable[[Cluster], dict[str, Any]], int]] = {
    "gray_leader": (gray_leader, 3), "leader_etcd": (leader_etcd, 3), "host_cut": (host_cut, 3),
    "etcd_minority": (etcd_minority, 3), "flapping": (flapping, 2), "lost_reply": (lost_reply, 2),
}
"""Each nemesis and the job hosts it needs."""


def run_nemesis(name: str, tmp: Path, timing: Timing) -> dict[str, Any]:
    """One trial of nemesis ``name`` on a fresh cluster under ``tmp``: its report (``COUNTS`` and what explains
    them), with ``seconds`` it took."""
    began = time.monotonic()
    trial, job_hosts = NEMESES[name]
    with cluster(tmp, timing, job_hosts) as c:
        report = trial(c)
    report["seconds"] = round(time.monotonic() - began, 1)
    say(f"{name}: " + ", ".join(f"{k} {report.get(k)}" for k in COUNTS) + f" ({report['seconds']} s)")
    return {"nemesis": name, **report}
