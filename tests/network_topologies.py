"""Topologies whose processes carry a network position, built from records (no coordinator needed)."""

from __future__ import annotations

from collections.abc import Sequence

from ifrt import wire
from ifrt.ids import LOCAL_ID_BITS
from ifrt.records import Device, Process, TopologyContent
from ifrt.topology import Topology


def network_topology(hosts: Sequence[tuple[int, str, Sequence[str]]], devices_per_host: int = 2) -> Topology:
    """A topology of ``(process id, hostname, network path)`` hosts, ``devices_per_host`` cpu devices each, seen
    from the lowest process id."""
    processes = tuple(sorted((Process(pid, name, "", tuple(path)) for pid, name, path in hosts),
                             key=lambda p: p.process_id))
    devices = tuple(Device(p.process_id << LOCAL_ID_BITS | i, p.process_id, i, "cpu", "cpu")
                    for p in processes for i in range(devices_per_host))
    content = TopologyContent("job", 1, len(processes), processes, devices)
    return Topology(wire.encode(content), processes[0].process_id)
