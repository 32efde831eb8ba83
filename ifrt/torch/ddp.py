"""A ``DistributedDataParallel`` that outlives its process group: ``ifrt.torch.Healing`` builds it anew on each group
a recovery forms, and the program keeps calling the same module."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


class DataParallel(torch.nn.Module):
    """``module`` trained data-parallel on the current default process group; ``ddp`` is the DDP of that group.
    Its state dict is ``module``'s, under ``module.`` as DDP's is."""

    def __init__(self, module: torch.nn.Module, **options: Any) -> None:
        super().__init__()
        self.module = module
        self.__dict__["options"] = options
        self.__dict__["ddp"] = None  # not a submodule: its parameters are ``module``'s

    def rebuild(self) -> DistributedDataParallel | None:
        """A new DDP on the current default group (its constructor is a collective: every process calls it in the
        same order); returns the one it replaces, for the caller to retire (never to drop while its work may run)."""
        old = self.__dict__["ddp"]
        self.__dict__["ddp"] = DistributedDataParallel(self.module, **self.options)
        return old

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)
