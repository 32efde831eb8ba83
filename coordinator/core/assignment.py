"""Deterministic process ids: the same set of processes gets the same ids in any arrival order."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from coordinator.core.registration import Registration
from ifrt.network import natural_key, path_key


def assign_process_ids(registrations: Iterable[Registration]) -> dict[str, int]:
    """client_uid -> process id: explicit ids as given, else ranks in ``assignment_order``."""
    registrations = list(registrations)
    if all(r.process_id is not None for r in registrations):
        return {r.client_uid: r.process_id for r in registrations}  # type: ignore[misc]
    ordered = sorted(registrations, key=assignment_order)
    return {r.client_uid: i for i, r in enumerate(ordered)}


def assignment_order(r: Registration) -> tuple:
    """Network path (level by level, ``ifrt.network.path_key``; no position first, as XLA sorts an empty path), then
    slice (its first device's slice key: a process's devices share one in every plugin that names one), then
    hostname, then host address as an address (10.0.0.2 before 10.0.0.10; IPv4 before IPv6), then local rank; every
    name compared naturally (``node2`` before ``node10``), so consecutive ids share the smallest domain.

    Total on admitted registrations: two with the same stable key are refused before ids are assigned, and the
    hostname's text breaks ties between names equal as numbers (``n01``, ``n1``).
    """
    slice_key = r.devices[0].slice_key if r.devices else ""
    return (path_key(r.network), natural_key(slice_key), natural_key(r.hostname), address_order(r.host_address),
            r.local_rank)


def address_order(address: str) -> tuple[int, int, str]:
    """Sort key for a host address: numeric for IPv4 and IPv6, after them any other text, by the text."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return 7, 0, address
    return ip.version, int(ip), address
