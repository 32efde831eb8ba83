"""One process of a partition trial (bench/partition_nemeses.py), run inside a host's network namespace: discovers,
records every event, runs key-value client threads that record each call with the replica that answered it, and, as
told, sends or receives transfer frames or retries an increment whose reply a cut dropped.

    partition_worker.py --address A,B --process-id 0 --num-processes 3 --ops FILE [--role kv|recv|send]

Records go to stdout as JSON lines (``started``, ``ready``, ``event``, ``frames``, ``probe``, ``stopped``); commands
come on stdin, one per line: ``stop``, ``incr-lost KEY`` (an increment with a fixed request id, one attempt of 1.5 s:
its reply is meant to be cut), ``incr-retry KEY`` (the same request again, through the client's own retry loop),
``flood N BYTES`` (N sets of BYTES each, fresh request ids), ``get KEY``, ``pin ADDRESS`` and ``unpin`` (the
key-value calls go to that replica only, or as the client picks). Each key-value call is two lines in
``--ops`` as bench/soak_worker.py writes them, the return with ``via``: the replica whose answer it was.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import soak_worker
from soak_worker import Out, definite, event_record, kv_call, record_attempts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ifrt
from ifrt._generated import coordinator_pb2 as pb
from ifrt.errors import IfrtError
from ifrt.ids import LOCAL_ID_BITS

KINDS = ("get", "set", "cas", "incr", "delete")
WEIGHTS = {"mixed": (45, 20, 10, 20, 5), "reads": (1, 0, 0, 0, 0)}
"""Each kind's share of a thread's calls: a mixed load, or reads only (a reader that stays on whichever replica
answers it)."""
OLD, NEW = 1, 2
"""Frame tags: process 1's first incarnation, and the one that replaced it."""
_via = threading.local()
"""The replica that answered this thread's last call."""


def record_via(client: ifrt.Client) -> None:
    """Notes in ``_via`` which replica answered each call of this thread: the connection's ``answered`` hook, and its
    ``failed`` one for an answer that is an error (KeyExists, ...)."""
    connection = client._connection
    answered, failed = connection.answered, connection.failed

    def noted(target: str) -> None:
        _via.target = target
        answered(target)

    def refused(error: Any, target: str, *args: Any, **kwargs: Any) -> Any:
        if hasattr(error, "code") and error.code().name not in soak_worker.RETRIED:
            _via.target = target
        return failed(error, target, *args, **kwargs)

    connection.answered, connection.failed = noted, refused
    current = connection.current
    connection.current = lambda: (_pinned[0] if _pinned and getattr(_via, "kv", False) else current())


_pinned: list[str] = []
"""``pin ADDRESS``: the replica this process's key-value calls go to, whatever answers (its session is left alone):
a writer that reaches a new leader at once."""


def kv_thread(client: ifrt.Client, out: Out, name: str, keys: list[str], seed: str, timeout: float, pause: float,
              stop: threading.Event, hooked: bool, mix: str = "mixed") -> None:
    """Random calls on ``keys`` until ``stop``, each recorded with call and return times, outcome and ``via``."""
    rng = random.Random(seed)
    seen: dict[str, str] = {}
    n = 0
    _via.kv = True
    while not stop.is_set():
        key, kind = rng.choice(keys), rng.choices(KINDS, WEIGHTS[mix])[0]
        value = str(rng.randrange(10**9, 10**10))
        args: list[Any] = {"get": [], "delete": [], "incr": [rng.choice((1, 2, 5))],
                           "set": [value, rng.random() < 0.75],
                           "cas": [seen.get(key, "") if rng.random() < 0.8 else "", value]}[kind]
        op_id, n = f"{name}.{n}", n + 1
        soak_worker._attempts.errors = []
        _via.target = None
        out.op({"id": op_id, "kind": kind, "key": key, "args": args, "call": time.monotonic()})
        ret: dict[str, Any] = {"id": op_id}
        try:
            result = kv_call(client, kind, key, args, timeout)
            ret.update(outcome="ok", result=result, via=_via.target)
            if kind in ("get", "cas") and result is not None:
                seen[key] = result
            elif kind == "incr" and result != "invalid":
                seen[key] = str(result)
        except IfrtError as e:
            attempts = [*soak_worker._attempts.errors, (e.status, str(e))]
            sure = hooked and all(definite(status, details) for status, details in attempts)
            ret.update(outcome="refused" if sure else "unknown", error=f"{type(e).__name__}: {e}"[:500])
        ret["ret"] = time.monotonic()
        if ret.get("outcome") == "ok" and soak_worker._attempts.errors:
            ret["retried_after_unknown"] = not all(definite(s, d) for s, d in soak_worker._attempts.errors)
        out.op(ret)
        stop.wait(rng.uniform(0, pause))


