"""The cluster as an SVG picture, drawn from the status view (``ifrt status --json``'s dict): hosts as boxes holding
their processes and devices, grouped by rack (where processes have a network position) and slice; trouble marked by
color, the reason and heartbeat age on hover. Pure: no I/O, no clock; the same view gives the same bytes. Every
string a caller sent is escaped for XML and made safe (``ifrt.safe_text``): no control or bidi character reaches the
picture, so none can reorder its text."""

from __future__ import annotations

import math
from collections.abc import Iterable
from html import escape
from typing import Any

from ifrt.network import natural_key, path_key
from ifrt.protocol import SLOW_SHARE
from ifrt.safe_text import safe

MARKS = ("failed", "missing", "restarting", "slow", "left", "joining", "alive")
"""How a process is drawn, worst first: a tile of many processes takes the color of its worst one."""
COLORS = {"failed": "#d62728", "missing": "#f4a6a6", "restarting": "#ff7f0e", "slow": "#e6b800",
          "left": "#9e9e9e", "joining": "#6baed6", "alive": "#2ca02c"}
DETAIL_HOSTS = 64
"""Up to this many hosts, each is drawn with its processes and every device's global id; past it, one tile a host."""
MAX_TILES = 1024
"""Past this many hosts, consecutive hosts (in mesh order) share a tile, so the picture stays ~1,000 elements."""
MAX_RACK_ROWS = 128
"""Up to this many racks, the tiles of each rack start a row of their own, named at its left; past it, the tiles run
on in network order."""
DEVICES_PER_ROW = 8
_CELL, _GAP, _HOST_W, _COLUMNS, _TILE, _TILES_PER_ROW, _RACK_LABEL_W = 40, 4, 460, 3, 12, 64, 170


def slow_after(view: dict[str, Any]) -> float:
    """Seconds without a heartbeat after which the view's processes are slow (0: never)."""
    return view.get("slow_after_s") or SLOW_SHARE * (view.get("heartbeat_timeout_s") or 0.0)


def mark(process: dict[str, Any], slow_after_s: float) -> str:
    """How ``process`` (a process of the view) is drawn: one of ``MARKS``."""
    state = process["state"]
    if state in ("failed", "left", "missing"):
        return state
    if state == "joining" and process.get("incarnation", 0) > 0:
        return "restarting"
    if slow_after_s > 0 and process.get("attached", True) and process.get("heartbeat_age_s", 0) > slow_after_s:
        return "slow"
    return state if state in MARKS else "joining"


def processes_with_missing(view: dict[str, Any]) -> list[dict[str, Any]]:
    """The view's processes, plus a placeholder per missing process id (or per unnamed missing process)."""
    processes = list(view.get("processes") or [])
    missing_ids = list(view.get("missing") or [])
    unnamed = max(0, (view.get("missing_count") or 0) - len(missing_ids))
    placeholders = [{"process_id": pid, "host": "(not registered)", "host_address": "", "devices": 0,
                     "state": "missing", "reason": "has not registered", "heartbeat_age_s": 0.0}
                    for pid in missing_ids]
    placeholders += [{"process_id": None, "host": "(not registered)", "host_address": "", "devices": 0,
                      "state": "missing", "reason": "has not registered", "heartbeat_age_s": 0.0}
                     for _ in range(unnamed)]
    return processes + placeholders


def describe(process: dict[str, Any], slow_after_s: float) -> str:
    """One line about a process for a tooltip or a list: id, host, mark, reason, heartbeat age."""
    pid = "?" if process["process_id"] is None else process["process_id"]
    where = safe(process["host"]) + (f" ({safe(process['host_address'])})" if process.get("host_address") else "")
    os_pid = f" (pid {process['pid']})" if process.get("pid") else ""
    text = f"process {pid}{os_pid} on {where}: {mark(process, slow_after_s)}"
    if process.get("reason"):
        text += f", {safe(process['reason'])}"
    if process["state"] in ("joining", "alive"):  # a failed or gone process's reason says when it went quiet
        text += f"; heard from {process.get('heartbeat_age_s', 0.0):.1f}s ago"
        if process.get("incarnation", 0) > 0:
            text += f", incarnation {process['incarnation']}"
    return text


