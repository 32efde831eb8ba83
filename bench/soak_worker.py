"""One process of bench/failover_soak.py's job: discovers, records every event it receives, runs key-value client
threads that record each call, and takes part in start-up exchanges when told.

    soak_worker.py --address A,B,C --process-id 0 --num-processes 4 --ops FILE [--threads 2] [--seed 1]
    ifrt run ... -- python soak_worker.py --control DIR [--threads 2] [--seed 1]     # a worker of an ifrt run agent

Records, one JSON object per line: ``{"started": pid}`` at once, ``{"ready": ...}`` once discovered, ``{"event": ...}``
per event, ``{"startup": round, "ok": ...}`` per start-up, ``{"store": ...}`` per inspection. Commands, one per line:
``startup ROUND SECONDS``, ``inspect``, ``stop``. Each key-value call is two lines in ``--ops``: its call (written
before it is sent) and its return; a call with no return was in flight when the process was killed.

Records go to stdout and commands come on stdin, or with ``--control DIR`` (under ``ifrt run``, whose agent holds the
worker's stdio) records go to ``DIR/rec-P-PID.jsonl`` and calls to ``DIR/ops-P-PID.jsonl`` (P: the process id the
agent gave, ``IFRT_PROCESS_ID``; PID: this process's), and commands are read from ``DIR/cmd-P.txt`` as they are
appended, from its length when this process started on: a replacement never runs its predecessor's commands.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ifrt
from ifrt import events
from ifrt.errors import IfrtError, InvalidArgument, KeyExists
from ifrt.startup import StartupExchange

KINDS = ("get", "set", "cas", "incr", "delete")
WEIGHTS = (30, 25, 15, 20, 10)
RETRIED = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
"""The statuses the client's retry loop tries again (ifrt.errors)."""
_attempts = threading.local()
"""Each client thread's failed attempts of its current call, as (status, details)."""


class SoakStartup(StartupExchange):
    """The exchange ``ifrt.torch`` and ``ifrt.jax`` run, under keys of its own."""

    runtime = "soak"
    what = "the soak's start-up"


def definite(status: str, details: str) -> bool:
    """Whether a failed attempt surely changed nothing: a replica that never led refused it, or it never left this
    process (no connection, or no time left to send it). A replica that stepped down answers in the same words
    whether or not the call's journal entry reached the store, and a deadline or a broken stream may come after the
    coordinator applied it: those are of unknown outcome."""
    text = details.lower()
    return status == "UNAVAILABLE" and any(sure in text for sure in (
        "this replica stands by", "failed to connect", "connection refused", "was not sent to the coordinator"))


def record_attempts(client: ifrt.Client) -> bool:
    """Notes every failed attempt of the client's calls in ``_attempts`` (its retry loop hides them); False when the
    client has no such hook, and then every failure counts as of unknown outcome. The hook sits on the client's link:
    its own connection, or under ``ifrt run`` the connection to its agent, which forwards each attempt once."""
    connection = getattr(client, "_link", None) or getattr(client, "_connection", None)
    failed = getattr(connection, "failed", None)
    if failed is None:
        return False

    def noted(error: grpc.RpcError, *args: Any, **kwargs: Any) -> Any:
        status = error.code().name if hasattr(error, "code") else "UNKNOWN"
        if hasattr(_attempts, "errors") and status in RETRIED:  # the rest is the call's answer (KeyExists, ...)
            _attempts.errors.append((status, error.details() if hasattr(error, "details") else str(error)))
        return failed(error, *args, **kwargs)

    connection.failed = noted
    return True


