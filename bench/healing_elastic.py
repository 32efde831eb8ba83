"""Go on first, grow after, side by side: bench/healing.py's scenarios ``lost`` and ``join`` (``--scenarios elastic``).

``groups`` replica groups of one process each (CPU, gloo, healing_model's job); once all have committed ``WARM``
steps with equal digests, the last group's host is SIGKILLed (ifrt: its ``ifrt run`` agent and its worker; torchft:
its process) and nothing replaces it:

- ``lost``: from the kill until the survivors have committed a step in a group without it, with equal digests
  (``lost_s``), and whether a survivor process was lost;
- ``join``: ``REJOIN_AFTER_S`` after the survivors went on, the lost group is started again (ifrt: its agent, the
  same process id; torchft: its process, the same replica id). From that start until every group, it included,
  has committed the same step with equal digests (``join_s``, bit-identical parameters and momentum), and how many
  steps the survivors did not take meanwhile (``steps_lost``: their step rate without it times that time, less the
  steps they took; ``stall_s``: their longest time without a step).

The ways: ``ifrt``/``ifrt-1s``: a coordinator ``--on-failure elastic --min-processes 1`` at its default 10 s / a
1 s ``--heartbeat-timeout``, one ``ifrt run --recover replace`` agent (no spare) per group on loopback
(``--host-rank R --num-hosts N``), bench/healing_ifrt_worker.py;
``torchft``/``torchft-1s``: torchft 0.2.0's Lighthouse at its default 5 s / a 1 s heartbeat timeout, one Manager per
group (bench/healing_torchft_worker.py), as bench/healing_torchft.py runs them. Every process is started and stopped
here, by pid.

    .venv/bin/python bench/healing_elastic.py [--way ifrt] [--groups 2] [--state-mb 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import healing_ifrt, healing_torchft  # noqa: E402
from bench.healing_model import RECOVER_TIMEOUT, START_TIMEOUT, WARM, secs  # noqa: E402

REJOIN_AFTER_S = 3.0
"""Seconds the survivors step on without the lost group, once they went on, before it starts again."""


def first_equal(parts: list[dict[int, dict]], world: int) -> tuple[int, float] | None:
    """The first step every part reports in a group of ``world`` with equal digests, and when the last reported it."""
    common = set.intersection(*({s for s, r in p.items() if r.get("world") == world} for p in parts))
    for step in sorted(common):
        if len({p[step]["digest"] for p in parts}) == 1:
            return step, max(p[step]["t"] for p in parts)
    return None


def lost_steps(steps: dict[int, dict], since: float, start: float, until: float) -> dict[str, Any]:
    """A survivor's steps (``steps``: by step) while a group started: its rate in [``since``, ``start``) (without
    it), the steps it took in [``start``, ``until``], those it did not take at that rate, its longest gap there."""
    before = sorted(r["t"] for r in steps.values() if since <= r["t"] < start)
    during = sorted(r["t"] for r in steps.values() if start <= r["t"] <= until)
    rate = (len(before) - 1) / (before[-1] - before[0]) if len(before) > 1 and before[-1] > before[0] else None
    edges = [start, *during, until]
    return {"rate_per_s": rate and round(rate, 1), "steps_taken": len(during),
            "steps_lost": None if rate is None else max(0, round(rate * (until - start)) - len(during)),
            "stall_s": secs(max(b - a for a, b in itertools.pairwise(edges)))}


def wait(probe, what: str, alive, timeout: float):
    """``probe()`` once it is not None; TimeoutError naming ``what`` after ``timeout`` or once ``alive()`` is False."""
    deadline = time.monotonic() + timeout
    while (found := probe()) is None:
        if not alive() or time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s or a survivor exited")
        time.sleep(0.005)
    return found


def measure(result: dict, groups: int, steps, alive, kill, start_again) -> None:
    """The trial both ways share. ``steps()``: each group's committed steps (by step) of its live process, the
    last group's last; ``alive()``: every survivor runs; ``kill()``: the last group's host SIGKILLed (None: it has
    not started, ``join`` alone); ``start_again()``: it starts (again). Fills ``result``."""
    first = groups if kill else groups - 1
    wait(lambda: (len(min(parts := steps()[:first], key=len)) >= WARM and first_equal(parts, first)) or None,
         f"{WARM} steps in every group", alive, START_TIMEOUT)
    t_lost = time.time()
    if kill:
        kill()
        step, t_lost_done = wait(lambda: first_equal([{s: r for s, r in p.items() if r["t"] >= t_lost}
                                                      for p in steps()[:-1]], groups - 1),
                                 "the survivors' step without the lost group", alive, RECOVER_TIMEOUT)
        result.update(lost_s=secs(t_lost_done - t_lost), lost_step=step)
        t_lost = t_lost_done
    time.sleep(REJOIN_AFTER_S)
    t_start = time.time()
    start_again()

    def after_start() -> list[dict[int, dict]]:
        return [{s: r for s, r in p.items() if r["t"] >= t_start} for p in steps()]

    step, t_joined = wait(lambda: first_equal(after_start(), groups), "every group on an equal step with the "
                          "newcomer", alive, RECOVER_TIMEOUT)
    parts = after_start()
    common = min(set.intersection(*(set(p) for p in parts)))
    result.update(join_s=secs(t_joined - t_start), join_step=step, equal=len({p[common]["digest"] for p in parts}) == 1,
                  **lost_steps(steps()[0], t_lost, t_start, t_joined))
    wait(lambda: len([s for s in steps()[-1] if s > step]) >= 2 or None, "steps after the join", alive, 30)


def trial_result(way: str, groups: int, round: int, state_mb: int) -> dict:
    """One trial's record, every key present."""
    return {"way": way, "scenario": "elastic", "groups": groups, "state_mb": state_mb, "round": round, "lost_s": None,
            "join_s": None, "steps_lost": None, "stall_s": None, "survivor_lost": False, "equal": None, "error": None}


