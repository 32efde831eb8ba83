"""deploy/kubernetes/, checked offline: every manifest against Kubernetes' schemas (kubernetes-validate --strict), the
JobSet against its CRD's, and a worker pod's environment rendered from the manifests and given to discover()'s
settings: the right process id, count and coordinator come out."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from coordinator.main import parser as coordinator_parser
from coordinator.service import SERVICE
from ifrt.settings import resolve
from tests.helpers import BIN
from tests.jobset_schema import JOBSET_V1ALPHA2

DEPLOY = Path(__file__).parents[1] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"  # the newest whose schemas kubernetes-validate ships
BUILTIN = [DEPLOY / "job-config.yaml", DEPLOY / "etcd.yaml", DEPLOY / "coordinator.yaml",
           DEPLOY / "workers" / "indexed-job.yaml"]
TOKEN = "s3cret-token-of-the-job"


def docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def find(path: Path, kind: str) -> dict:
    [found] = [d for d in docs(path) if d["kind"] == kind]
    return found


def config() -> dict[str, str]:
    return find(DEPLOY / "job-config.yaml", "ConfigMap")["data"]


# --- schemas -----------------------------------------------------------------------------------------------------


def test_every_builtin_manifest_passes_kubernetes_validate_strict():
    out = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION,
                          *map(str, BUILTIN)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    passed = re.findall(r"passed for resource (\S+)", out.stdout)
    assert sorted(passed) == sorted(f"{d['kind'].lower()}/{d['metadata']['name']}"
                                    for p in BUILTIN for d in docs(p))
    assert "WARN" not in out.stdout + out.stderr


def test_the_kustomization_lists_the_coordinator_side_and_every_file_exists():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["job-config.yaml", "etcd.yaml", "coordinator.yaml"]
    tls = yaml.safe_load((DEPLOY / "tls" / "kustomization.yaml").read_text())
    assert tls["resources"] == [".."]
    for patch in tls["patches"]:
        assert (DEPLOY / "tls" / patch["path"]).is_file()


def test_strict_validation_refuses_a_misspelt_field(tmp_path):
    # The check above can fail: a field the API server would drop silently is an error here.
    text = (DEPLOY / "coordinator.yaml").read_text().replace("publishNotReadyAddresses", "publishNotReadyAdresses")
    (tmp_path / "bad.yaml").write_text(text)
    out = subprocess.run([str(BIN / "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION,
                          str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "publishNotReadyAdresses" in out.stdout + out.stderr


def test_the_jobset_matches_its_crd_and_its_job_template_the_job_schema():
    jobset = find(DEPLOY / "workers" / "jobset.yaml", "JobSet")
    jsonschema.validate(jobset, JOBSET_V1ALPHA2)
    for replicated in jobset["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": replicated["name"]},
               "spec": replicated["template"]["spec"]}
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
    with pytest.raises(jsonschema.ValidationError, match="replicatedJob"):
        jsonschema.validate(jobset | {"spec": jobset["spec"] | {"coordinator": {"jobIndex": 0}}}, JOBSET_V1ALPHA2)


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """``args`` with the kubelet's $(VAR) references to the container's variables filled in."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in args]


def json_patch(document: dict, operations: list[dict]) -> dict:
    """``document`` with RFC 6902 add/replace operations applied (what kustomize does with the tls/ patches)."""
    for op in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: object = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]  # type: ignore[index]
        if isinstance(target, list):
            target.append(op["value"]) if last == "-" else target.insert(int(last), op["value"])
        else:
            assert op["op"] in ("add", "replace"), op
            assert isinstance(target, dict) and (op["op"] == "add" or last in target), op
            target[last] = op["value"]
    return document


