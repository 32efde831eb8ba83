"""One driver process of the discovery benchmark by agent: simulates the ``ifrt run`` agents of many hosts.

Started by bench/discovery.py (``--by agent``). Each simulated agent has its own channel (one connection per host)
and carries ``--processes-per-host`` workers (bench/sim_agent.py). Protocol on stdin/stdout, one JSON line each, as
bench/ifrt_driver.py's with one step more: ``{"ready": ...}`` once the channels exist; on a ``join`` line every agent
joins the job (its watch stays open) and ``{"joined": ...}`` follows; on ``go`` every agent registers its host,
``{"received": ...}`` once all hold an answer, then the result (per process: when its agent sent, when it held the
topology; each worker's answer checked as ifrt_driver checks one). The channels close on ``exit`` (or end of stdin).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import threading
import time
from collections import Counter

from content import Cluster
from content import add_arguments as add_content_arguments
from ifrt_driver import Outcome, emit, emit_results, guard_memory
from sim_agent import SimAgent, hosts


async def stdin_line() -> str:
    return (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()


async def register(agent: SimAgent, outcomes: list[Outcome], deadline: float) -> None:
    """One host: RegisterHost until complete; each of its workers' outcome gets its answer (or the error)."""
    sent = time.monotonic()
    for o in outcomes:
        o.sent = sent
    try:
        await agent.register(deadline)
    except Exception as e:  # reported per worker, as ifrt_driver reports a process
        for o in outcomes:
            o.error = f"{type(e).__name__}: {e}"[:300]
        return
    received = time.monotonic()
    for i, o in enumerate(outcomes):
        o.received, o.answer, o.attempts = received, agent.worker_answer(i), agent.attempts


async def run(address: str, first: int, count: int, cluster: Cluster, per_host: int, timeout: float) -> None:
    agents = [SimAgent(address, cluster, h, per_host) for h in hosts(first, count, per_host)]
    outcomes = [[Outcome(a.first + i) for i in range(per_host)] for a in agents]
    emit({"ready": count})
    if await stdin_line() != "join":
        return
    started = time.monotonic()
    await asyncio.gather(*(a.join() for a in agents))
    emit({"joined": time.monotonic(), "join_s": time.monotonic() - started})
    if await stdin_line() != "go":
        return
    cpu0 = time.process_time()
    deadline = time.monotonic() + timeout
    await asyncio.gather(*(register(a, o, deadline) for a, o in zip(agents, outcomes, strict=True)))
    emit({"received": time.monotonic()})
    every = [o for host in outcomes for o in host]
    emit_results(every, sum(a.attempts for a in agents), [e for a in agents for e in a.retried], cpu0,
                 answers=dict(Counter(hashlib.sha256(a.answer.answer).hexdigest() for a in agents
                                      if a.answer.answer)))
    await stdin_line()  # connections (and the agents' watches) stay up until "exit"
    await asyncio.gather(*(a.close() for a in agents))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--address", required=True)
    p.add_argument("--first", type=int, required=True, help="first simulated process id (a host's first)")
    p.add_argument("--count", type=int, required=True, help="how many simulated processes (whole hosts)")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--devices", type=int, required=True, help="devices per process")
    p.add_argument("--processes-per-host", type=int, default=8, help="workers of one agent (default %(default)s)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds until every process holds the topology")
    p.add_argument("--max-rss-mib", type=int, default=6144, help="exit if resident memory passes this (default "
                                                                 "%(default)s)")
    add_content_arguments(p)
    args = p.parse_args()
    threading.Thread(target=guard_memory, args=(args.max_rss_mib,), daemon=True).start()
    cluster = Cluster(args.content, args.num_processes, args.devices,
                      publish_host_attributes=args.publish_host_attributes)
    asyncio.run(run(args.address, args.first, args.count, cluster, args.processes_per_host, args.timeout))


if __name__ == "__main__":
    main()