def sender(client: ifrt.Client, out: Out, tag: int, stop: threading.Event, every: float) -> None:
    """Sends [tag, seq, sent-at ns] to process 0's first device every ``every`` seconds; failures are counted."""
    topology = client.discover()
    src = topology.local_devices[0].id
    sent = failed = 0
    last_error = ""
    channels = client.channels()
    while not stop.wait(every):
        try:
            channels.send(np.array([tag, sent + failed, time.monotonic_ns()], dtype=np.int64), 0, src)
            sent += 1
        except (IfrtError, OSError) as e:
            failed += 1
            last_error = f"{type(e).__name__}: {e}"[:300]
    out.say({"frames_sent": sent, "send_failed": failed, "last_send_error": last_error, "tag": tag})


def receiver(client: ifrt.Client, out: Out, stop: threading.Event) -> None:
    """Receives process 1's frames (its first device) until ``stop``; records each as [tag, seq, sent, received]."""
    channels = client.channels()
    src = 1 << LOCAL_ID_BITS
    got: list[list[float]] = []
    while not stop.is_set():
        try:
            a = channels.recv(src, timeout=0.3)
        except IfrtError:
            continue
        got.append([int(a[0]), int(a[1]), a[2] / 1e9, time.monotonic()])
    out.say({"frames": got})


def request_id(client: ifrt.Client) -> str:
    """A new request id as the client's own calls take it (ordered where the client orders them)."""
    ordered = getattr(client, "_request_id", None)
    return ordered() if ordered is not None else uuid.uuid4().hex


def probe(client: ifrt.Client, command: list[str], request: dict[str, Any]) -> dict[str, Any]:
    """``incr-lost``/``incr-retry``/``flood``/``get``: the partition trial's retry probe, as plain values."""
    began = time.monotonic()
    try:
        if command[0] == "incr-lost":
            request["incr"] = pb.KeyValueIncrementRequest(client_uid=client.client_uid, key=command[1], amount=1,
                                                          request_id=request_id(client))
            target = client._connection.current()
            try:  # one attempt: a cut drops its reply (the coordinator applies it all the same)
                answer = client._connection.stub(target).KeyValueIncrement(request["incr"], timeout=1.5)
                return {"answer": answer.value, "via": target}
            except Exception as e:
                return {"answer": None, "via": target, "error": f"{type(e).__name__}"}
        if command[0] == "incr-retry":
            answer = client._unary("KeyValueIncrement", lambda _: request["incr"], time.monotonic() + 20,
                                   what="the retried increment")
            return {"answer": answer.value}
        if command[0] == "flood":
            for i in range(int(command[1])):
                client.kv_set(f"flood/{i}", os.urandom(int(command[2])), allow_overwrite=True, timeout=30)
            return {"flooded": int(command[1])}
        if command[0] == "get":
            value = client.kv_try_get(command[1], timeout=20)
            return {"value": None if value is None else value.decode()}
    except Exception as e:  # reported: the trial reads it
        return {"error": f"{type(e).__name__}: {e}"[:300], "s": time.monotonic() - began}
    return {"error": f"unknown command {command}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--ops", type=Path, required=True)
    p.add_argument("--role", choices=("kv", "recv", "send"), default="kv")
    p.add_argument("--tag", type=int, default=OLD, help="with --role send: the tag of this incarnation's frames")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keys", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--op-timeout", type=float, default=20.0)
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--mix", choices=sorted(WEIGHTS), default="mixed")
    args = p.parse_args()
    name = f"{args.process_id}-{os.getpid()}"
    out = Out(args.ops)
    out.say({"started": os.getpid(), "t": time.monotonic()})
    client = ifrt.Client(args.address, process_id=args.process_id, num_processes=args.num_processes, timeout=60,
                         transfer=args.role != "kv")
    topology = client.discover()
    client.on_event(lambda e: out.say(event_record(e)), since_topology=True)
    hooked = record_attempts(client)
    record_via(client)
    out.say({"ready": args.process_id, "generation": topology.generation, "t": time.monotonic(), "pid": os.getpid()})
    stop = threading.Event()
    keys = [f"part/k{i}" for i in range(args.keys)]
    threads = [threading.Thread(target=kv_thread, daemon=True, args=(
        client, out, f"{name}.{i}", keys, f"{args.seed}/{name}/{i}", args.op_timeout, args.pause, stop, hooked,
        args.mix))
        for i in range(args.threads)]
    if args.role == "send":
        threads.append(threading.Thread(target=sender, args=(client, out, args.tag, stop, 0.1), daemon=True))
    elif args.role == "recv":
        threads.append(threading.Thread(target=receiver, args=(client, out, stop), daemon=True))
    for t in threads:
        t.start()
    request: dict[str, Any] = {}
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "stop":
            break
        if command[0] in ("pin", "unpin"):
            _pinned[:] = command[1:2]
            continue
        out.say({"probe": command[0], **probe(client, command, request), "t": time.monotonic()})
    stop.set()
    for t in threads:
        t.join(args.op_timeout + 5)
    client.close()
    out.say({"stopped": args.process_id})
    return 0


if __name__ == "__main__":
    sys.exit(main())
