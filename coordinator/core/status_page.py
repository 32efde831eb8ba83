"""The status page an operator opens in a browser on the metrics port: the status view as HTML around the cluster's
SVG picture (``ifrt.status_svg``), refreshing itself. Pure: view dicts in, text out; everything inline, no asset
fetched from anywhere, so it works offline. Every string shown is escaped for HTML and made safe
(``ifrt.safe_text``): a control or bidi character a caller sent shows as an escape and cannot reorder the page's
own text."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from html import escape
from typing import Any

from ifrt import status_svg, status_view
from ifrt.safe_text import safe

REFRESH_S = 2.0
"""How often an open page asks for the view again."""
MAX_LISTED = 50
"""Longest list of troubled processes or events shown as text (the picture shows all)."""
PAGE_PATHS = frozenset({"/", "/status"})
FRAGMENT_PATH = "/status/view"
JSON_PATH = "/status.json"

_STYLE = ("body{font-family:sans-serif;margin:16px;color:#222}h1{font-size:20px;margin:0 0 8px}"
          "dl{display:grid;grid-template-columns:max-content auto;gap:2px 12px;margin:8px 0}dt{color:#666}"
          "dd{margin:0}.failed{color:#d62728}.stale{color:#d62728;font-weight:bold}"
          ".picture{overflow:auto;border:1px solid #ddd;max-width:100%}ul{margin:4px 0}")
_SCRIPT = ("const view=document.getElementById('view'),note=document.getElementById('note');"
           "async function refresh(){try{const r=await fetch('" + FRAGMENT_PATH.lstrip("/") + "',"
           "{cache:'no-store'});if(!r.ok)throw new Error(r.status+' '+r.statusText);"
           "view.innerHTML=await r.text();note.textContent='updated '+new Date().toLocaleTimeString();"
           "note.className=''}catch(e){note.textContent='cannot reach the coordinator: '+e.message;"
           "note.className='stale'}}"
           f"setInterval(refresh,{int(REFRESH_S * 1000)});")


def page(view: dict[str, Any]) -> str:
    """The whole page: the view now, and a script that replaces it with a fresh one every ``REFRESH_S``."""
    title = f"ifrt cluster {view.get('cluster_id', '')}: {view.get('state', '')}"
    # The relative fetch resolves against /status as against /, so the base is the page's own folder.
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>{_shown(title)}</title><style>{_STYLE}</style></head><body>"
            f"<div id=\"view\">{fragment(view)}</div><p id=\"note\"></p>"
            f"<script>{_SCRIPT}</script></body></html>")


def fragment(view: dict[str, Any]) -> str:
    """What the page shows of one view: the summary, the picture, the processes in trouble, the events."""
    parts = [f"<h1>cluster {_shown(view.get('cluster_id', ''))}: "
             f"<span class=\"state\">{_shown(view.get('state', ''))}</span></h1>", _summary(view)]
    leader_view = view.get("leader_view")
    if view.get("state") == "standby":
        if leader_view is None:
            parts.append("<p>This replica stands by. " + _shown(view.get("leader_error") or "")
                         + " Open the leader's page for the cluster.</p>")
            return "".join(parts)
        parts.append(f"<p>This replica stands by; what the leader {_shown(view.get('leader') or '')} "
                     "reports:</p>")
        parts.append(fragment({**leader_view, "replicas": view.get("replicas", [])}))
        return "".join(parts)
    parts.append(f"<div class=\"picture\">{status_svg.svg(view)}</div>")
    parts.append(_listed("Processes in trouble", list(status_svg.trouble(view)), "failed"))
    parts.append(_listed("Agents", status_view.agent_lines(view), ""))
    parts.append(_listed("Last events", events(view), ""))
    return "".join(parts)


def events(view: dict[str, Any]) -> list[str]:
    """What has happened to processes, as the status report tells it: failures, departures and restarts, most
    recent (least time since last heard from) first."""
    changed = []
    for p in view.get("processes") or []:
        if p["state"] == "failed":
            what = f"failed: {p['reason']}"
        elif p["state"] == "left":
            what = f"left: {p['reason']}" if p.get("reason") else "left"
        elif p.get("incarnation", 0) > 0:
            what = f"restarted (incarnation {p['incarnation']})"
        else:
            continue
        changed.append((p.get("heartbeat_age_s", 0.0), f"process {p['process_id']} on {p['host']} {what}"))
    if view.get("generation"):
        changed.append((float("inf"), f"generation {view['generation']} published"
                        + (f" {view['time_to_publish_s']:.2f}s after the first registration"
                           if view.get("time_to_publish_s") else "")))
    return [text for _, text in sorted(changed, key=lambda c: c[0])]


def _summary(view: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    if view.get("state") != "standby":
        rows.append(("processes", f"{view.get('registered')}/{view.get('expected')} registered, "
                                  f"{view.get('sessions_open')} sessions open"))
        rows.append(("generation", str(view.get("generation") or "none published yet")))
        if view.get("fingerprint"):
            rows.append(("fingerprint", view["fingerprint"]))
    if view.get("attempt") is not None:
        rows.append(("attempt", str(view["attempt"])))
    rows.append(("leader", str(view.get("leader") or "unknown")))
    if view.get("reason"):
        rows.append(("reason", view["reason"]))
    rows.append(("replicas", ", ".join(f"{r['address']} {r['role']}" for r in view.get("replicas", []))))
    rows.append(("store", str(view.get("store", ""))))
    return "<dl>" + "".join(f"<dt>{_shown(k)}</dt><dd>{_shown(v)}</dd>" for k, v in rows) + "</dl>"


def _listed(title: str, lines: list[str], cls: str) -> str:
    if not lines:
        return ""
    more = f"<li>and {len(lines) - MAX_LISTED} more</li>" if len(lines) > MAX_LISTED else ""
    attr = f' class="{cls}"' if cls else ""
    return (f"<h2>{_shown(title)}</h2><ul{attr}>" + "".join(f"<li>{_shown(line)}</li>" for line in
                                                           lines[:MAX_LISTED]) + more + "</ul>")


def _shown(text: object) -> str:
    """Text as the page shows it: controls and bidi characters escaped visibly, then HTML-escaped."""
    return escape(safe(text))


def wsgi_app(metrics_app: Callable, read_view: Callable[[], dict[str, Any]]) -> Callable:
    """A WSGI app that serves the page, its fragment and the JSON view, and hands every other path (``/metrics``)
    to ``metrics_app``. ``read_view`` reads the coordinator (it may block briefly, never on this thread's loop)."""

    def app(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in PAGE_PATHS and path not in (FRAGMENT_PATH, JSON_PATH):
            return metrics_app(environ, start_response)
        try:
            view = read_view()
        except Exception as e:  # the loop busy past the timeout, or stopping: say so, the page retries
            start_response("503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"the coordinator did not answer: {type(e).__name__}: {e}".encode()]
        if path == JSON_PATH:
            body, kind = json.dumps(view).encode(), "application/json"
        else:
            body = (page(view) if path in PAGE_PATHS else fragment(view)).encode()
            kind = "text/html; charset=utf-8"
        start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-store")])
        return [body]

    return app
