"""The status view: a Status answer as plain values (what ``ifrt status --json`` prints and the coordinator's page
draws), and as text for a terminal. Both sides use it; it imports no client code. In the text, every string a
caller sent (cluster id, hosts, addresses, reasons) is escaped for the terminal (``ifrt.safe_text``)."""

from __future__ import annotations

import time
from typing import Any

from ifrt._generated import coordinator_pb2 as pb
from ifrt.protocol import SLOW_SHARE
from ifrt.safe_text import safe

STANDBY = "standby"
LEADER = "leader"


def to_dict(answer: pb.StatusResponse) -> dict[str, Any]:
    """A Status answer as plain values; counts the standby cannot know are None."""
    state = pb.ClusterPhase.Name(answer.state).removeprefix("CLUSTER_PHASE_").lower()
    known = state != STANDBY
    processes = [_process(p) for p in answer.processes]
    return {
        "cluster_id": answer.cluster_id,
        "state": state,
        "generation": answer.generation if known else None,
        "fingerprint": answer.fingerprint or None,
        "registered": answer.registered if known else None,
        "expected": answer.expected,
        "missing": list(answer.missing_process_ids),
        "missing_count": answer.missing if known else None,
        "failed": [{k: p[k] for k in ("process_id", "host", "host_address", "reason")}
                   for p in processes if p["state"] == "failed"],
        "processes": processes,
        "leader": answer.leader or None,
        "replica": answer.replica,
        "store": answer.store,
        "reason": answer.reason or None,
        "waited_s": round(answer.waited_seconds, 3),
        # to the microsecond: two processes that register within half a millisecond publish in well under 1 ms
        "time_to_publish_s": round(answer.time_to_publish_seconds, 6) if answer.time_to_publish_seconds else None,
        "sessions_open": answer.sessions_open,
        "heartbeat_timeout_s": answer.heartbeat_timeout_seconds,
        "slow_after_s": answer.slow_after_seconds or SLOW_SHARE * answer.heartbeat_timeout_seconds,
        "attempt": answer.attempt,
        "agents": [{"host": a.host, "address": a.address, "workers": a.workers, "spare": a.spare,
                    "joined_unix_s": round(a.joined_unix_s, 3), "watching": a.watching} for a in answer.agents],
    }


def _process(p: pb.ProcessStatus) -> dict[str, Any]:
    return {
        "process_id": p.process_id if p.HasField("process_id") else None,
        "host": p.hostname,
        "host_address": p.host_address,
        "local_rank": p.local_rank,
        "address": p.address,
        "devices": p.devices,
        "state": pb.ProcessPhase.Name(p.phase).removeprefix("PROCESS_PHASE_").lower(),
        "reason": p.reason,
        "incarnation": p.incarnation,
        "heartbeat_age_s": round(p.heartbeat_age_seconds, 3),
        "attached": p.attached,
        "network": list(p.network),
        "pid": p.os_pid or None,
    }


def render(view: dict[str, Any]) -> str:
    """The report as text for a terminal: a summary, then one row per process."""
    view = _shown(view)
    lines = [f"cluster {view['cluster_id']}: {view['state']}"]
    if view["state"] == STANDBY:
        lines.append(f"leader:     {view['leader'] or 'unknown'}")
        lines.append(f"reason:     {view['reason']}")
    else:
        lines.append(f"processes:  {view['registered']}/{view['expected']} registered, "
                     f"{view['sessions_open']} sessions open")
        if view["missing"]:
            lines.append(f"missing:    process ids {view['missing']}")
        elif view["missing_count"]:
            lines.append(f"missing:    {view['missing_count']} process(es) (ids are assigned once all registered)")
        if view["generation"]:
            published = f", {view['time_to_publish_s']:.2f}s after the first registration" if (
                view["time_to_publish_s"] is not None) else ""
            lines.append(f"generation: {view['generation']}{published}")
            lines.append(f"fingerprint: {view['fingerprint']}")
        else:
            lines.append(f"waited:     {view['waited_s']:.1f}s since the first registration")
        for p in view["failed"]:
            lines.append(f"failed:     process {p['process_id']} on {_where(p)}: {p['reason']}")
        lines.append(f"leader:     {view['leader']} (store: {view['store']})")
    if view.get("attempt") is not None:
        lines.append(f"attempt:    {view['attempt']}")
    lines.append("replicas:   " + ", ".join(f"{r['address']} {r['role']}" for r in view["replicas"]))
    lines.extend(f"agent:      {line}" for line in agent_lines(view))
    if view["processes"]:
        lines.append("")
        lines.append(_table(view["processes"], view.get("slow_after_s") or 0.0))
    return "\n".join(lines)


def agent_lines(view: dict[str, Any]) -> list[str]:
    """One line per agent of the job (``ifrt run``): host, address, workers, spare or not, since when."""
    lines = []
    for a in view.get("agents") or ():
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["joined_unix_s"])) if a["joined_unix_s"] else "?"
        workers = f"{a['workers']} worker{'' if a['workers'] == 1 else 's'}"
        lines.append(f"{a['host']} ({a['address']}), {workers}{', spare host' if a['spare'] else ''}, "
                     f"since {since}{'' if a['watching'] else ', not watching'}")
    return lines


def _shown(value: Any) -> Any:
    """``value`` with every string in it made safe for a terminal (numbers and the structure as they are)."""
    if isinstance(value, str):
        return safe(value)
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shown(v) for v in value]
    return value


def domain(path: Any) -> str:
    """A network path as one name, root first: ``spine1/block2/rack7`` ("" for none)."""
    return "/".join(path)


def _state(p: dict[str, Any], slow_after_s: float) -> str:
    """A process's state, ``alive (slow)`` where its session has sent no heartbeat for ``slow_after_s``."""
    if p["state"] == "alive" and p["attached"] and p["heartbeat_age_s"] > slow_after_s > 0:
        return "alive (slow)"
    return p["state"]


def _where(p: dict[str, Any]) -> str:
    return f"{p['host']} ({p['host_address']})" if p["host_address"] else p["host"]


def _table(processes: list[dict[str, Any]], slow_after_s: float) -> str:
    """One row per process: id, OS pid, host, its network domain (a column only where some process has one), local
    rank, devices, state, incarnation, heartbeat age, session, reason."""
    networked = any(p.get("network") for p in processes)
    header = ("process", "pid", "host", *(("network",) if networked else ()), "rank", "devices", "state",
              "incarnation", "heartbeat age", "session", "reason")
    rows = [header] + [(
        "-" if p["process_id"] is None else str(p["process_id"]), str(p.get("pid") or "-"), _where(p),
        *((domain(p.get("network", ())) or "-",) if networked else ()), str(p["local_rank"]), str(p["devices"]),
        _state(p, slow_after_s), str(p["incarnation"]), f"{p['heartbeat_age_s']:.1f}s",
        "open" if p["attached"] else "-", p["reason"]) for p in processes]
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    right = {0, 1, 4, 5, 7, 8} if networked else {0, 1, 3, 4, 6, 7}
    lines = ["  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                       for c, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
