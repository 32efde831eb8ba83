"""deploy/kubernetes/, checked offline: every manifest against Kubernetes' schemas (kubernetes-validate --strict), the
JobSet against its CRD's, and a worker pod's environment rendered from the manifests and given to discover()'s
settings: the right process id, count and coordinator come out."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

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
           DEPLOY / "workers" / "indexed-job.yaml", DEPLOY / "workers" / "node-labels.yaml"]
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


AWS = "topology.k8s.aws/network-node-layer-"


def node_labels_written(pod_spec: dict, tmp_path: Path, labels: str) -> dict[str, Path]:
    """The emptyDir the init container writes the node's labels into, as a local folder holding ``labels`` in the
    file its command names; checked to be the volume the worker mounts."""
    [init] = pod_spec["initContainers"]
    [mount] = init["volumeMounts"]
    [volume] = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    assert volume == {"name": mount["name"], "emptyDir": {}}
    out = init["command"][-1]
    assert out.startswith(mount["mountPath"] + "/")
    folder = tmp_path / mount["name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / out[len(mount["mountPath"]) + 1:]).write_text(labels)
    return {mount["mountPath"]: folder}


def indexed_job_pods(tmp_path: Path, labels: str = "") -> Iterator[tuple[int, dict[str, str]]]:
    job = find(DEPLOY / "workers" / "indexed-job.yaml", "Job")
    pod_spec = job["spec"]["template"]["spec"]
    [container] = pod_spec["containers"]
    for index in range(job["spec"]["completions"]):
        mounts = mounted_secret(pod_spec, container, tmp_path) | node_labels_written(
            pod_spec, tmp_path / str(index), labels.format(index=index))
        env = render_env(container, {"batch.kubernetes.io/job-completion-index": str(index)}, mounts)
        yield index, env | kubernetes_pod_env(index, f"ifrt-workers-{index}")


def test_an_indexed_job_pod_gets_its_index_the_count_and_every_replica(tmp_path, monkeypatch):
    monkeypatch.setattr("ifrt.clusters.kubernetes.socket.getfqdn", lambda: "ifrt-workers-0.ifrt-workers.ns.svc")
    seen = []
    for index, env in indexed_job_pods(tmp_path, f"kubernetes.io/hostname=node{{index}}\n{AWS}1=nn-a\n"
                                                 f"{AWS}2=nn-b{{index}}\n"):
        settings = resolve(environ=env)
        seen.append((index, settings.process_id))
        assert settings.network == ("nn-a", f"nn-b{index}")  # from the labels file the init container wrote
        assert settings.launcher == "kubernetes"
        assert settings.num_processes == int(config()["IFRT_NUM_PROCESSES"]) == 4
        assert settings.coordinators == ("ifrt-coordinator-0.ifrt-coordinator:8476",
                                         "ifrt-coordinator-1.ifrt-coordinator:8476")
        assert (settings.cluster_id, settings.token) == ("job-1", TOKEN)
    assert seen == [(0, 0), (1, 1), (2, 2), (3, 3)]


def jobset_pods(tmp_path: Path, labels: str = "") -> Iterator[tuple[int, int, dict[str, str]]]:
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
                written = node_labels_written(pod_spec, tmp_path / f"{job_index}-{pod}",
                                              labels.format(index=offset + job_index))
                env = render_env(container, annotations | {"batch.kubernetes.io/job-completion-index": str(pod)},
                                 mounts | written)
                yield offset + job_index, pod, env | kubernetes_pod_env(pod, f"{name}-{replicated['name']}-"
                                                                             f"{job_index}-{pod}")
        offset += replicated["replicas"]


def test_a_jobset_pod_gets_a_process_id_numbered_across_its_child_jobs(tmp_path, caplog):
    seen = []
    for job, pod, env in jobset_pods(tmp_path, f"{AWS}1=nn-a\n{AWS}2=nn-b{{index}}\n"):
        settings = resolve(environ=env)
        assert settings.network == ("nn-a", f"nn-b{job}")  # from the labels file the init container wrote
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


# --- the node's labels, for where the host sits in the network --------------------------------------------------------


def worker_pod_specs() -> list[dict]:
    """The pod template of each worker manifest: the Indexed Job's and the JobSet's."""
    [replicated] = find(DEPLOY / "workers" / "jobset.yaml", "JobSet")["spec"]["replicatedJobs"]
    return [find(DEPLOY / "workers" / "indexed-job.yaml", "Job")["spec"]["template"]["spec"],
            replicated["template"]["spec"]["template"]["spec"]]


@pytest.mark.parametrize("pod_spec", worker_pod_specs(), ids=["indexed-job", "jobset"])
def test_the_init_container_may_get_its_node_and_nothing_else(pod_spec):
    path = DEPLOY / "workers" / "node-labels.yaml"
    account, role, binding = (find(path, kind) for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"))
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert pod_spec["serviceAccountName"] == account["metadata"]["name"]
    [init] = pod_spec["initContainers"]
    assert init["command"][:3] == ["python", "-m", "ifrt.node_labels"]
    assert init["env"] == [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    [worker] = pod_spec["containers"]
    [labels_file] = [v["value"] for v in worker["env"] if v["name"] == "IFRT_NODE_LABELS_FILE"]
    assert labels_file == init["command"][-1]
    [mount] = [m for m in worker["volumeMounts"] if m["name"] == init["volumeMounts"][0]["name"]]
    assert labels_file.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True


class NodeAPI(http.server.BaseHTTPRequestHandler):
    """The API server's answer to GET /api/v1/nodes/<name> for one node, with a Node object of the real shape, to
    the bearer token of the pod's service account only."""

    node: ClassVar[dict] = {"kind": "Node", "apiVersion": "v1", "metadata": {"name": "node-a", "labels": {
        "kubernetes.io/hostname": "node-a", "network.topology.nvidia.com/core": "core1",
        "network.topology.nvidia.com/spine": "spine3", "network.topology.nvidia.com/leaf": "leaf12",
        "network.topology.nvidia.com/accelerator": "nvl72-4", "nvidia.com/gpu.clique": "7f3a.1"}}}

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != "Bearer pod-token":
            self.send_error(401)
        elif self.path != "/api/v1/nodes/node-a":
            self.send_error(404)
        else:
            body = json.dumps(self.node).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_labels_the_init_container_writes_give_the_worker_its_network_position(tmp_path):
    from ifrt import node_labels

    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NodeAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pod_spec = find(DEPLOY / "workers" / "indexed-job.yaml", "Job")["spec"]["template"]["spec"]
        [init] = pod_spec["initContainers"]
        [mount] = init["volumeMounts"]
        out = tmp_path / "node" / init["command"][-1][len(mount["mountPath"]) + 1:]
        out.parent.mkdir()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert node_labels.main([str(out), base], {"NODE_NAME": "node-a"}, str(account)) == 0
        assert "network.topology.nvidia.com/leaf=leaf12\n" in out.read_text()
        # A node it may not read (or a wrong token) fails the init container, naming the node and what it needs.
        assert node_labels.main([str(tmp_path / "other"), base], {"NODE_NAME": "node-b"}, str(account)) == 1
        assert not (tmp_path / "other").exists()
    finally:
        server.shutdown()
        server.server_close()
    [worker] = pod_spec["containers"]
    env = render_env(worker, {}, {mount["mountPath"]: out.parent} | mounted_secret(pod_spec, worker, tmp_path))
    settings = resolve(environ=env | kubernetes_pod_env(0, "ifrt-workers-0"))
    assert settings.network == ("core1", "spine3", "leaf12")
    assert settings.network_source.endswith("(nvidia-topograph labels)")
