"""Runs a Python program (the coordinator's console script) with cProfile switched on and off by SIGUSR2, so a
benchmark profiles exactly the window it measures and the coordinator carries no profiling code.

    python bench/profiled.py STATS_PREFIX SCRIPT [ARGS...]

The first SIGUSR2 starts a profile of the main thread (the coordinator's event loop; gRPC's completion-queue thread
is not profiled); the next one stops it and writes ``STATS_PREFIX.0``, then ``.1`` for the next window, and so on
(``profile_stats`` below reads one). cProfile slows the profiled code: read shares, not times.
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

STOP_TIMEOUT_S = 60.0
IDLE = ("<method 'poll' of 'select.epoll' objects>",)
"""Where the event loop waits: left out of the shares."""


class Toggle:
    """SIGUSR2's handler: a fresh profile per window, each written to its own numbered file when it stops."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.windows, self.profile = prefix, 0, None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.profile is None:
            self.profile = cProfile.Profile()
            self.profile.enable()
            return
        self.profile.disable()
        path = Path(f"{self.prefix}.{self.windows}")
        self.profile.dump_stats(f"{path}.partial")
        Path(f"{path}.partial").rename(path)  # complete when it appears
        self.profile, self.windows = None, self.windows + 1


def switch(pid: int) -> None:
    """Starts or stops the profile of the program ``pid`` runs under this wrapper."""
    os.kill(pid, signal.SIGUSR2)


def stopped(pid: int, prefix: Path, window: int) -> Path:
    """Stops the profile of ``pid``; its stats file for ``window`` (0, 1, ...) once written."""
    switch(pid)
    path, deadline = Path(f"{prefix}.{window}"), time.monotonic() + STOP_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no profile in {path} within {STOP_TIMEOUT_S}s of asking for it")
        time.sleep(0.05)
    return path


def profile_shares(path: Path, top: int) -> dict[str, Any]:
    """The ``top`` functions by share (%) of the profiled time the loop was not waiting in epoll, own and with
    callees (so the loop's own frames pass 100 %), from one window's stats."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    idle = sum(v[2] for key, v in stats.items() if key[2] in IDLE)
    total = sum(tt for _, _, tt, _, _ in stats.values()) - idle or 1.0

    def name(key: tuple[str, int, str]) -> str:
        file, line, function = key
        return f"{function} ({Path(file).name}:{line})" if line else function

    def ranked(index: int) -> list[tuple[str, float]]:
        order = sorted(stats.items(), key=lambda kv: kv[1][index], reverse=True)[:top]
        return [(name(key), round(100 * value[index] / total, 1)) for key, value in order]

    return {"busy_s": round(total, 3), "idle_s": round(idle, 3), "self": ranked(2), "inclusive": ranked(3)}


def main() -> None:
    prefix, script = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[2:]
    signal.signal(signal.SIGUSR2, Toggle(prefix))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