def run_ifrt(groups: int, round: int, heartbeat_s: float | None = None, state_mb: int = 10) -> dict:
    """One trial on ifrt (see the module's doc); ``heartbeat_s`` None: the coordinator's default heartbeat
    timeout (10 s)."""
    from coordinator.local import LocalCoordinator

    way = "ifrt" if heartbeat_s is None else f"ifrt-{heartbeat_s:g}s"
    result = trial_result(way, groups, round, state_mb=state_mb)
    agents: list[healing_ifrt.Agent] = []
    try:
        with LocalCoordinator("--on-failure", "elastic", "--min-processes", "1",
                              *(["--heartbeat-timeout", str(heartbeat_s)] if heartbeat_s else []),
                              num_processes=groups, log_level="WARNING") as coordinator:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "BENCH_", "MASTER_"))}
            env.update(IFRT_COORDINATOR=coordinator.address, IFRT_CPU_DEVICE_COUNT="1", BENCH_STATE_MB=str(state_mb),
                       BENCH_MAX_SECONDS="300", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))

            def agent(h: int) -> healing_ifrt.Agent:
                agents.append(healing_ifrt.Agent(h, env, restarts=0, args=[
                    "--nproc-per-host", "1", "--host-rank", str(h), "--num-hosts", str(groups), "--recover",
                    "replace"]))
                return agents[-1]

            hosts = [agent(h) for h in range(groups)]
            survivors = hosts[:-1]

            def kill() -> None:
                victim = hosts[-1]
                worker = next(r["pid"] for r in victim.records if "pid" in r)
                for pid in (victim.process.pid, worker):
                    os.kill(pid, signal.SIGKILL)
                victim.process.wait()

            def start_again() -> None:
                hosts[-1] = agent(groups - 1)

            def alive() -> bool:  # a survivor's agent ended, or started its process anew
                for a in survivors:
                    if a.process.poll() is not None or len({r["pid"] for r in a.records if "pid" in r}) > 1:
                        result["survivor_lost"] = True
                        return False
                return True

            measure(result, groups, lambda: [a.steps(0) for a in hosts], alive, kill, start_again)
            joined, began = hosts[-1].event("joined"), hosts[-1].event("start")  # start: once it registered
            if joined and began and (healed := joined["healed"]):
                result.update(newcomer_registered_s=secs(began["t"] - hosts[-1].started),
                              newcomer_ready_s=secs(joined["t"] - hosts[-1].started), heal_s=secs(healed["seconds"]),
                              healed_from=healed["source"])
    except TimeoutError as e:
        result["error"] = f"{e}: " + " || ".join(" | ".join(a.err[-3:]) for a in agents)[-1500:]
    finally:
        for a in agents:
            a.stop()
    return result


