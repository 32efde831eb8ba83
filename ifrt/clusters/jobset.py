"""JobSet (``jobset.x-k8s.io``): child Jobs made from replicated Job templates, their pods numbered across the set.

JobSet labels and annotates each pod with its Job's place in the set; the pod template passes them in through
the downward API under these names (ifrt's choice: deploy/kubernetes/workers-jobset.yaml sets them):

    JOBSET_JOB_INDEX            metadata.annotations['jobset.sigs.k8s.io/job-index']               "1"
    JOBSET_JOB_GLOBAL_INDEX     metadata.annotations['jobset.sigs.k8s.io/job-global-index']        "1"
    JOBSET_REPLICATED_JOB_REPLICAS  metadata.annotations['jobset.sigs.k8s.io/replicatedjob-replicas']  "2"
    JOBSET_GLOBAL_REPLICAS      metadata.annotations['jobset.sigs.k8s.io/global-replicas']         "2"
    JOBSET_COORDINATOR          metadata.annotations['jobset.sigs.k8s.io/coordinator']   "js-driver-0-0.js"
    JOBSET_PODS_PER_JOB         the replicated Job's ``parallelism`` (a value in the template)      "2"

and Kubernetes sets JOB_COMPLETION_INDEX (the pod within its child Job). Pod 1 of child Job 1 above is process
1 x 2 + 1 = 3 of 2 x 2 = 4. The global index and global replicas count every replicated Job, so all child Jobs must
have JOBSET_PODS_PER_JOB pods; without the global variables, the replicated Job's own are used. Without
JOBSET_PODS_PER_JOB each child Job is one pod. The coordinator is the JobSet's coordinator pod (``spec.coordinator``)
at DEFAULT_PORT or IFRT_COORDINATOR_PORT; the downward API gives "" for an annotation the pod lacks, read as unset.
"""

from __future__ import annotations

from collections.abc import Mapping

from ifrt.clusters.base import ClusterEnvironment, Detected, EnvReader

INDEX_ENV = "JOB_COMPLETION_INDEX"  # "1": the pod within its child Job (an Indexed Job)
JOB_INDEX_ENV = "JOBSET_JOB_INDEX"  # "1": the child Job within its replicated Job
JOB_GLOBAL_INDEX_ENV = "JOBSET_JOB_GLOBAL_INDEX"  # "3": the child Job within the whole JobSet
REPLICAS_ENV = "JOBSET_REPLICATED_JOB_REPLICAS"  # "2": child Jobs of this replicated Job
GLOBAL_REPLICAS_ENV = "JOBSET_GLOBAL_REPLICAS"  # "4": child Jobs of the whole JobSet
COORDINATOR_ENV = "JOBSET_COORDINATOR"  # "js-driver-0-0.js": <jobset>-<job>-<job index>-<pod index>.<subdomain>
PODS_PER_JOB_ENV = "JOBSET_PODS_PER_JOB"  # "2": pods in each child Job (its parallelism and completions)

MARKERS = (JOB_INDEX_ENV, JOB_GLOBAL_INDEX_ENV)
"""Variables that say a pod is a JobSet's: its completion index is then per child Job, not the process id."""


def _set(env: Mapping[str, str], var: str) -> bool:
    """Whether ``var`` has a value (the downward API gives "" for a missing annotation)."""
    return bool(env.get(var, "").strip())


class JobSet(ClusterEnvironment):
    """Present when the job-index or job-global-index annotation reached the environment."""

    name = "jobset"
    priority = 12

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """JOBSET_JOB_GLOBAL_INDEX or JOBSET_JOB_INDEX is set and not empty."""
        return any(_set(env, v) for v in MARKERS)

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """The child Job's global index x pods per Job + the completion index; replicas x pods per Job."""
        r = EnvReader(env, cls.name)
        global_ = _set(env, JOB_GLOBAL_INDEX_ENV)
        job_env = JOB_GLOBAL_INDEX_ENV if global_ else JOB_INDEX_ENV
        count_env = GLOBAL_REPLICAS_ENV if global_ else REPLICAS_ENV
        job = r.integer(job_env, required=True)
        jobs = r.integer(count_env, minimum=1) if _set(env, count_env) else None
        pods = r.integer(PODS_PER_JOB_ENV, minimum=1) if _set(env, PODS_PER_JOB_ENV) else None
        pod = r.integer(INDEX_ENV) if _set(env, INDEX_ENV) else None
        assert job is not None
        if pods is None and pod:
            raise r.error(INDEX_ENV, env[INDEX_ENV], f"0, as {PODS_PER_JOB_ENV} is not set (one pod per child Job): "
                                                     f"set {PODS_PER_JOB_ENV} to the replicated Job's parallelism")
        per_job = pods or 1
        if pod is not None and pod >= per_job:
            raise r.error(INDEX_ENV, env[INDEX_ENV], f"a completion index below {PODS_PER_JOB_ENV}={per_job}")
        if jobs is not None and job >= jobs:
            raise r.error(job_env, env[job_env], f"a job index below {count_env}={env[count_env]!r}")
        per_job_origin = f" x {PODS_PER_JOB_ENV}={env[PODS_PER_JOB_ENV]!r}" if pods is not None else ""
        r.note("process_id", f"{job_env}={env[job_env]!r}{per_job_origin}"
               + (f" + {INDEX_ENV}={env[INDEX_ENV]!r}" if pod is not None else ""))
        if jobs is not None:
            r.note("num_processes", f"{count_env}={env[count_env]!r}{per_job_origin}")
        coordinator = None
        if _set(env, COORDINATOR_ENV):
            coordinator = r.coordinator(r.address(COORDINATOR_ENV))
        return r.detected(
            coordinator=coordinator,
            process_id=job * per_job + (pod or 0),
            num_processes=None if jobs is None else jobs * per_job,
        )
