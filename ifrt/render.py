"""Human-readable views of a topology, for the demo and ``ifrt discover`` without --json. Names that processes sent
(hosts, platforms, kinds) are escaped for the terminal (``ifrt.safe_text``)."""

from __future__ import annotations

from ifrt.safe_text import safe
from ifrt.topology import Topology


def table(topology: Topology) -> str:
    """One row per device: process, host, its network domain (a column only where some process has a position:
    the path joined, ``spine1/block2/rack7``), global id, local id, platform, kind, slice."""
    hosts = {p.process_id: safe(p.hostname) for p in topology.processes}
    networked = any(p.network for p in topology.processes)
    domains = {p.process_id: safe("/".join(p.network)) or "-" for p in topology.processes}
    header = ("process", "host", *(("network",) if networked else ()), "global id", "local id", "platform", "kind",
              "slice")
    rows = [header] + [
        (str(d.process_id), hosts[d.process_id], *((domains[d.process_id],) if networked else ()), str(d.id),
         str(d.local_id), safe(d.platform), safe(d.kind), str(d.slice_index))
        for d in topology.devices
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if c.isdigit() else c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def summary(topology: Topology) -> str:
    """``generation 1: 4 processes, 8 devices, fingerprint 3f2a...``"""
    return (f"generation {topology.generation}: {len(topology.processes)} processes, {len(topology.devices)} devices, "
            f"fingerprint {topology.fingerprint}")
