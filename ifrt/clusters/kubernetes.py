"""Kubernetes Indexed Jobs (``completionMode: Indexed``) with a headless Service as the pods' ``subdomain``.

Pod 2 of Job ``trainer`` (subdomain ``workers``, namespace ``default``) has:

    JOB_COMPLETION_INDEX=2 KUBERNETES_SERVICE_HOST=10.96.0.1 HOSTNAME=trainer-2
    FQDN (socket.getfqdn(), from the /etc/hosts kubelet writes) trainer-2.workers.default.svc.cluster.local

The process id is the index. The coordinator is pod 0 behind the same Service, at DEFAULT_PORT or
IFRT_COORDINATOR_PORT: trainer-0.workers.default.svc.cluster.local:8476. The FQDN is a parameter of detect()
(tests pass one; the default asks socket.getfqdn()), so no cluster and no Kubernetes API are needed.

Not detectable from the environment: the process count (the Job's ``parallelism`` is only in the API; set
IFRT_NUM_PROCESSES or let the coordinator decide), local rank and local world size (a pod is usually one process).
The coordinator is None when the pod has no subdomain (its FQDN is a bare hostname) or its hostname is not
``<job>-<index>`` (a ``hostname:`` set in the pod template).

In a JobSet's child Job, or one slice of a TPU multislice job, the index counts within that child Job only, and in
a Kubeflow TrainJob it is the node rank, not a process's: when the JobSet's index variables, MEGASCALE_SLICE_ID or
a Kubeflow runtime's variables are set, this detector stands aside for the jobset, tpu or kubeflow one, which
read the index with its meaning (otherwise those pods would log a disagreement at every start).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

from ifrt.clusters import jobset, kubeflow, tpu
from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader, is_host

INDEX_ENV = "JOB_COMPLETION_INDEX"  # "2": the pod's index in an Indexed Job, 0 to completions - 1
SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"  # "10.96.0.1": the API server, set in every pod

logger = logging.getLogger("ifrt.clusters")


def index_zero_host(fqdn: str, index: int) -> str | None:
    """The FQDN of pod 0 given pod ``index``'s FQDN, or None if ``fqdn`` is not "<job>-<index>.<subdomain>...".

    "trainer-2.workers.default.svc.cluster.local", 2 -> "trainer-0.workers.default.svc.cluster.local"
    "my-job-12.svc-a.ns.svc", 12 -> "my-job-0.svc-a.ns.svc" (job names may hold "-" and digits)
    "trainer-2", 2 -> None (no subdomain: no DNS name for the other pods)
    """
    hostname, dot, domain = fqdn.strip().rstrip(".").partition(".")
    suffix = f"-{index}"
    if not dot or not domain or not hostname.endswith(suffix) or len(hostname) == len(suffix):
        return None
    host = f"{hostname[: -len(suffix)]}-0.{domain}"
    return host if is_host(host) else None


class Kubernetes(ClusterEnvironment):
    """Present in a pod of an Indexed Job (JOB_COMPLETION_INDEX and KUBERNETES_SERVICE_HOST both set)."""

    name = "kubernetes"
    priority = 10

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Every pod has KUBERNETES_SERVICE_HOST; only an Indexed Job's pods have JOB_COMPLETION_INDEX (read by
        another detector in a JobSet's, a TPU slice's or a TrainJob's child Job)."""
        read_elsewhere = (jobset.JobSet.is_present(env) or tpu.SLICE_ID_ENV in env
                          or kubeflow.KubeflowTrainer.is_present(env))
        return INDEX_ENV in env and SERVICE_HOST_ENV in env and not read_elsewhere

    @classmethod
    def detect(cls, env: Mapping[str, str], fqdn: str | None = None) -> Detected:
        """The index as process id, and pod 0's DNS name (from ``fqdn``, default socket.getfqdn()) as coordinator."""
        r = EnvReader(env, cls.name)
        index = r.integer(INDEX_ENV, field="process_id", required=True)
        r.get(SERVICE_HOST_ENV)
        assert index is not None
        name = socket.getfqdn() if fqdn is None else fqdn
        host = index_zero_host(name, index)
        coordinator = None
        if host is None:
            logger.debug("kubernetes: pod FQDN %r is not <job>-%d.<subdomain>...; no coordinator derived", name, index)
        else:
            r.note("coordinator", f"pod FQDN {name!r}")
            coordinator = r.coordinator(host)
        return r.detected(coordinator=coordinator, process_id=index)
