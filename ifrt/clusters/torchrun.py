"""torchrun (torch.distributed.run) and torch's ``env://`` convention, which torch.distributed.launch, Kubeflow's
PyTorchJob, accelerate and DeepSpeed's launcher share.

``torchrun --nnodes 2 --nproc-per-node 4 train.py`` sets, in the worker with local rank 2 on the second node:

    RANK=6 WORLD_SIZE=8 LOCAL_RANK=2 LOCAL_WORLD_SIZE=4 GROUP_RANK=1 GROUP_WORLD_SIZE=2
    MASTER_ADDR=node001.cluster MASTER_PORT=29500 TORCHELASTIC_RUN_ID=4242 TORCHELASTIC_RESTART_COUNT=0

MASTER_PORT is torch's own TCPStore, already taken: ifrt's coordinator is expected on MASTER_ADDR at DEFAULT_PORT
(or IFRT_COORDINATOR_PORT). Under an elastic rendezvous, MASTER_ADDR is the host of the node that got group rank 0.
LOCAL_WORLD_SIZE is torchrun's; torch.distributed.launch and hand-written launchers may leave it unset (None).
"""

from __future__ import annotations

from collections.abc import Mapping

from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # "4242": set by torchrun in every worker, whatever the rendezvous
MASTER_ADDR_ENV = "MASTER_ADDR"  # "node001.cluster" or "10.0.0.2": a bare host; its port is MASTER_PORT
RANK_ENV = "RANK"  # "6": the global rank
WORLD_SIZE_ENV = "WORLD_SIZE"  # "8": processes over all nodes
LOCAL_RANK_ENV = "LOCAL_RANK"  # "2": rank on this node
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"  # "4": processes on this node (torchrun only)
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # "1": how often this node's agent restarted its workers
# Not the job attempt: torchrun counts restarts per node (a node restarted because another failed keeps 0), so the
# workers of one restarted group disagree on it. They start a new run of the job instead (docs/pytorch.md).


class Torchrun(ClusterEnvironment):
    """Present when torchrun ran the process (TORCHELASTIC_RUN_ID) or MASTER_ADDR, RANK and WORLD_SIZE are all set."""

    name = "torchrun"
    priority = 40

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """torchrun's marker, or the three variables torch's env:// initialization needs."""
        return RUN_ID_ENV in env or all(v in env for v in (MASTER_ADDR_ENV, RANK_ENV, WORLD_SIZE_ENV))

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and MASTER_ADDR with ifrt's port."""
        r = EnvReader(env, cls.name)
        r.get(RUN_ID_ENV)
        return r.detected(
            coordinator=r.coordinator(r.host(MASTER_ADDR_ENV)),
            process_id=r.integer(RANK_ENV, field="process_id", required=True),
            num_processes=r.integer(WORLD_SIZE_ENV, field="num_processes", minimum=1, required=True),
            local_rank=r.integer(LOCAL_RANK_ENV, field="local_rank"),
            local_world_size=r.integer(LOCAL_WORLD_SIZE_ENV, field="local_world_size", minimum=1),
        )
