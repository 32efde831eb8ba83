"""Deterministic process ids: the same set of processes gets the same ids in any arrival order."""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.registration import Registration


def assign_process_ids(registrations: Iterable[Registration]) -> dict[str, int]:
    """client_uid -> process id: explicit ids as given, else ranks of the sorted stable keys."""
    registrations = list(registrations)
    if all(r.process_id is not None for r in registrations):
        return {r.client_uid: r.process_id for r in registrations}  # type: ignore[misc]
    ordered = sorted(registrations, key=lambda r: r.stable_key)
    return {r.client_uid: i for i, r in enumerate(ordered)}
