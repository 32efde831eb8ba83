"""A worker for tests/test_agent_calls.py: ``python tests/agent_calls_worker.py SCENARIO``.

Its first line is ``started process P pid X uid U``; then, once its calls are done, ``result P JSON``; it exits 0 once
the file ``AGENT_CALLS_RELEASE`` names exists (the test is done looking at it). Scenarios:
  calls  key-value set, increment, compare-set, listing and reads, a barrier of every process, a get that waits for
         a key the last process sets a second later, eight waiting gets at once on the raw link (no retry: a call
         refused for load would show), 6 MB set in one call and read back whole, the errors KeyExists and
         BarrierTimeout, and a call with this worker's own secret for the next process's client uid
  secured  a set, a get, an increment and a barrier (the coordinator asks for a token and speaks TLS)
  failover  waits for the release file (the test has killed the leader), then increments a key, sets one, meets the
         other workers at a barrier and reads the sum: every call made while no replica leads
  lost   with a failover window of 2 s, waits for the release file (the test has killed the coordinator), then
         sets a key: the error it gets, its class and whether it is retryable
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import grpc

WAIT_S = 60.0
BIG = 1_000_000
"""Bytes of each of the six large values (below the coordinator's --kv-max-value-bytes, 1 MiB)."""


def released() -> None:
    path = os.environ["AGENT_CALLS_RELEASE"]
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def refusal(call) -> dict:
    """How a call that must fail failed: its error class, status and message as the worker's client reads them."""
    from ifrt.errors import IfrtError

    try:
        call()
    except IfrtError as e:
        return {"class": type(e).__name__, "status": e.status, "retryable": e.retryable, "message": str(e)}
    return {"class": None}


def raw_refusal(call) -> dict:
    """How a call on the raw link (no retry) failed: its gRPC status, details and ``ifrt-error`` trailer."""
    from ifrt.errors import ERROR_TRAILER

    try:
        call()
    except grpc.RpcError as e:
        return {"code": e.code().name, "details": e.details(),
                "trailer": dict(e.trailing_metadata() or ()).get(ERROR_TRAILER)}
    return {"code": "OK"}


def calls(client, p: int, n: int) -> dict:
    from ifrt._generated import coordinator_pb2 as pb

    client.kv_set(f"k/{p}", f"v{p}".encode())
    client.kv_set(f"uid/{p}", client.client_uid.encode())
    client.kv_increment("count")
    client.kv_compare_set("cas", b"", f"{p}".encode())
    link = client._link.stub(client._link.current())
    waits: list[bytes | str] = []

    def wait_raw() -> None:  # one attempt, as the agent answers it
        try:
            waits.append(link.KeyValueGet(pb.KeyValueGetRequest(client_uid=client.client_uid, key="go",
                                                                wait_ms=20_000), timeout=30).value)
        except grpc.RpcError as e:
            waits.append(f"{e.code().name}: {e.details()}")

    threads = [threading.Thread(target=wait_raw) for _ in range(8)]
    for t in threads:
        t.start()
    client.barrier("all-set", WAIT_S)
    result: dict = {"keys": {k: v.decode() for k, v in client.kv_dir("k/").items()},
                    "count": int(client.kv_get("count", WAIT_S)), "cas": client.kv_try_get("cas").decode(),
                    "many": [v.decode() if v is not None else None
                             for v in client.kv_multi_get([f"k/{i}" for i in range(n)] + ["k/none"])]}
    if p == 0:
        began = time.monotonic()
        result["late"] = client.kv_get("late", WAIT_S).decode()
        result["late_waited_s"] = round(time.monotonic() - began, 2)
        client.kv_set("go", b"1")
    if p == n - 1:
        time.sleep(1.0)
        client.kv_set("late", b"here")
    for t in threads:
        t.join(WAIT_S)
    result["waits"] = [w.decode() if isinstance(w, bytes) else w for w in waits]
    if p == 0:
        client.kv_multi_set([(f"big/{i}", bytes([i]) * BIG) for i in range(6)])
    client.barrier("big-set", WAIT_S)
    big = client.kv_dir("big/")
    result["big_dir"] = sorted((k, len(v), v[:1].hex()) for k, v in big.items())
    result["big_many"] = [len(v or b"") for v in client.kv_multi_get([f"big/{i}" for i in range(6)])]
    result["exists"] = refusal(lambda: client.kv_set(f"k/{p}", b"another"))
    result["barrier"] = refusal(lambda: client.barrier(f"alone/{p}", 0.5, process_ids=[p, (p + 1) % n]))
    other = client.kv_get(f"uid/{(p + 1) % n}", WAIT_S).decode()
    result["as_other"] = raw_refusal(lambda: link.KeyValueSet(
        pb.KeyValueSetRequest(client_uid=other, key=f"stolen/{p}", value=b"x"), timeout=10))
    client.barrier("done", WAIT_S)  # every process read the large values
    result["deleted"] = client.kv_delete("big/", prefix=True) if p == 0 else None
    return result


def main(scenario: str) -> None:
    if scenario == "lost":
        os.environ["IFRT_FAILOVER_WINDOW"] = "2"
    import ifrt

    client = ifrt.Client(transfer=False)
    topology = client.discover()
    p, n = topology.process_id, len(topology.processes)
    print(f"started process {p} pid {os.getpid()} uid {client.client_uid}", flush=True)
    if scenario == "calls":
        result = calls(client, p, n)
    elif scenario == "failover":
        released()
        began = time.monotonic()
        client.kv_increment("n")
        client.kv_set(f"after/{p}", b"1")
        client.barrier("after", WAIT_S)
        result = {"n": int(client.kv_get("n", WAIT_S)), "keys": sorted(client.kv_dir("after/")),
                  "took_s": round(time.monotonic() - began, 2)}
    elif scenario == "secured":
        client.kv_set(f"s/{p}", b"secured")
        result = {"get": client.kv_get(f"s/{p}", WAIT_S).decode(), "count": client.kv_increment("s/count")}
        client.barrier("secured", WAIT_S)
    else:
        released()
        began = time.monotonic()
        result = refusal(lambda: client.kv_set("after", b"x", timeout=1.0))
        result["took_s"] = round(time.monotonic() - began, 2)
    print(f"result {p} {json.dumps(result)}", flush=True)
    if scenario != "failover":
        released()
    if scenario != "lost":
        client.close()
    sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
