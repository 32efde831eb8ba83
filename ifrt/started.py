"""What a runtime's start left in this process (``ifrt.jax.initialize``, ``ifrt.torch.init_process_group``), and the
accessors both runtimes offer on it: ``is_initialized()``, ``client()``, ``topology()``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from ifrt.client import Client
    from ifrt.topology import Topology


class _Holds(Protocol):
    client: Client
    topology: Topology


S = TypeVar("S", bound=_Holds)


class Started(Generic[S]):
    """One runtime's start in this process: its state once started (None before), set under ``lock``."""

    def __init__(self, runtime: str, start: str) -> None:
        self.runtime, self.start = runtime, start
        self.state: S | None = None
        self.lock = threading.Lock()

    def get(self) -> S:
        """The state; RuntimeError naming the call to make when the runtime was not started."""
        if self.state is None:
            raise RuntimeError(f"{self.runtime} is not initialized in this process: call {self.start}() first")
        return self.state

    def is_initialized(self) -> bool:
        """Whether the runtime's start completed in this process."""
        return self.state is not None

    def client(self) -> Client:
        """The ifrt client the runtime's start made (key-values, barriers, events, ``channels()``)."""
        return self.get().client

    def topology(self) -> Topology:
        """The topology the runtime's start returned."""
        return self.get().topology
