"""The JobSet resource's schema, for checking deploy/kubernetes/workers/jobset.yaml offline.

Written from JobSet's published CRD, kubernetes-sigs/jobset config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml
(version v1alpha2, the openAPIV3Schema of ``spec``; commit 01078527ec43): every field of the JobSet itself, with
unknown fields refused as the API server's structural schema prunes them. The CRD embeds Kubernetes' own Job spec
under ``replicatedJobs[].template``; the test checks that part with kubernetes-validate's batch/v1 Job schema, so
it is left open here.
"""

from __future__ import annotations

from typing import Any

_INT = {"type": "integer"}
_STR = {"type": "string"}
_STRS = {"type": "array", "items": _STR}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


JOBSET_V1ALPHA2: dict[str, Any] = _obj({
    "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
    "kind": {"const": "JobSet"},
    "metadata": {"type": "object"},
    "spec": _obj({
        "coordinator": _obj({"jobIndex": _INT, "podIndex": _INT, "replicatedJob": _STR}, ("replicatedJob",)),
        "failurePolicy": _obj({
            "maxRestarts": _INT,
            "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
            "rules": {"type": "array", "items": _obj({
                "action": {"enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"]},
                "name": _STR, "onJobFailureReasons": _STRS, "targetReplicatedJobs": _STRS,
            }, ("action", "name"))},
        }),
        "managedBy": _STR,
        "network": _obj({"enableDNSHostnames": {"type": "boolean"}, "publishNotReadyAddresses": {"type": "boolean"},
                         "subdomain": _STR}),
        "replicatedJobs": {"type": "array", "items": _obj({
            "dependsOn": {"type": "array", "maxItems": 1, "items": _obj(
                {"name": _STR, "status": {"enum": ["Ready", "Complete"]}}, ("name", "status"))},
            "groupName": _STR,
            "name": _STR,
            "replicas": {"type": "integer", "minimum": 0},
            "template": _obj({"metadata": {"type": "object"}, "spec": {"type": "object"}}),
        }, ("name", "template"))},
        "startupPolicy": _obj({"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}, ("startupPolicyOrder",)),
        "successPolicy": _obj({"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _STRS}, ("operator",)),
        "suspend": {"type": "boolean"},
        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
    }),
    "status": {"type": "object"},
}, ("apiVersion", "kind", "metadata", "spec"))
"""JSON schema of a JobSet object (jobset.x-k8s.io/v1alpha2), its child Job templates left to the Job schema."""
