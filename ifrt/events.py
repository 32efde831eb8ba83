"""Cluster events a live client receives (``client.watch()``, ``client.on_event()``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ifrt.topology import Topology


@dataclass(frozen=True)
class ProcessFailed:
    """A process stopped heartbeating or lost its connection and did not come back within the grace."""

    process_id: int
    reason: str


@dataclass(frozen=True)
class ProcessRestarted:
    """A process came back with its old id; ``incarnation`` counts its restarts."""

    process_id: int
    incarnation: int


@dataclass(frozen=True)
class ProcessLeft:
    """A process closed its client gracefully."""

    process_id: int


@dataclass(frozen=True)
class TopologyChanged:
    """The coordinator published a new generation (a restart with other devices, or an elastic drop)."""

    topology: Topology


@dataclass(frozen=True)
class JobWhole:
    """Every process of ``topology`` is live again after processes of it failed or left and came back with their
    ids (``ifrt run --recover replace``, or a process restarted in place): the moment to re-form communicators.
    ``replaced``: each process that came back since the job was last whole, with its new incarnation. A new
    generation that the newcomers made (other devices or addresses) is delivered first, as TopologyChanged."""

    topology: Topology
    replaced: tuple[ProcessRestarted, ...]

    @property
    def generation(self) -> int:
        return self.topology.generation


@dataclass(frozen=True)
class CoordinatorLost:
    """The session with the coordinator broke or the coordinator shut down; the client keeps reconnecting."""

    reason: str


@dataclass(frozen=True)
class CoordinatorRestored:
    """The session is attached again after a CoordinatorLost."""

    coordinator: str


@dataclass(frozen=True)
class PreemptionNotice:
    """Process ``process_id`` was told it will be preempted: checkpoint at the preemption sync point
    (``client.reached_preemption_sync_point``) and exit."""

    process_id: int


Event = (ProcessFailed | ProcessRestarted | ProcessLeft | TopologyChanged | JobWhole | CoordinatorLost
         | CoordinatorRestored | PreemptionNotice)
