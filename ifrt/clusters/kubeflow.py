"""Kubeflow Trainer (``trainer.kubeflow.org`` TrainJobs): its JAX and torch runtimes, one pod per node.

The JAX runtime sets, in node 1 of TrainJob ``llm`` (3 nodes):

    JAX_NUM_PROCESSES=3 JAX_PROCESS_ID=1 JAX_COORDINATOR_ADDRESS=llm-node-0-0.llm:<port> JAX_COORDINATOR_PORT=<port>

(JAX_PROCESS_ID is the pod's Job completion index through the downward API.) The torch runtime sets the inputs of
the ``torchrun`` it starts in every node:

    PET_NNODES=2 PET_NPROC_PER_NODE=4 PET_NODE_RANK=1 PET_MASTER_ADDR=llm-node-0-0.llm PET_MASTER_PORT=29500

torchrun's workers are found by the torchrun detector (it wins: it runs inside). A process that reads the PET_*
variables itself is a node: with PET_NPROC_PER_NODE=1 (or unset) it is process PET_NODE_RANK of PET_NNODES; with
several processes per node the count is PET_NNODES x PET_NPROC_PER_NODE and which of them this is stays unknown
(None); "auto", "cpu" and "gpu" leave the count unknown too. The coordinator is the runtime's coordinator host at
DEFAULT_PORT or IFRT_COORDINATOR_PORT (the runtimes' own ports are JAX's and torch's, already taken).
"""

from __future__ import annotations

from collections.abc import Mapping

from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader

# kubeflow/trainer pkg/runtime/framework/plugins/jax/jax.go
JAX_NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"  # "3": one process per node
JAX_PROCESS_ID_ENV = "JAX_PROCESS_ID"  # "1": the pod's completion index
JAX_COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # "llm-node-0-0.llm:<port>": node 0's pod, with JAX's port
JAX_COORDINATOR_PORT_ENV = "JAX_COORDINATOR_PORT"  # JAX's port (not ifrt's; read for messages only)
# kubeflow/trainer pkg/constants/constants.go: torchrun's PET_* variables
NNODES_ENV = "PET_NNODES"  # "2"
NPROC_PER_NODE_ENV = "PET_NPROC_PER_NODE"  # "4", or "auto", "cpu", "gpu" (torchrun decides)
NODE_RANK_ENV = "PET_NODE_RANK"  # "1": the pod's completion index
MASTER_ADDR_ENV = "PET_MASTER_ADDR"  # "llm-node-0-0.llm": node 0's pod, a bare host
MASTER_PORT_ENV = "PET_MASTER_PORT"  # "29500": torch's TCPStore (not ifrt's; read for messages only)

_JAX = (JAX_PROCESS_ID_ENV, JAX_NUM_PROCESSES_ENV, JAX_COORDINATOR_ENV)
_TORCH = (NODE_RANK_ENV, NNODES_ENV, MASTER_ADDR_ENV)


class KubeflowTrainer(ClusterEnvironment):
    """Present when the JAX runtime's three variables, or the torch runtime's node rank, count and master are set."""

    name = "kubeflow"
    priority = 16

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """All of one runtime's variables: JAX_PROCESS_ID, JAX_NUM_PROCESSES, JAX_COORDINATOR_ADDRESS, or the
        PET_* node rank, node count and master address."""
        return all(v in env for v in _JAX) or all(v in env for v in _TORCH)

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """The JAX runtime's values if present, else the torch runtime's node values."""
        r = EnvReader(env, cls.name)
        if all(v in env for v in _JAX):
            r.get(JAX_COORDINATOR_PORT_ENV)
            return r.detected(
                coordinator=r.coordinator(r.address(JAX_COORDINATOR_ENV)),
                process_id=r.integer(JAX_PROCESS_ID_ENV, field="process_id", required=True),
                num_processes=r.integer(JAX_NUM_PROCESSES_ENV, field="num_processes", minimum=1, required=True),
            )
        coordinator = r.coordinator(r.host(MASTER_ADDR_ENV))
        node = r.integer(NODE_RANK_ENV, required=True)
        nodes = r.integer(NNODES_ENV, required=True, minimum=1)
        r.get(MASTER_PORT_ENV)
        raw = r.get(NPROC_PER_NODE_ENV)
        per_node = 1 if raw is None else None
        if raw is not None and raw.strip() not in ("auto", "cpu", "gpu"):
            per_node = r.integer(NPROC_PER_NODE_ENV, minimum=1)
        assert node is not None and nodes is not None
        if node >= nodes:
            raise r.error(NODE_RANK_ENV, env[NODE_RANK_ENV], f"a node rank below {NNODES_ENV}={env[NNODES_ENV]!r}")
        if per_node is None:
            return r.detected(coordinator=coordinator)
        count_origin = f"{NNODES_ENV}={env[NNODES_ENV]!r}" + (f" x {NPROC_PER_NODE_ENV}={raw!r}" if raw else "")
        r.note("num_processes", count_origin)
        if per_node == 1:
            r.note("process_id", f"{NODE_RANK_ENV}={env[NODE_RANK_ENV]!r}")
            return r.detected(coordinator=coordinator, process_id=node, num_processes=nodes, local_world_size=1)
        r.note("local_world_size", f"{NPROC_PER_NODE_ENV}={raw!r}")
        return r.detected(coordinator=coordinator, num_processes=nodes * per_node, local_world_size=per_node)
