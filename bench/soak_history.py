"""What bench/failover_soak.py's workers recorded (bench/soak_worker.py), read back and judged: the key-value calls
as per-key histories for bench/linearizable.py, and the job events each process received (exactly once, in order)."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from linearizable import EXISTS, INVALID, OK, UNKNOWN, Op, check, linearizable

JOB_EVENTS = ("ProcessFailed", "ProcessRestarted", "ProcessLeft", "TopologyChanged", "JobWhole", "PreemptionNotice")
"""The events every process of the job is sent alike; CoordinatorLost and CoordinatorRestored are each process's
own."""
OWN_KINDS = ("ProcessFailed", "ProcessRestarted", "ProcessLeft")
"""A process's events about itself: not sent to its own later incarnations."""


def lines(path: Path) -> Iterable[dict[str, Any]]:
    """The JSON lines of ``path``; a line cut short by a kill is skipped."""
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue


def as_op(call: dict[str, Any], ret: dict[str, Any] | None) -> Op:
    """A recorded call as the checker's Op; without a known outcome, one that may apply any time after its call."""
    kind, args = call["kind"], call["args"]
    typed = tuple(a.encode() if isinstance(a, str) else a for a in args)  # values are decimal text
    if ret is None or ret["outcome"] != "ok":
        return Op(kind, call["key"], typed, call["call"], math.inf, UNKNOWN, call["id"])
    result = ret["result"]
    if kind in ("get", "cas"):
        result = None if result is None else result.encode()
    elif kind == "set":
        result = OK if result == "ok" else EXISTS
    elif kind == "incr" and result == "invalid":
        result = INVALID
    return Op(kind, call["key"], typed, call["call"], ret["ret"], result, call["id"])


def key_values(paths: Iterable[Path], budget: int) -> dict[str, Any]:
    """Every recorded call counted by outcome, the calls' durations, and each key's linearizability verdict."""
    calls: dict[str, dict[str, Any]] = {}
    rets: dict[str, dict[str, Any]] = {}
    for path in paths:
        for record in lines(path):
            (rets if "ret" in record else calls)[record["id"]] = record
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    ops, took = [], []
    for op_id, call in calls.items():
        ret = rets.get(op_id)
        outcome = "in_flight_when_killed" if ret is None else ret["outcome"]
        counts[outcome] += 1
        if ret is not None and ret.get("retried_after_unknown"):  # an earlier attempt may have applied it
            counts[f"retried_{call['kind']}"] += 1
        if outcome != "refused":  # refused for sure: never applied, so no part of the history
            ops.append(as_op(call, ret))
        if ret is not None and outcome == "ok":
            took.append(ret["ret"] - call["call"])
        elif ret is not None:
            errors[f"{outcome}: {ret['error'].split(':')[0]}"] += 1
    verdicts = check(ops, budget=budget)
    violations = {key: first_violation([op for op in ops if op.key == key], budget)
                  for key, verdict in verdicts.items() if verdict is False}
    return {"calls": len(calls), "ok": counts["ok"], "failed_unknown": counts["unknown"],
            "failed_definite": counts["refused"], "in_flight_when_killed": counts["in_flight_when_killed"],
            "failed_although_store_held_answer": counts["unknown"] + counts["refused"],
            "errors": dict(errors.most_common(6)),
            "ok_after_a_retry_of_unknown_outcome": {k[len("retried_"):]: n for k, n in sorted(counts.items())
                                                    if k.startswith("retried_")},
            "ok_seconds_p50": round(statistics.median(took), 4) if took else None,
            "ok_seconds_max": round(max(took), 3) if took else None,
            "keys": len(verdicts), "linearizable_keys": sum(v is True for v in verdicts.values()),
            "verdicts": {k: {True: "linearizable", False: "NOT linearizable", None: "undecided"}[v]
                         for k, v in verdicts.items()},
            "first_violations": violations}


def first_violation(ops: list[Op], budget: int, shown: int = 12) -> list[str]:
    """The last ``shown`` calls before the earliest moment by which a key's history stops being linearizable (found
    by bisecting its prefixes: calls still open at the cut count as of unknown outcome), as text to read, times in
    seconds from that moment."""
    def prefix(cut: float) -> list[Op]:
        return [op if op.ret <= cut else Op(op.kind, op.key, op.args, op.call, math.inf, UNKNOWN, op.client)
                for op in ops if op.call < cut]

    good, bad = min(op.call for op in ops), max(op.call for op in ops) + 1
    while bad - good > 1e-4:
        mid = (good + bad) / 2
        good, bad = (good, mid) if linearizable(prefix(mid), budget=budget) is False else (mid, bad)
    window = sorted(prefix(bad), key=lambda op: op.call)[-shown:]
    return [f"{op.client} {op.kind}{list(op.args)} [{op.call - bad:+.4f}, {op.ret - bad:+.4f}] -> {op.result}"
            for op in window]