class Out:
    """The records (stdout or a file) and the ops file, one JSON line at a time from any thread."""

    def __init__(self, ops: Path, records: TextIO = sys.stdout) -> None:
        self._lock = threading.Lock()
        self._ops = ops.open("a", buffering=1)
        self._records = records

    def say(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._records.write(json.dumps(record) + "\n")
            self._records.flush()

    def op(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._ops.write(json.dumps(record) + "\n")


def event_record(event: events.Event) -> dict[str, Any]:
    """An event as plain values: its kind and what tells it apart."""
    record: dict[str, Any] = {"event": type(event).__name__, "t": time.monotonic()}
    match event:
        case events.ProcessFailed(process_id=p, reason=why):
            record.update(process_id=p, reason=why)
        case events.ProcessRestarted(process_id=p, incarnation=i):
            record.update(process_id=p, incarnation=i)
        case events.ProcessLeft(process_id=p) | events.PreemptionNotice(process_id=p):
            record.update(process_id=p)
        case events.TopologyChanged(topology=t):
            record.update(generation=t.generation)
        case events.JobWhole(topology=t, replaced=replaced):
            record.update(generation=t.generation, replaced=[[r.process_id, r.incarnation] for r in replaced])
        case events.CoordinatorLost(reason=why):
            record.update(reason=why)
        case events.CoordinatorRestored(coordinator=where):
            record.update(coordinator=where)
    return record


def kv_call(client: ifrt.Client, kind: str, key: str, args: list[Any], timeout: float) -> Any:
    """One call; its result as the history records it (decimal text values as str)."""
    if kind == "get":
        value = client.kv_try_get(key, timeout=timeout)
        return None if value is None else value.decode()
    if kind == "set":
        try:
            client.kv_set(key, args[0].encode(), allow_overwrite=args[1], timeout=timeout)
        except KeyExists:
            return "exists"
        return "ok"
    if kind == "cas":
        value = client.kv_compare_set(key, args[0].encode(), args[1].encode(), timeout=timeout)
        return None if value is None else value.decode()
    if kind == "incr":
        try:
            return client.kv_increment(key, args[0], timeout=timeout)
        except InvalidArgument as e:
            if "not a decimal integer" in str(e) or "64-bit" in str(e):
                return "invalid"
            raise
    return client.kv_delete(key, timeout=timeout)


def kv_thread(client: ifrt.Client, out: Out, name: str, keys: list[str], seed: str, timeout: float, pause: float,
              stop: threading.Event, hooked: bool) -> None:
    """Random calls on ``keys`` until ``stop``, each recorded with its call and return times and its outcome."""
    rng = random.Random(seed)
    seen: dict[str, str] = {}  # the last value this thread saw at each key: what its compare-sets expect
    n = 0
    while not stop.is_set():
        key, kind = rng.choice(keys), rng.choices(KINDS, WEIGHTS)[0]
        value = str(rng.randrange(10**9, 10**10))
        args: list[Any] = {"get": [], "delete": [], "incr": [rng.choice((1, 1, 2, 5))],
                           "set": [value, rng.random() < 0.75],
                           "cas": [seen.get(key, "") if rng.random() < 0.8 else "", value]}[kind]
        op_id, n = f"{name}.{n}", n + 1
        _attempts.errors = []
        out.op({"id": op_id, "kind": kind, "key": key, "args": args, "call": time.monotonic()})
        ret: dict[str, Any] = {"id": op_id}
        try:
            result = kv_call(client, kind, key, args, timeout)
            ret.update(outcome="ok", result=result)
            if kind in ("get", "cas") and result is not None:
                seen[key] = result
            elif kind == "incr" and result != "invalid":
                seen[key] = str(result)
        except IfrtError as e:
            attempts = [*_attempts.errors, (e.status, str(e))]
            sure = hooked and all(definite(status, details) for status, details in attempts)
            ret.update(outcome="refused" if sure else "unknown", error=f"{type(e).__name__}: {e}"[:500],
                       attempts=len(_attempts.errors))
        ret["ret"] = time.monotonic()
        if ret.get("outcome") == "ok" and _attempts.errors:  # answered by a retry
            ret["retried_after"] = [f"{status}: {details}"[:200] for status, details in _attempts.errors[:3]]
            ret["retried_after_unknown"] = not all(definite(status, details) for status, details in _attempts.errors)
        out.op(ret)
        stop.wait(rng.uniform(0, pause))


def inspect(client: ifrt.Client, generation: int) -> dict[str, Any]:
    """Whether the store holds a whole start-up exchange: the start record, every follower's answer and the ready
    record, all under the start's nonce."""
    prefix = f"ifrt/soak/g{generation}"
    keys = client.kv_dir(prefix + "/", timeout=60)
    start = keys.get(f"{prefix}/start")
    if start is None:
        return {"start": False}
    nonce = json.loads(start)["nonce"]
    followers = [p.process_id for p in client.topology.processes[1:]] if client.topology else []
    joined = [p for p in followers if f"{prefix}/{nonce}/join/{p}" in keys]
    return {"start": True, "joined": len(joined), "followers": len(followers),
            "ready": f"{prefix}/{nonce}/ready" in keys}


def commands(path: Path | None, stop: threading.Event) -> Iterator[str]:
    """Command lines from stdin, or those appended to ``path`` after this call (its length is read now; the file is
    polled every 50 ms)."""
    if path is None:
        return iter(sys.stdin)
    return appended(path, path.stat().st_size if path.exists() else 0, stop)


def appended(path: Path, offset: int, stop: threading.Event) -> Iterator[str]:
    """The lines appended to ``path`` past ``offset``, as they come, until ``stop``."""
    pending = b""
    while not stop.is_set():
        try:
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        *complete, pending = (pending + chunk).split(b"\n")
        yield from (line.decode() for line in complete)
        if not chunk:
            stop.wait(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="the replicas (default: IFRT_COORDINATOR, as ifrt run sets it)")
    p.add_argument("--process-id", type=int, help="default: IFRT_PROCESS_ID, as ifrt run sets it")
    p.add_argument("--num-processes", type=int, help="default: IFRT_NUM_PROCESSES, as ifrt run sets it")
    p.add_argument("--ops", type=Path, help="where each key-value call is recorded (required without --control)")
    p.add_argument("--control", type=Path, help="records, ops and commands as files in this directory")
    p.add_argument("--name", default="")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keys", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--op-timeout", type=float, default=20.0)
    p.add_argument("--pause", type=float, default=0.05, help="longest pause between one thread's calls")
    args = p.parse_args()
    process_id = args.process_id if args.process_id is not None else int(os.environ["IFRT_PROCESS_ID"])
    tag = f"{process_id}-{os.getpid()}"
    control = None if args.control is None else args.control / f"cmd-{process_id}.txt"
    stop = threading.Event()
    lines = commands(control, stop)  # from the file's length now: a predecessor's commands are not ours
    out = Out(args.ops or args.control / f"ops-{tag}.jsonl",
              sys.stdout if args.control is None else (args.control / f"rec-{tag}.jsonl").open("a"))
    out.say({"started": os.getpid(), "process_id": process_id, "t": time.monotonic()})
    client = ifrt.Client(args.address, process_id=process_id, num_processes=args.num_processes, timeout=120,
                         transfer=False)
    topology = client.discover()
    client.on_event(lambda e: out.say(event_record(e)), since_topology=True)
    hooked = record_attempts(client)
    out.say({"ready": process_id, "generation": topology.generation, "t": time.monotonic(), "hooked": hooked,
             "pid": os.getpid(), "via": "agent" if os.environ.get("IFRT_AGENT_SOCKET") else "direct"})
    keys = [f"soak/k{i}" for i in range(args.keys)]
    threads = [threading.Thread(target=kv_thread, daemon=True,
                                args=(client, out, f"{args.name or tag}.{i}", keys,
                                      f"{args.seed}/{args.name or tag}/{i}", args.op_timeout, args.pause, stop,
                                      hooked))
               for i in range(args.threads)]
    for t in threads:
        t.start()
    for line in lines:
        command = line.split()
        if not command or command[0] == "stop":
            break
        if command[0] == "startup":
            began = time.monotonic()
            try:
                SoakStartup(client, topology, began + float(command[2])).exchange({"round": int(command[1])})
                out.say({"startup": int(command[1]), "ok": True, "s": time.monotonic() - began})
            except IfrtError as e:
                out.say({"startup": int(command[1]), "ok": False, "s": time.monotonic() - began,
                         "error": f"{type(e).__name__}: {e}"[:500]})
        elif command[0] == "inspect":
            try:
                out.say({"store": inspect(client, topology.generation)})
            except IfrtError as e:
                out.say({"store": None, "error": f"{type(e).__name__}: {e}"[:500]})
    stop.set()
    for t in threads:
        t.join(args.op_timeout + 10)
    client.close()
    out.say({"stopped": process_id})
    return 0


if __name__ == "__main__":
    sys.exit(main())