def svg(view: dict[str, Any]) -> str:
    """The picture of the cluster ``view`` describes, as a standalone SVG document (no external asset)."""
    timeout = slow_after(view)
    processes = processes_with_missing(view)
    hosts = _hosts(processes)
    counts = {m: 0 for m in MARKS}
    for p in processes:
        counts[mark(p, timeout)] += 1
    (legend, legend_width), top = _legend(counts), 34
    if not processes:
        body, height, width = [_text(10, top + 16, "no process has registered yet", "note")], top + 30, 600
    elif len(hosts) <= DETAIL_HOSTS:
        body, height, width = _detailed(hosts, timeout, top)
    else:
        body, height, width = _tiles(hosts, timeout, top)
    width = max(width, legend_width)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" font-family="sans-serif" font-size="11" role="img">'
            f'<title>cluster {_shown(view.get("cluster_id", ""))}: {_shown(view.get("state", ""))}</title>'
            f'<style>.note{{fill:#555}}.id{{font-size:9px;fill:#fff}}.host{{font-weight:bold}}</style>'
            + "".join(legend) + "".join(body) + "</svg>")


def _hosts(processes: list[dict[str, Any]]) -> list[tuple[tuple, list[dict[str, Any]]]]:
    """Processes grouped by (network path, slice, host, address), hosts in network order (path level by level, then
    the default mesh order where known, else slice, hostname in natural order, first process id); each missing
    process is a host of its own, last."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for p in processes:
        key = (tuple(p.get("network") or ()), p.get("slice"), p["host"], p.get("host_address", ""))
        if p["state"] == "missing":
            key = ((), None, "(not registered)", str(p["process_id"]))  # each missing process its own box
        groups.setdefault(key, []).append(p)

    def order(item: tuple[tuple, list[dict[str, Any]]]) -> tuple:
        key, members = item
        mesh = min((min(m["mesh_positions"]) for m in members if m.get("mesh_positions")), default=math.inf)
        first = min((m["process_id"] for m in members if m["process_id"] is not None), default=math.inf)
        return (key[1] is None and key[2] == "(not registered)", path_key(key[0]), mesh, key[1] is None,
                key[1] or 0, natural_key(key[2]), first, key[3])

    return sorted(groups.items(), key=order)


def _domain(path: tuple[str, ...]) -> str:
    """How a leaf switch (a rack's) is named on the page: its path, root first (``spine / block3 / rack7``)."""
    return " / ".join(path)


def _legend(counts: dict[str, int]) -> tuple[list[str], int]:
    """The legend's marks with their counts, and how wide it is."""
    parts, x = [], 10
    for m in MARKS:
        if not counts[m]:
            continue
        parts.append(f'<rect x="{x}" y="10" width="14" height="14" fill="{COLORS[m]}"/>')
        label = f"{m} {counts[m]}"
        parts.append(_text(x + 18, 21, label))
        x += 30 + 7 * len(label)
    return parts, x


def _detailed(hosts: list[tuple[tuple, list[dict[str, Any]]]], timeout: float, top: int) -> tuple[list[str], int, int]:
    """One box per host, a row per process, a cell per device with its global id; a band per rack (where hosts have
    a network position), and per slice within it."""
    parts: list[str] = []
    y, column, row_height, current, columns = top, 0, 0, object(), 1
    for (path, slice_index, host, address), members in hosts:
        if (path, slice_index) != current:
            if column:
                y, column, row_height = y + row_height + 10, 0, 0
            new_path = path and (not isinstance(current, tuple) or current[0] != path)
            band = [f"leaf switch {_domain(path)}"] if new_path else []
            if slice_index is not None:
                band.append(f"slice {slice_index}")
            current = (path, slice_index)
            if band:
                parts.append(f'<g class="domain" data-network="{_shown(_domain(path))}">'
                             + _text(10, y + 12, ", ".join(band), "host") + "</g>")
                y += 18
        box = _host_box(host, address, members, timeout)
        height = box[0]
        x = 10 + column * (_HOST_W + 10)
        parts.append(f'<g transform="translate({x},{y})">' + box[1] + "</g>")
        row_height = max(row_height, height)
        column += 1
        columns = max(columns, column)
        if column == _COLUMNS:
            y, column, row_height = y + row_height + 10, 0, 0
    return parts, y + row_height + 10, 20 + columns * (_HOST_W + 10)  # as wide as it is drawn


def _host_box(host: str, address: str, members: list[dict[str, Any]], timeout: float) -> tuple[int, str]:
    parts, y = [], 20
    for p in members:
        m = mark(p, timeout)
        ids = p.get("device_ids")
        rows = max(1, math.ceil(len(ids) / DEVICES_PER_ROW)) if ids else 1
        height = max(36, 8 + rows * 22)
        pid = "?" if p["process_id"] is None else p["process_id"]
        cells = [f'<rect x="0" y="0" width="{_HOST_W - 16}" height="{height}" rx="3" fill="{COLORS[m]}" '
                 f'fill-opacity="0.25" stroke="{COLORS[m]}" stroke-width="2"'
                 + (' stroke-dasharray="5,3"' if m == "missing" else "") + "/>",
                 _text(6, 17, f"process {pid}"), _text(6, 30, m, "note")]
        if ids:
            for i, gid in enumerate(ids):
                cx, cy = 80 + (i % DEVICES_PER_ROW) * (_CELL + _GAP), 4 + (i // DEVICES_PER_ROW) * 22
                title = f"device {i} of process {pid}: global id {gid}"
                if p.get("mesh_positions"):
                    title += f", position {p['mesh_positions'][i]} in the default mesh order"
                cells.append(f'<g><title>{escape(title)}</title><rect x="{cx}" y="{cy}" width="{_CELL}" '
                             f'height="18" rx="2" fill="{COLORS[m]}"/>'
                             f'<text x="{cx + 3}" y="{cy + 13}" class="id">{gid}</text></g>')
        elif p.get("devices"):
            cells.append(_text(90, 17, f"{p['devices']} device(s)"))
        parts.append(f'<g class="process {m}" data-process="{pid}" transform="translate(8,{y})">'
                     f'<title>{escape(describe(p, timeout))}</title>' + "".join(cells) + "</g>")
        y += height + 4
    label = host + (f" ({address})" if address and host != "(not registered)" else "")
    frame = (f'<rect x="0" y="0" width="{_HOST_W}" height="{y + 4}" rx="5" fill="#f7f7f7" stroke="#888"/>'
             + _text(8, 14, label, "host"))
    return y + 4, frame + "".join(parts)


def _tiles(hosts: list[tuple[tuple, list[dict[str, Any]]]], timeout: float, top: int) -> tuple[list[str], int, int]:
    """One small tile per host (or per run of consecutive hosts past ``MAX_TILES``), colored by its worst process;
    where hosts have a network position, a row (or rows) per rack, named at its left."""
    per_tile = math.ceil(len(hosts) / MAX_TILES)
    racks: dict[tuple[str, ...], list[tuple[tuple, list[dict[str, Any]]]]] = {}
    for host in hosts:
        racks.setdefault(host[0][0], []).append(host)
    placed = any(racks) and len(racks) <= MAX_RACK_ROWS
    left = 10 + (_RACK_LABEL_W if placed else 0)
    note = f"{len(hosts)} hosts, {per_tile} a tile" + (f" in {len(racks)} racks" if placed else "")
    parts = [_text(10, top + 12, f"{note}: hover a tile for its processes", "note")]
    y0, step = top + 20, _TILE + 2
    row = 0
    for path, members_of_rack in (racks.items() if placed else [((), hosts)]):
        if placed:
            parts.append(f'<g class="domain" data-network="{_shown(_domain(path))}">'
                         + _text(10, y0 + row * step + _TILE - 2, _domain(path) or "(no position)", "note") + "</g>")
        tiles = math.ceil(len(members_of_rack) / per_tile)
        for t in range(tiles):
            chunk = members_of_rack[t * per_tile:(t + 1) * per_tile]
            members = [p for _, ps in chunk for p in ps]
            marks = [mark(p, timeout) for p in members]
            worst = min(marks, key=MARKS.index)
            x, y = left + (t % _TILES_PER_ROW) * step, y0 + (row + t // _TILES_PER_ROW) * step
            parts.append(f'<rect x="{x}" y="{y}" width="{_TILE}" height="{_TILE}" fill="{COLORS[worst]}">'
                         f'<title>{escape(_tile_title(chunk, members, marks, timeout))}</title></rect>')
        row += math.ceil(tiles / _TILES_PER_ROW)
    return parts, y0 + row * step + 10, left + 10 + _TILES_PER_ROW * step


def _tile_title(chunk: list[tuple[tuple, list[dict[str, Any]]]], members: list[dict[str, Any]], marks: list[str],
                timeout: float) -> str:
    first, last = chunk[0][0], chunk[-1][0]
    names = safe(first[2]) if len(chunk) == 1 else f"{safe(first[2])} .. {safe(last[2])} ({len(chunk)} hosts)"
    if first[0]:
        names += f" in rack {safe(_domain(first[0]))}"
    tally = ", ".join(f"{marks.count(m)} {m}" for m in MARKS if m in marks)
    trouble = [describe(p, timeout) for p, m in zip(members, marks, strict=True) if m not in ("alive", "joining")]
    lines = [f"{names}: {len(members)} processes, {tally}", *trouble[:5]]
    if len(trouble) > 5:
        lines.append(f"and {len(trouble) - 5} more")
    return "\n".join(lines)


def _text(x: float, y: float, text: str, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f'<text x="{x}" y="{y}"{attr}>{_shown(text)}</text>'


def _shown(text: object) -> str:
    """A caller's text as the picture shows it: controls and bidi characters escaped visibly, then XML-escaped."""
    return escape(safe(text))


def trouble(view: dict[str, Any]) -> Iterable[str]:
    """A line for each process that is not alive and well (failed, missing, restarting, slow, left), worst first."""
    timeout = slow_after(view)
    marked = [(MARKS.index(mark(p, timeout)), p) for p in processes_with_missing(view)]
    for _, p in sorted((m for m in marked if MARKS[m[0]] not in ("alive", "joining")), key=lambda m: m[0]):
        yield describe(p, timeout)



def topology_extras(devices: Iterable[Any], hostnames: dict[int, str],
                    networks: dict[int, tuple[str, ...]] | None = None) -> dict[int, dict[str, Any]]:
    """Per process id of a published topology: its slice, its network position (where it has one), its devices'
    global ids and their positions in the default mesh order (``ifrt.mesh.topology_order``), from the topology's
    devices (``ifrt.records.Device``) and processes' network paths."""
    from ifrt.mesh import topology_order  # numpy: only where a topology is at hand

    networks = networks or {}
    ordered = topology_order(devices, hostnames, networks)
    position = {d.id: i for i, d in enumerate(ordered)}
    by_process: dict[int, list[Any]] = {}
    for d in ordered:
        by_process.setdefault(d.process_id, []).append(d)
    extras = {}
    for pid, mine in by_process.items():
        mine.sort(key=lambda d: d.local_id)
        extras[pid] = {"slice": mine[0].slice_index, "device_ids": [d.id for d in mine],
                       "mesh_positions": [position[d.id] for d in mine]}
        if networks.get(pid):
            extras[pid]["network"] = list(networks[pid])
    return extras


def with_extras(view: dict[str, Any], extras: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``view`` with ``topology_extras`` merged into its processes."""
    return {**view, "processes": [{**p, **extras.get(p["process_id"], {})} for p in view.get("processes") or []]}
