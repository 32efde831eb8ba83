"""The job both sides of bench/healing.py run, and the shape of one trial's result: a data-parallel MLP whose state
(float32 parameters + SGD momentum buffers) is about ``state_mb`` MB, built the same in every process from a fixed
seed, so a healed replica can be checked against its peer by digest. No ifrt or torchft import here: both workers
(ifrt's in the project's .venv, torchft's in .venv-torchft) import this module.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from torch import nn

SEED = 1234
BATCH = 256
"""Rows of the fixed per-replica batch: sets a step's compute (about 20 ms at 10 MB, 0.8 s at 250 MB on one core
here)."""
MAX_WIDTH = 1024
LR, MOMENTUM = 1e-3, 0.9
MOMENTS = ("before", "during", "after", "at_ms")
"""Where the victim kills itself in its step: at the start (before any collective), inside the gradient all-reduce
(right after launching it), after backward (before the commit vote), or a timer ``AT_MS`` ms into the step."""
AT_MS = 50
WARM = 3
"""Common steps with equal digests both replicas must have reported before the victim is armed."""
RECOVER_TIMEOUT = 60.0
START_TIMEOUT = 120.0
"""Seconds a trial waits for the recovery, and for the job to start and warm."""
AFTER = 3
"""Common steps after the recovered one that the trial waits for (the survivor still stepping) before it ends."""


class TrialResult(TypedDict, total=False):
    """One trial of bench/healing.py, the same keys on both sides (ifrt and torchft).

    - ``way``, ``state_mb``, ``moment``, ``round``: what was run.
    - ``recovered_s``: from the kill (the victim's ``killed`` line) until every replica has reported the first step
      after the kill that all report with equal digests (the later report's time); None if not within the timeout.
    - ``survivor_lost``: a replica that was not killed exited or stopped stepping.
    - ``equal``: the first step both report after the kill carries the same digest on both.
    - ``servers``: what listened beside the job: per role (e.g. lighthouse, store, manager, checkpoint) the count of
      listening TCP sockets and their addresses (``0.0.0.0``/``[::]`` = every interface), plus ``processes`` (the
      processes beside the workers) and ``rss_mb`` of those processes.
    - ``lines``: lines of user code the recovery needs on this side.
    - ``error``: None, or what went wrong (the trial still reports what it saw).

    A side may add keys of its own (torchft: ``heartbeat_timeout_ms``, ``replacement_start_s``,
    ``survivor_first_step_s``, ``first_step``, ``step``, ``survivor_exit``, ``survivor_words``); the driver's
    summary reads only the keys above.
    """

    way: str
    state_mb: int
    moment: str
    round: int
    recovered_s: float | None
    survivor_lost: bool
    equal: bool | None
    servers: dict[str, Any]
    lines: int
    error: str | None


def secs(seconds: float) -> float:
    """Seconds to the millisecond (``run_trial``'s ``round`` argument hides the builtin there)."""
    return round(seconds, 3)


def warm(a: dict[int, dict], b: dict[int, dict]) -> bool | None:
    """Both replicas (their committed steps, by step) have reported WARM common steps with equal digests."""
    equal = [s for s in set(a) & set(b) if a[s]["digest"] == b[s]["digest"]]
    return len(equal) >= WARM or None


def trial_result(way: str, state_mb: int, moment: str, round: int, **fields: Any) -> TrialResult:
    """A TrialResult with every key present (missing ones None/False), so both sides print the same shape."""
    result: TrialResult = {"way": way, "state_mb": state_mb, "moment": moment, "round": round, "recovered_s": None,
                           "survivor_lost": False, "equal": None, "servers": {}, "lines": 0, "error": None}
    result.update(fields)  # type: ignore[typeddict-item]
    return result


@dataclass(frozen=True)
class Shape:
    """The MLP's shape for a state size: ``depth`` square layers of ``width`` (weight + bias)."""

    width: int
    depth: int

    @property
    def params(self) -> int:
        return self.depth * (self.width * self.width + self.width)

    @property
    def state_bytes(self) -> int:
        """Parameters and one momentum buffer per parameter, float32."""
        return 2 * 4 * self.params


def shape_for(state_mb: float) -> Shape:
    """The shape whose state (parameters + momentum, float32) is nearest ``state_mb`` MB (10**6 bytes)."""
    params = max(72, int(state_mb * 1e6 / 8))
    depth = max(1, round(params / (MAX_WIDTH * MAX_WIDTH)))
    width = round((math.sqrt(1 + 4 * params / depth) - 1) / 2)  # width**2 + width = params / depth
    return Shape(width, depth)


def build(state_mb: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its SGD-with-momentum optimizer, the same bytes in every process (fixed seed), momentum buffers
    allocated (zero) so the state is its full size from the start."""
    torch.manual_seed(SEED)
    shape = shape_for(state_mb)
    layers: list[nn.Module] = []
    for _ in range(shape.depth):
        layer = nn.Linear(shape.width, shape.width)
        nn.init.normal_(layer.weight, std=1.0 / math.sqrt(shape.width))
        layers += [layer, nn.Tanh()]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return model, optimizer


def batch(state_mb: float, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s fixed batch (inputs, targets): different per replica, the same every step."""
    width = shape_for(state_mb).width
    g = torch.Generator().manual_seed(SEED + 1 + replica)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g).tanh()


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The step's loss (mean squared error); backward on it makes the gradients the all-reduce averages."""
    return nn.functional.mse_loss(model(inputs), targets)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state a replacement needs, in a fixed order: every parameter, then its momentum buffer."""
    params = list(model.parameters())
    return params + [optimizer.state[p]["momentum_buffer"] for p in params]


def digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """sha256 of the parameters' bytes (and of the momentum buffers with ``optimizer``), first 16 hex digits: equal
    digests = bit-identical state."""
    h = hashlib.sha256()
    tensors = state_tensors(model, optimizer) if optimizer is not None else list(model.parameters())
    with torch.no_grad():
        for t in tensors:
            h.update(memoryview(t.detach().contiguous().numpy()).cast("B"))
    return h.hexdigest()[:16]


def usage() -> dict[str, float]:
    """This process's threads, open descriptors and resident memory (MB), read from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "rss_mb": round(resident / 2**20, 1)}