def identity(event: dict[str, Any]) -> tuple:
    """What tells one job event from another of its kind."""
    kind = event["event"]
    if kind == "ProcessRestarted":
        return kind, event["process_id"], event["incarnation"]
    if kind == "JobWhole":
        return kind, event["generation"], tuple(map(tuple, event["replaced"]))
    if kind == "TopologyChanged":
        return kind, event["generation"]
    return kind, event["process_id"]


def delivery(streams: dict[int, list[dict[str, Any]]], expected: dict[int, tuple[int, int]],
             partial: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Whether every observer (a process never killed) received the same job events, each once, in order; whether they
    are the events the soak caused: for each killed process (``expected``: its kills and restarts), a ProcessFailed
    per kill and a ProcessRestarted per restart, alternating, each restart's incarnation one past the last (a
    replacement registered twice shows as a second ProcessRestarted or a skipped incarnation); and whether each
    killed incarnation's events (``partial``, by name) came in the observers' order, none twice."""
    seqs = {p: [identity(e) for e in s if e["event"] in JOB_EVENTS] for p, s in streams.items()}
    tally = Counter(tuple(s) for s in seqs.values())
    reference = list(max(tally, key=lambda s: (tally[s], len(s)))) if tally else []
    lost = duplicated = 0
    reordered = []
    for p, seq in seqs.items():
        mine, theirs = Counter(seq), Counter(reference)
        lost += sum((theirs - mine).values())
        duplicated += sum((mine - theirs).values())
        if sorted(seq) == sorted(reference) and seq != reference:
            reordered.append(p)
    unique = Counter(e for e in reference if e[0] != "ProcessFailed")  # the rest carry an incarnation or generation
    duplicated += sum(n - 1 for n in unique.values())
    killed = {p: killed_events(reference, p, kills, restarts) for p, (kills, restarts) in sorted(expected.items())}
    others = sorted({e for e in reference if e[0] in ("ProcessFailed", "ProcessLeft") and e[1] not in expected})
    out_of_order = [name for name, s in partial.items()
                    if not in_order([identity(e) for e in s if e["event"] in JOB_EVENTS],
                                    caught_up(reference, int(name.split("/")[0])))]
    return {"observers": len(streams), "job_events": len(reference), "same_at_every_observer": len(tally) <= 1,
            "lost": lost, "duplicated": duplicated, "reordered_at": reordered, "killed": killed,
            "failed_events_match_kills": all(k["failed_events"] == k["kills"] for k in killed.values()),
            "restarted_events_match_restarts": all(k["restarted_events"] == k["restarts"] for k in killed.values()),
            "alternate": all(k["alternate"] for k in killed.values()),
            "replacements_registered_more_than_once": sum(k["registered_more_than_once"] for k in killed.values()),
            "others_declared_failed_or_left": [list(e) for e in others],
            "killed_incarnations": len(partial), "killed_incarnations_out_of_order": out_of_order,
            "coordinator_lost_per_observer": {p: sum(e["event"] == "CoordinatorLost" for e in s)
                                              for p, s in streams.items()}}


def killed_events(reference: list[tuple], process_id: int, kills: int, restarts: int) -> dict[str, Any]:
    """A killed process's ProcessFailed and ProcessRestarted among the reference's events, against its kills and
    restarts."""
    seq = [e for e in reference if e[0] in ("ProcessFailed", "ProcessRestarted") and e[1] == process_id]
    incarnations = [e[2] for e in seq if e[0] == "ProcessRestarted"]
    steps = [b - a for a, b in zip([0, *incarnations], incarnations, strict=False)]
    return {"kills": kills, "failed_events": sum(e[0] == "ProcessFailed" for e in seq), "restarts": restarts,
            "restarted_events": len(incarnations),
            "alternate": all(e[0] == ("ProcessFailed", "ProcessRestarted")[i % 2] for i, e in enumerate(seq)),
            "registered_more_than_once": max(0, len(incarnations) - restarts) + sum(step > 1 for step in steps)}


def caught_up(reference: list[tuple], process_id: int) -> list[tuple]:
    """The reference's events as an incarnation of ``process_id`` is sent them: its own failures and restarts left
    out, and itself out of each JobWhole's replaced processes (as the coordinator leaves them out of a process's own
    catch-up; what it hears after its start is the same less itself)."""
    out = []
    for e in reference:
        if e[0] in OWN_KINDS and e[1] == process_id:
            continue
        if e[0] == "JobWhole":
            e = (e[0], e[1], tuple(r for r in e[2] if r[0] != process_id))
        out.append(e)
    return out


def in_order(seq: list[tuple], reference: list[tuple]) -> bool:
    """Whether ``seq`` is a subsequence of ``reference``: its events all there, in that order, none twice."""
    rest = iter(reference)
    return all(any(e == r for r in rest) for e in seq)
