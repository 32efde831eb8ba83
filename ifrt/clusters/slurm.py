"""SLURM: processes started by ``srun`` (a job step), or a batch script run by ``sbatch``.

``srun -N3 -n6 python train.py`` on node[001-003] sets, in task 3 (the second task of node002):

    SLURM_JOB_ID=4242 SLURM_PROCID=3 SLURM_LOCALID=1 SLURM_NODEID=1 SLURM_NTASKS=6 SLURM_STEP_NUM_TASKS=6
    SLURM_STEP_NODELIST=node[001-003] SLURM_STEP_TASKS_PER_NODE=2(x3) SLURM_JOB_NODELIST=node[001-003]

The coordinator is the step's first node (the job's outside a step) at DEFAULT_PORT or IFRT_COORDINATOR_PORT.
Outside a step (a batch script, an salloc shell) SLURM_NTASKS is the job's task count, which counts processes
only if the script starts one per task; an salloc shell has no SLURM_PROCID (process id None).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader, is_host
from ifrt.clusters.hostlist import iter_hostlist

JOB_ID_ENV = "SLURM_JOB_ID"  # "4242": set in every job, step or not
PROCID_ENV = "SLURM_PROCID"  # "3": the task's rank in the step
STEP_NUM_TASKS_ENV = "SLURM_STEP_NUM_TASKS"  # "6": tasks in this step (srun only)
NTASKS_ENV = "SLURM_NTASKS"  # "6": the step's tasks under srun, the job's in a batch script
LOCALID_ENV = "SLURM_LOCALID"  # "1": the task's rank on its node
NODEID_ENV = "SLURM_NODEID"  # "1": this node's index in the node list
STEP_TASKS_PER_NODE_ENV = "SLURM_STEP_TASKS_PER_NODE"  # "2(x3),1": see tasks_on_node
TASKS_PER_NODE_ENV = "SLURM_TASKS_PER_NODE"  # same form, the job's
STEP_NODELIST_ENV = "SLURM_STEP_NODELIST"  # "node[001-003,007],gpu5": see ifrt.clusters.hostlist
JOB_NODELIST_ENV = "SLURM_JOB_NODELIST"  # same form, the job's
NODELIST_ENV = "SLURM_NODELIST"  # the older name of SLURM_JOB_NODELIST
RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"  # "1": how often the job was requeued (unset before the first requeue)

_TASKS_EXPECTED = "comma-separated task counts, each optionally repeated, such as '2(x3),1'"


def tasks_on_node(value: str, node: int | None) -> int | None:
    """Tasks on node ``node`` from a tasks-per-node list: "2(x3),1" means 2, 2, 2, 1, so node 3 has 1.

    Without a node index the count is known only if every node has the same ("4(x2)" -> 4). ValueError if
    malformed, IndexError if ``node`` is past the list.
    """
    runs = []  # (count, repeat): never expanded, "1(x100000)" is one run
    for part in value.split(","):
        m = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part.strip())
        if m is None:
            raise ValueError(part)
        runs.append((int(m[1]), int(m[2] or 1)))
    if node is None:
        return runs[0][0] if len({count for count, _ in runs}) == 1 else None
    for count, repeat in runs:
        if node < repeat:
            return count
        node -= repeat
    raise IndexError(node)


class Slurm(ClusterEnvironment):
    """Present in any SLURM job (SLURM_JOB_ID); a job step (srun) gives every value."""

    name = "slurm"
    priority = 20

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """SLURM sets SLURM_JOB_ID in every job."""
        return JOB_ID_ENV in env

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """The task's rank, the step's counts, and the first node of the step as coordinator host."""
        r = EnvReader(env, cls.name)
        r.require(JOB_ID_ENV, "the job id")
        process_id = r.integer(PROCID_ENV, field="process_id")
        count_env, _ = r.first(STEP_NUM_TASKS_ENV, NTASKS_ENV)
        num_processes = None if count_env is None else r.integer(count_env, field="num_processes", minimum=1)
        local_rank = r.integer(LOCALID_ENV, field="local_rank")
        node = r.integer(NODEID_ENV)
        local_world_size = None
        tpn_env, tpn = r.first(STEP_TASKS_PER_NODE_ENV, TASKS_PER_NODE_ENV)
        if tpn_env is not None and tpn is not None:
            try:
                local_world_size = tasks_on_node(tpn, node)
            except ValueError:
                raise r.error(tpn_env, tpn, _TASKS_EXPECTED) from None
            except IndexError:
                raise r.error(NODEID_ENV, env[NODEID_ENV], f"a node index below the {tpn_env}={tpn!r} nodes") from None
            r.note("local_world_size", f"{tpn_env}={tpn!r}" + (f" at {NODEID_ENV}={node}" if node is not None else ""))
        coordinator = None
        list_env, nodes = r.first(STEP_NODELIST_ENV, JOB_NODELIST_ENV, NODELIST_ENV)
        if list_env is not None and nodes is not None:
            try:
                first = next(iter_hostlist(nodes))
                if not is_host(first):
                    raise ValueError(f"{first!r} is not a host name")
            except ValueError as e:
                raise r.error(list_env, nodes, f"a SLURM host list such as 'node[001-003,007],gpu5' ({e})") from None
            r.note("coordinator", f"{list_env}={nodes!r}")
            coordinator = r.coordinator(first)
        return r.detected(
            coordinator=coordinator,
            process_id=process_id,
            num_processes=num_processes,
            local_rank=local_rank,
            local_world_size=local_world_size,
            attempt=r.integer(RESTART_COUNT_ENV, field="attempt"),
        )
