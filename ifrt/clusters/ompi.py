"""Open MPI's ``mpirun`` / ``mpiexec`` (ORTE in Open MPI <= 4, PRRTE in Open MPI 5) and PRRTE's ``prterun``.

``mpirun -np 4 -H a:2,b:2 python train.py`` (Open MPI 4.1) sets, in rank 3:

    OMPI_COMM_WORLD_RANK=3 OMPI_COMM_WORLD_SIZE=4 OMPI_COMM_WORLD_LOCAL_RANK=1 OMPI_COMM_WORLD_LOCAL_SIZE=2
    OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://10.128.0.2,172.17.0.1:34911" PMIX_RANK=3

The coordinator host is mpirun's host, the first address in OMPI_MCA_orte_hnp_uri (as JAX does); set
IFRT_COORDINATOR to pick another interface. The port is ifrt's (DEFAULT_PORT or IFRT_COORDINATOR_PORT), not ORTE's.

Not detectable from the environment:

- the coordinator under Open MPI 5 / PRRTE: there is no hnp_uri, and PMIX_SERVER_URI* names the PMIx server of
  the process's own node (its local prted), not mpirun's host; coordinator is None.
- the process count and local values of a PMIx-only launch (``prterun`` of a non-MPI program: PRTE_LAUNCHED=1,
  PMIX_RANK, no OMPI_* variables): PMIx keeps them in its server (PMIx_Get), not in the environment. Only the
  process id (PMIX_RANK) is detected. Under ``srun --mpi=pmix`` the slurm detector applies, not this one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader, is_host

HNP_URI_ENV = "OMPI_MCA_orte_hnp_uri"  # Open MPI <= 4 mpirun only; examples in _hnp_host
RANK_ENV = "OMPI_COMM_WORLD_RANK"  # "3"
SIZE_ENV = "OMPI_COMM_WORLD_SIZE"  # "4"
LOCAL_RANK_ENV = "OMPI_COMM_WORLD_LOCAL_RANK"  # "1"
LOCAL_SIZE_ENV = "OMPI_COMM_WORLD_LOCAL_SIZE"  # "2": ranks of this job on this node
PRTE_LAUNCHED_ENV = "PRTE_LAUNCHED"  # "1": started by PRRTE (Open MPI 5 mpirun, prterun)
PMIX_RANK_ENV = "PMIX_RANK"  # "3": the rank in the PMIx namespace (the job)

_HNP_EXPECTED = "'<jobid>.<vpid>;tcp://<ip>[,<ip>...]:<port>' such as '1531576320.0;tcp://10.128.0.2:34911'"


def _hnp_host(uri: str) -> str | None:
    """mpirun's first address in an ORTE URI; None if there is none.

    "1531576320.0;tcp://10.96.0.1,10.148.0.1,10.108.0.1:34911" -> "10.96.0.1"
    "1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d:c083:150e::3000:2]:43370" -> "fe80::b9b:ac5d:9cf0:b858"
    "1531576320.0;tcp://10.0.0.1:34911;tcp6://[fe80::1]:34912" -> "10.0.0.1" (IPv4 first)
    """
    name, *contacts = uri.strip().split(";")
    if not re.fullmatch(r"[0-9]+\.[0-9]+", name):
        return None
    for scheme, pattern in (("tcp://", r"([^\[\]]+):[0-9]+"), ("tcp6://", r"\[([^\[\]]+)\]:[0-9]+")):
        for contact in contacts:
            m = re.fullmatch(pattern, contact[len(scheme):]) if contact.startswith(scheme) else None
            if m is not None:
                first = m[1].split(",")[0].strip()
                return first if is_host(first) else None
    return None


class Ompi(ClusterEnvironment):
    """Present under Open MPI's mpirun (OMPI_COMM_WORLD_SIZE or the ORTE URI) or a PRRTE launch (PMIX_RANK)."""

    name = "ompi"
    priority = 30

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Open MPI's variables, or PRRTE's marker with a PMIx rank."""
        return (
            SIZE_ENV in env
            or HNP_URI_ENV in env
            or (env.get(PRTE_LAUNCHED_ENV, "").strip() == "1" and PMIX_RANK_ENV in env)
        )

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """The OMPI_COMM_WORLD_* values (PMIX_RANK if there are none) and mpirun's host from the ORTE URI."""
        r = EnvReader(env, cls.name)
        coordinator = None
        uri = r.get(HNP_URI_ENV)
        if uri is not None:
            host = _hnp_host(uri)
            if host is None:
                raise r.error(HNP_URI_ENV, uri, _HNP_EXPECTED)
            r.note("coordinator", f"{HNP_URI_ENV}={uri!r}")
            coordinator = r.coordinator(host)
        rank_env = RANK_ENV if RANK_ENV in env or PMIX_RANK_ENV not in env else PMIX_RANK_ENV
        return r.detected(
            coordinator=coordinator,
            process_id=r.integer(rank_env, field="process_id", required=SIZE_ENV in env),
            num_processes=r.integer(SIZE_ENV, field="num_processes", minimum=1),
            local_rank=r.integer(LOCAL_RANK_ENV, field="local_rank"),
            local_world_size=r.integer(LOCAL_SIZE_ENV, field="local_world_size", minimum=1),
        )
