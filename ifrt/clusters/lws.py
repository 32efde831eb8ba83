"""LeaderWorkerSet (``leaderworkerset.x-k8s.io``): groups of pods, one leader and its workers, each group one job.

Worker 2 of group 0 of LeaderWorkerSet ``vllm`` (size 4, namespace ``default``) has, from LWS's pod webhook:

    LWS_LEADER_ADDRESS=vllm-0.vllm.default LWS_GROUP_SIZE=4 LWS_WORKER_INDEX=2

The process id is the worker index (the leader is 0), the process count the group size, and the coordinator the
leader's address at DEFAULT_PORT or IFRT_COORDINATOR_PORT: each group is its own cluster, so run one coordinator
per group (in the leader pod) or give each group its own ``--cluster-id``. A pod is one process: local rank and
local world size are not given.
"""

from __future__ import annotations

from collections.abc import Mapping

from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader

# The LeaderWorkerSet API's constants (api/leaderworkerset/v1: LwsLeaderAddress, LwsGroupSize, LwsWorkerIndex).
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # "vllm-0.vllm.default": <lws>-<group>.<lws>.<namespace>, the leader pod
GROUP_SIZE_ENV = "LWS_GROUP_SIZE"  # "4": pods in the group, the leader included
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"  # "2": this pod in its group; the leader is 0


class LeaderWorkerSet(ClusterEnvironment):
    """Present in every container of a LeaderWorkerSet pod (LWS_LEADER_ADDRESS and LWS_WORKER_INDEX)."""

    name = "lws"
    priority = 14

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """LWS's webhook sets its three variables together in every container."""
        return LEADER_ADDRESS_ENV in env and WORKER_INDEX_ENV in env

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """The worker index, the group size, and the leader's address as coordinator host."""
        r = EnvReader(env, cls.name)
        return r.detected(
            coordinator=r.coordinator(r.host(LEADER_ADDRESS_ENV)),
            process_id=r.integer(WORKER_INDEX_ENV, field="process_id", required=True),
            num_processes=r.integer(GROUP_SIZE_ENV, field="num_processes", minimum=1, required=True),
        )
