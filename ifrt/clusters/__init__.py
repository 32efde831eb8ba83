"""Cluster-environment detection: a job launched by torchrun, MPI, SLURM or Kubernetes needs no ifrt flags.

Each launcher is one small detector class in its own module (adding a launcher is adding a module and a line in
DETECTORS). Launchers nest (``srun torchrun ...``, ``mpirun`` inside an ``sbatch`` allocation, any of them in a
Kubernetes pod), so several may be present at once; the innermost one started this process and knows its rank,
so it wins. The documented order, highest priority first:

1. ``torchrun`` (40): torchrun and torch's env:// variables; it runs inside any of the others.
2. ``ompi`` (30): Open MPI's mpirun and PRRTE; mpirun runs inside SLURM allocations and pods.
3. ``slurm`` (20): srun job steps and sbatch scripts; SLURM can run in Kubernetes pods.
4. ``tpu`` (18): GKE TPU slices and multislice; set on pods of the Kubernetes launchers below, and the only one
   that knows the slice.
5. ``kubeflow`` (16): Kubeflow Trainer's JAX and torch runtimes; its pods are a JobSet's.
6. ``lws`` (14): LeaderWorkerSet groups (one cluster per group).
7. ``jobset`` (12): JobSet child Jobs, numbered across the set from the annotations the manifest passes in.
8. ``kubernetes`` (10): Indexed Job pods, the outermost layer.

When two present environments disagree on a value (process id, process count, local rank, local world size,
slice, coordinator host), detect() still returns the winner's values, and logs a warning on the "ifrt.clusters" logger
naming both sources, their variables and values, and which one won. Explicit IFRT_* settings are resolved
elsewhere and take precedence over anything detected here.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping

from ifrt.clusters.base import DEFAULT_PORT, PORT_ENV, ClusterEnvironment, Detected
from ifrt.clusters.jobset import JobSet
from ifrt.clusters.kubeflow import KubeflowTrainer
from ifrt.clusters.kubernetes import Kubernetes
from ifrt.clusters.lws import LeaderWorkerSet
from ifrt.clusters.ompi import Ompi
from ifrt.clusters.slurm import Slurm
from ifrt.clusters.torchrun import Torchrun
from ifrt.clusters.tpu import GkeTpu
from ifrt.errors import InvalidArgument

__all__ = ["DEFAULT_PORT", "DETECTORS", "PORT_ENV", "ClusterEnvironment", "Detected", "detect", "present"]

logger = logging.getLogger("ifrt.clusters")

DETECTORS: tuple[type[ClusterEnvironment], ...] = (Torchrun, Ompi, Slurm, GkeTpu, KubeflowTrainer, LeaderWorkerSet,
                                                   JobSet, Kubernetes)
"""Every detector, in the documented order (highest priority first)."""

if [d.priority for d in DETECTORS] != sorted((d.priority for d in DETECTORS), reverse=True):
    raise AssertionError("DETECTORS must be listed highest priority first")

_COMPARED = (
    ("process_id", "process id"),
    ("num_processes", "process count"),
    ("local_rank", "local rank"),
    ("local_world_size", "local world size"),
    ("slice_index", "slice"),
)


def present(env: Mapping[str, str]) -> list[Detected]:
    """Every launcher present in ``env``, highest priority first (for diagnostics); InvalidArgument if one is
    malformed."""
    return [d.detect(env) for d in DETECTORS if d.is_present(env)]


def detect(env: Mapping[str, str]) -> Detected | None:
    """The highest-priority launcher's values, None if no launcher is present; warns when present launchers
    disagree. InvalidArgument if the winner's variables are malformed."""
    found = [d for d in DETECTORS if d.is_present(env)]
    if not found:
        return None
    winner_cls, *others = found
    winner = winner_cls.detect(env)
    for other_cls in others:
        try:
            other = other_cls.detect(env)
        except InvalidArgument as e:
            logger.warning("%s environment is also present but unreadable (%s); %s wins over it by priority (%d > %d)",
                           other_cls.name, e, winner.source, winner_cls.priority, other_cls.priority)
            continue
        differences = _differences(winner, other)
        if differences:
            logger.warning(
                "cluster environments disagree: %s; %s wins over %s by priority (%d > %d) and its values are used "
                "(set IFRT_* variables to choose otherwise)",
                "; ".join(differences), winner.source, other.source, winner_cls.priority, other_cls.priority,
            )
    return winner


def _differences(winner: Detected, other: Detected) -> list[str]:
    """What two launchers' answers disagree on, e.g. "process id: torchrun RANK='6' vs slurm SLURM_PROCID='1'"."""
    out = []
    for name, label in _COMPARED:
        a, b = getattr(winner, name), getattr(other, name)
        if a is not None and b is not None and a != b:
            out.append(f"{label}: {winner.source} {winner.origin(name)} vs {other.source} {other.origin(name)}")
    a_host, b_host = winner.coordinator_host, other.coordinator_host
    if a_host is not None and b_host is not None and not _same_host(a_host, b_host):
        out.append(
            f"coordinator host: {winner.source} {a_host!r} from {winner.origin('coordinator')} vs "
            f"{other.source} {b_host!r} from {other.origin('coordinator')}"
        )
    return out


def _same_host(a: str, b: str) -> bool:
    """Equal names, ignoring case and the part of a domain only one side has, as a DNS search path completes it:
    "node001" == "node001.cluster.local", "tpu-1.tpu" == "tpu-1.tpu.default.svc"."""
    a, b = a.lower().rstrip("."), b.lower().rstrip(".")
    if a == b:
        return True
    for name in (a, b):
        try:
            ipaddress.ip_address(name)
            return False
        except ValueError:
            pass
    shorter, longer = sorted((a, b), key=len)
    return longer.startswith(shorter + ".")