def run_torchft(groups: int, round: int, heartbeat_ms: int | None = None, state_mb: int = 10) -> dict:
    """One trial on torchft (see the module's doc); ``heartbeat_ms`` None: the Lighthouse's default."""
    way = "torchft" if heartbeat_ms is None else f"torchft-{heartbeat_ms / 1000:g}s"
    result = trial_result(way, groups, round, state_mb=state_mb)
    if missing := healing_torchft.available():
        return result | {"error": missing}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFT_", "BENCH_", "MASTER_", "PYTHON"))}
    env.update(TORCHFT_USE_OTEL="false", BENCH_STATE_MB=str(state_mb),
               BENCH_MAX_SECONDS="300", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    children: list[healing_torchft.Child] = []

    def child(command: list[str], **extra: str) -> healing_torchft.Child:
        children.append(healing_torchft.Child(command, dict(env, **extra)))
        return children[-1]

    def job(count: int) -> tuple[healing_torchft.Child, list[healing_torchft.Child | None]]:
        port = healing_torchft.free_port()
        env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{port}"
        lighthouse = child([str(healing_torchft.LIGHTHOUSE), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
                            "--join_timeout_ms", "10000", "--quorum_tick_ms", "100"]
                           + (["--heartbeat_timeout_ms", str(heartbeat_ms)] if heartbeat_ms else []))
        return lighthouse, [child(worker, BENCH_REPLICA=str(g)) for g in range(count)]

    worker = [str(healing_torchft.PYTHON), str(healing_torchft.WORKER)]
    lighthouse, hosts = job(groups)

    def kill() -> None:
        hosts[-1].stop()  # SIGKILL to its pid

    def start_again() -> None:
        hosts[-1] = child(worker, BENCH_REPLICA=str(groups - 1))

    def alive() -> bool:
        if lost := [c for c in [lighthouse, *hosts[:-1]] if not c.alive()]:
            result["survivor_lost"] = result["survivor_lost"] or lost != [lighthouse]
            return False
        return True

    def steps() -> list[dict[int, dict]]:
        return [c.steps() if c else {} for c in hosts]

    try:
        try:
            measure(result, groups, steps, alive, kill, start_again)
        except TimeoutError as e:
            if not result["survivor_lost"] or result["lost_s"] is not None:
                raise
            # The survivors went with the lost group: the join measured apart, in a new job whose last group starts
            # late (torchft takes a new group in natively).
            result["lost_error"] = f"{e}: " + " || ".join(c.tail(2) for c in children)[-600:]
            result["join_mode"] = "late start"
            for c in children:
                c.stop()
            lighthouse, hosts = job(groups - 1)
            hosts.append(None)
            measure(result, groups, steps, alive, None, start_again)
        if start := hosts[-1].event("start"):
            result["newcomer_imports_s"] = secs(start["t"] - hosts[-1].started)
    except TimeoutError as e:
        result["error"] = f"{e}: " + " || ".join(c.tail(3) for c in children)[-1500:]
    finally:
        for c in children:
            c.stop()
    return result


def summary(results: list[dict]) -> dict:
    """Per way, scenario (lost, join) and group count: trials, how many measured it, the median/min/max seconds,
    for the join the steps lost and the median stall, and how many joins were a late start; survivors lost per way."""
    rows: dict[tuple[str, str, int], list[dict]] = {}
    for r in results:
        for scenario in ("lost", "join"):
            rows.setdefault((r["way"], scenario, r["groups"]), []).append(r)
    out: dict[str, Any] = {}
    for (way, scenario, groups), trials in rows.items():
        got = [r for r in trials if r.get(f"{scenario}_s") is not None]
        seconds = [r[f"{scenario}_s"] for r in got]
        row: dict[str, Any] = {"trials": len(trials), "measured": len(got)}
        if seconds:
            row.update(median_s=round(statistics.median(seconds), 3), min_s=min(seconds), max_s=max(seconds))
        if scenario == "join" and got:
            row.update(steps_lost=sorted(r["steps_lost"] for r in got if r["steps_lost"] is not None),
                       stall_median_s=round(statistics.median(r["stall_s"] for r in got), 3),
                       late_start=sum(bool(r.get("join_mode")) for r in got))
        out.setdefault(way, {}).setdefault(scenario, {})[str(groups)] = row
    lost = {w: f"{sum(bool(r['survivor_lost']) for r in results if r['way'] == w)}/"
               f"{sum(r['way'] == w for r in results)}" for w in out}
    return {"summary": "elastic", "by_way": out, "survivors_lost": lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--way", default="ifrt", choices=("ifrt", "ifrt-1s", "torchft", "torchft-1s"))
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--state-mb", type=int, default=10)
    args = parser.parse_args()
    if args.way.startswith("ifrt"):
        print(json.dumps(run_ifrt(args.groups, 0, 1.0 if args.way == "ifrt-1s" else None, args.state_mb)), flush=True)
    else:
        print(json.dumps(run_torchft(args.groups, 0, 1000 if args.way == "torchft-1s" else None, args.state_mb)),
              flush=True)


if __name__ == "__main__":
    main()
