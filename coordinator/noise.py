"""Warnings about callers, rate-limited: a caller who sends a thousand bad requests costs one line per kind and
interval plus a count of the rest, never a thousand lines. Kinds are this package's constants, never caller text."""

from __future__ import annotations

import asyncio
import logging

from ifrt.ratelimit import Throttled

INTERVAL_S = 10.0
"""At most one line per kind in this long; the next one, or the periodic flush, says how many were held back."""

noisy = Throttled(logging.getLogger("ifrt.coordinator"), INTERVAL_S)
"""The coordinator's rate-limited logger for refusals (shared by every part that refuses a caller)."""


async def flush_every(interval_s: float = INTERVAL_S) -> None:
    """Writes the counts of held-back warnings every ``interval_s``, so none is lost when the noise stops."""
    while True:
        await asyncio.sleep(interval_s)
        noisy.flush()