def test_the_tls_overlay_patches_validate_and_give_the_coordinator_its_certificate():
    tls = yaml.safe_load((DEPLOY / "tls" / "kustomization.yaml").read_text())
    patched = {}
    for patch in tls["patches"]:
        kind = patch["target"]["kind"]
        source = DEPLOY / ("coordinator.yaml" if kind == "StatefulSet" else "job-config.yaml")
        patched[kind] = json_patch(find(source, kind), yaml.safe_load((DEPLOY / "tls" / patch["path"]).read_text()))
        kubernetes_validate.validate(patched[kind], KUBERNETES_VERSION, strict=True)
    [container] = patched["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    env = patched["ConfigMap"]["data"] | {"POD_NAME": "ifrt-coordinator-0"}
    parsed = coordinator_parser().parse_args(expand(container["args"], env))
    assert (parsed.tls_cert, parsed.tls_key) == ("/etc/ifrt/tls/tls.crt", "/etc/ifrt/tls/tls.key")
    assert {"name": "tls", "mountPath": "/etc/ifrt/tls", "readOnly": True} in container["volumeMounts"]
    assert "grpc" not in container["readinessProbe"]  # the kubelet's gRPC probe speaks no TLS
    # Workers mount the same Secret where it exists, at the path the ConfigMap now names.
    worker = find(DEPLOY / "workers" / "indexed-job.yaml", "Job")["spec"]["template"]["spec"]
    [mount] = [m for m in worker["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    assert env["IFRT_TLS_CA"].startswith(mount["mountPath"] + "/")
    assert {"name": "tls", "secret": {"secretName": "ifrt-tls", "optional": True}} in worker["volumes"]


# --- the coordinator ---------------------------------------------------------------------------------------------


def test_the_coordinators_arguments_expand_to_a_command_line_it_accepts():
    statefulset = find(DEPLOY / "coordinator.yaml", "StatefulSet")
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    env = config() | {"POD_NAME": "ifrt-coordinator-1"}
    parsed = coordinator_parser().parse_args(expand(container["args"], env))
    assert parsed.num_processes == int(config()["IFRT_NUM_PROCESSES"])
    assert parsed.advertise == "ifrt-coordinator-1.ifrt-coordinator:8476"
    # Clients list every replica by the name it advertises.
    replicas = [f"ifrt-coordinator-{i}.ifrt-coordinator:8476" for i in range(statefulset["spec"]["replicas"])]
    assert config()["IFRT_COORDINATOR"].split(",") == replicas
    assert parsed.store == "etcd://" + ",".join(f"ifrt-etcd-{i}.ifrt-etcd:2379" for i in range(3))


def test_readiness_asks_the_health_service_for_the_coordinator_and_the_service_lists_every_replica():
    [container] = find(DEPLOY / "coordinator.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["grpc"] == {"port": 8476, "service": SERVICE}
    assert "tcpSocket" in container["livenessProbe"]  # a standby is NOT_SERVING but alive
    service = find(DEPLOY / "coordinator.yaml", "Service")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True


# --- workers: the environment a pod gets, given to discover()'s settings ------------------------------------------


def render_env(container: dict, annotations: dict[str, str], mounts: dict[str, Path]) -> dict[str, str]:
    """The variables a container starts with: envFrom's ConfigMap (ours), env values, downward API annotations
    ("" for an annotation the pod lacks, as the kubelet gives), and mount paths moved to ``mounts``."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == "ifrt-job"
        env |= config()
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
            assert m, path
            env[var["name"]] = annotations.get(m[1], "")
    for var, value in env.items():
        for mount_path, local in mounts.items():
            if value.startswith(mount_path + "/"):
                env[var] = str(local / value[len(mount_path) + 1:])
    return env


def mounted_secret(pod_spec: dict, container: dict, tmp_path: Path) -> dict[str, Path]:
    """The token Secret's mount, as a local folder holding its key."""
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "token"]
    [volume] = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "ifrt-token"
    folder = tmp_path / "token"
    folder.mkdir(exist_ok=True)
    (folder / "token").write_text(TOKEN)
    (folder / "token").chmod(0o400)
    return {mount["mountPath"]: folder}


def kubernetes_pod_env(index: int, hostname: str) -> dict[str, str]:
    """What Kubernetes itself puts in an Indexed Job's pod."""
    return {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": hostname, "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "KUBERNETES_SERVICE_PORT": "443", "PATH": "/opt/ifrt/bin:/usr/bin:/bin"}


def indexed_job_pods(tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    job = find(DEPLOY / "workers" / "indexed-job.yaml", "Job")
    pod_spec = job["spec"]["template"]["spec"]
    [container] = pod_spec["containers"]
    mounts = mounted_secret(pod_spec, container, tmp_path)
    for index in range(job["spec"]["completions"]):
        env = render_env(container, {"batch.kubernetes.io/job-completion-index": str(index)}, mounts)
        yield index, env | kubernetes_pod_env(index, f"ifrt-workers-{index}")


def test_an_indexed_job_pod_gets_its_index_the_count_and_every_replica(tmp_path, monkeypatch):
    monkeypatch.setattr("ifrt.clusters.kubernetes.socket.getfqdn", lambda: "ifrt-workers-0.ifrt-workers.ns.svc")
    seen = []
    for index, env in indexed_job_pods(tmp_path):
        settings = resolve(environ=env)
        seen.append((index, settings.process_id))
        assert settings.launcher == "kubernetes"
        assert settings.num_processes == int(config()["IFRT_NUM_PROCESSES"]) == 4
        assert settings.coordinators == ("ifrt-coordinator-0.ifrt-coordinator:8476",
                                         "ifrt-coordinator-1.ifrt-coordinator:8476")
        assert (settings.cluster_id, settings.token) == ("job-1", TOKEN)
    assert seen == [(0, 0), (1, 1), (2, 2), (3, 3)]


def jobset_pods(tmp_path: Path) -> Iterator[tuple[int, int, dict[str, str]]]:
    """Every pod of the JobSet with the annotations JobSet's controller gives it (labelAndAnnotateObject)."""
    jobset = find(DEPLOY / "workers" / "jobset.yaml", "JobSet")
    name, replicated_jobs = jobset["metadata"]["name"], jobset["spec"]["replicatedJobs"]
    global_replicas = sum(r["replicas"] for r in replicated_jobs)
    offset = 0
    for replicated in replicated_jobs:
        pod_spec = replicated["template"]["spec"]["template"]["spec"]
        [container] = pod_spec["containers"]
        mounts = mounted_secret(pod_spec, container, tmp_path)
        for job_index in range(replicated["replicas"]):
            annotations = {
                "jobset.sigs.k8s.io/jobset-name": name,
                "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                "jobset.sigs.k8s.io/replicatedjob-replicas": str(replicated["replicas"]),
                "jobset.sigs.k8s.io/global-replicas": str(global_replicas),
                "jobset.sigs.k8s.io/job-index": str(job_index),
                "jobset.sigs.k8s.io/job-global-index": str(offset + job_index),
            }  # no jobset.sigs.k8s.io/coordinator: the manifest names no spec.coordinator
            for pod in range(replicated["template"]["spec"]["completions"]):
                env = render_env(container, annotations | {"batch.kubernetes.io/job-completion-index": str(pod)},
                                 mounts)
                yield offset + job_index, pod, env | kubernetes_pod_env(pod, f"{name}-{replicated['name']}-"
                                                                             f"{job_index}-{pod}")
        offset += replicated["replicas"]


def test_a_jobset_pod_gets_a_process_id_numbered_across_its_child_jobs(tmp_path, caplog):
    seen = []
    for job, pod, env in jobset_pods(tmp_path):
        settings = resolve(environ=env)
        assert settings.launcher == "jobset"
        seen.append(((job, pod), settings.process_id))
        assert settings.num_processes == 4
        assert settings.coordinators[0] == "ifrt-coordinator-0.ifrt-coordinator:8476"
        assert settings.token == TOKEN
    assert seen == [((0, 0), 0), ((0, 1), 1), ((1, 0), 2), ((1, 1), 3)]
    assert "disagree" not in caplog.text


def test_the_worker_counts_agree_with_the_jobs_configmap():
    count = int(config()["IFRT_NUM_PROCESSES"])
    job = find(DEPLOY / "workers" / "indexed-job.yaml", "Job")["spec"]
    assert job["completions"] == job["parallelism"] == count
    [replicated] = find(DEPLOY / "workers" / "jobset.yaml", "JobSet")["spec"]["replicatedJobs"]
    spec = replicated["template"]["spec"]
    [container] = spec["template"]["spec"]["containers"]
    pods_per_job = {v["name"]: v.get("value") for v in container["env"]}["JOBSET_PODS_PER_JOB"]
    assert spec["completions"] == spec["parallelism"] == int(pods_per_job)
    assert replicated["replicas"] * spec["parallelism"] == count


def test_a_jobset_pod_whose_count_contradicts_the_configmap_is_refused(tmp_path):
    _, _, env = next(jobset_pods(tmp_path))
    with pytest.raises(Exception, match="IFRT_NUM_PROCESSES=6 contradicts the jobset environment's "
                                        "JOBSET_GLOBAL_REPLICAS='2' x JOBSET_PODS_PER_JOB='2'"):
        resolve(environ=env | {"IFRT_NUM_PROCESSES": "6"})
