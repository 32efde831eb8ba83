"""Cluster-environment detection: realistic launcher environments in, Detected out; pure functions on env dicts."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess

import pytest

import ifrt.clusters
from ifrt.clusters import DEFAULT_PORT, DETECTORS, Detected, detect, present
from ifrt.clusters.hostlist import expand_hostlist, iter_hostlist
from ifrt.clusters.jobset import JobSet
from ifrt.clusters.kubeflow import KubeflowTrainer
from ifrt.clusters.kubernetes import Kubernetes
from ifrt.clusters.lws import LeaderWorkerSet
from ifrt.clusters.ompi import Ompi
from ifrt.clusters.slurm import Slurm, tasks_on_node
from ifrt.clusters.torchrun import Torchrun
from ifrt.clusters.tpu import GkeTpu
from ifrt.errors import InvalidArgument
from tests.helpers import BIN

# What a login shell and a container put in every environment: none of it names a launcher.
BASE = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/ml", "USER": "ml", "LANG": "C.UTF-8", "SHLVL": "1"}

# `srun -N3 -n6 python train.py` on node[001-003]: task 3, the second task of node002.
SRUN_N3_N6 = BASE | {
    "SLURM_CLUSTER_NAME": "hpc", "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "node[001-003]", "SLURM_NODELIST": "node[001-003]", "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NNODES": "3", "SLURM_NTASKS": "6", "SLURM_NPROCS": "6", "SLURM_TASKS_PER_NODE": "2(x3)",
    "SLURM_JOB_CPUS_PER_NODE": "2(x3)", "SLURM_SUBMIT_HOST": "login1", "SLURM_SUBMIT_DIR": "/home/ml",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "node[001-003]", "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_LAUNCHER_PORT": "36811",
    "SLURM_SRUN_COMM_HOST": "10.0.0.5", "SLURM_SRUN_COMM_PORT": "36811", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5",
    "SLURM_DISTRIBUTION": "block", "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "2,3", "SLURM_TOPOLOGY_ADDR": "node002",
    "SLURMD_NODENAME": "node002", "SLURM_NODEID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_TASK_PID": "81234", "SLURM_PRIO_PROCESS": "0", "SLURM_UMASK": "0022",
}

# `torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node001:29400 train.py`:
# the worker with local rank 2 on the second node.
TORCHRUN_2X4 = BASE | {
    "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "6", "ROLE_WORLD_SIZE": "8", "ROLE_NAME": "default",
    "MASTER_ADDR": "node001.cluster", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x1/none_y2/attempt_0/2/error.json",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1",
}

# `mpirun -np 4 -H a:2,b:2 python train.py` with Open MPI 4.1: rank 3, the second rank on host b.
MPIRUN_NP4_OMPI4 = BASE | {
    "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "4",
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.128.0.2,172.17.0.1:34911",
    "OMPI_MCA_orte_ess_num_procs": "4", "OMPI_MCA_orte_ess_jobid": "1531576321", "OMPI_MCA_orte_ess_vpid": "3",
    "OMPI_MCA_ess": "^singleton", "OMPI_MCA_pmix": "^s1,s2,cray,isolated", "OMPI_APP_CTX_NUM_PROCS": "4",
    "OMPI_NUM_APP_CTX": "1", "OMPI_FIRST_RANKS": "0", "OMPI_COMMAND": "python", "OMPI_ARGV": "train.py",
    "OMPI_MCA_initial_wdir": "/home/ml", "OMPI_FILE_LOCATION": "/tmp/ompi.b.1000/pid.4711/1/3",
    "PMIX_RANK": "3", "PMIX_NAMESPACE": "1531576321", "PMIX_SERVER_URI2": "1531576320.1;tcp4://127.0.0.1:41233",
}

# `mpirun -np 4 python train.py` with Open MPI 5 (PRRTE): no ORTE URI, the PMIx server is the node's own daemon.
MPIRUN_NP4_OMPI5 = BASE | {
    "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_UNIVERSE_SIZE": "4",
    "OMPI_MCA_num_procs": "4", "OMPI_NUM_APP_CTX": "1", "PRTE_LAUNCHED": "1", "PRTE_SHARED_FS": "FALSE",
    "PMIX_RANK": "3", "PMIX_NAMESPACE": "prterun-login1-12345@1", "PMIX_VERSION": "4.2.9",
    "PMIX_SERVER_URI41": "prterun-login1-12345@0.1;tcp4://10.128.0.3:45021", "PMIX_HOSTNAME": "b",
}

# Pod 2 of an Indexed Job "trainer" with `subdomain: workers` (a headless Service), namespace "default".
K8S_INDEXED_POD = BASE | {
    "HOSTNAME": "trainer-2", "JOB_COMPLETION_INDEX": "2", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "KUBERNETES_SERVICE_PORT": "443", "KUBERNETES_SERVICE_PORT_HTTPS": "443", "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "KUBERNETES_PORT_443_TCP": "tcp://10.96.0.1:443", "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1",
}
K8S_FQDN = "trainer-2.workers.default.svc.cluster.local"
K8S_POD = {k: v for k, v in K8S_INDEXED_POD.items() if k != "JOB_COMPLETION_INDEX"}  # what every pod has

# LeaderWorkerSet "vllm" (size 4, namespace "default"), worker 2 of group 0: LWS's pod webhook prepends its three
# variables to every container (lws pkg/webhooks/pod_webhook.go; the leader address is <lws>-<group>.<lws>.<ns>).
LWS_WORKER = K8S_POD | {
    "HOSTNAME": "vllm-0-2", "LWS_LEADER_ADDRESS": "vllm-0.vllm.default", "LWS_GROUP_SIZE": "4",
    "LWS_WORKER_INDEX": "2",
}

# Kubeflow Trainer's JAX runtime, TrainJob "llm" with numNodes 3, node 1 (kubeflow/trainer
# pkg/runtime/framework/plugins/jax/jax.go: JAX_PROCESS_ID is the completion index through the downward API, the
# coordinator "<trainjob>-node-0-0.<trainjob>:<JAXContainerPort>"; the runtime's pods are a JobSet's Indexed Job).
KUBEFLOW_JAX = K8S_POD | {
    "HOSTNAME": "llm-node-0-1", "JOB_COMPLETION_INDEX": "1", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "1",
    "JAX_COORDINATOR_ADDRESS": "llm-node-0-0.llm:6666", "JAX_COORDINATOR_PORT": "6666",
    "JAX_DISTRIBUTED_BACKEND": "gloo",
}

# Kubeflow Trainer's torch runtime, TrainJob "llm" with numNodes 2 and 4 processes per node, node 1 (kubeflow/trainer
# pkg/runtime/framework/plugins/torch/torch.go and pkg/constants: PET_MASTER_PORT is ContainerTrainerPort, 29500).
KUBEFLOW_TORCH = K8S_POD | {
    "HOSTNAME": "llm-node-0-1", "JOB_COMPLETION_INDEX": "1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "llm-node-0-0.llm", "PET_MASTER_PORT": "29500",
}

# GKE TPU, one slice of 4 hosts (an Indexed Job "tpu" with subdomain "tpu-svc"), host 3: GKE's TPU webhook sets the
# worker id (the completion index) and the slice's hosts in worker-id order.
TPU_ONE_SLICE = K8S_POD | {
    "HOSTNAME": "tpu-3", "JOB_COMPLETION_INDEX": "3", "TPU_WORKER_ID": "3",
    "TPU_WORKER_HOSTNAMES": "tpu-0.tpu-svc,tpu-1.tpu-svc,tpu-2.tpu-svc,tpu-3.tpu-svc",
    "TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_TOPOLOGY": "4x4", "TPU_SKIP_MDS_QUERY": "true",
}

# GKE TPU multislice: JobSet "js", replicated Job "slice" with 2 replicas (slices) of 2 hosts; host 1 of slice 1.
# JobSet's webhook adds MEGASCALE_* (jobset pkg/util/accelerator/tpu.go: coordinator "<js>-<job>-0-0.<subdomain>",
# slice id the job index, slice count the replicas).
TPU_MULTISLICE = K8S_POD | {
    "HOSTNAME": "js-slice-1-1", "JOB_COMPLETION_INDEX": "1", "TPU_WORKER_ID": "1",
    "TPU_WORKER_HOSTNAMES": "js-slice-1-0.js,js-slice-1-1.js", "MEGASCALE_SLICE_ID": "1",
    "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_COORDINATOR_ADDRESS": "js-slice-0-0.js",
    "TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_SKIP_MDS_QUERY": "true",
}

# JobSet "js" with replicated Jobs "driver" (1 Job of 1 pod, the JobSet's spec.coordinator) and "workers" (2 Jobs of
# 2 pods): pod 1 of workers Job 1, with the annotations passed in as deploy/kubernetes/workers-jobset.yaml does.
JOBSET_WORKER = K8S_POD | {
    "HOSTNAME": "js-workers-1-1", "JOB_COMPLETION_INDEX": "1", "JOBSET_JOB_INDEX": "1",
    "JOBSET_JOB_GLOBAL_INDEX": "2", "JOBSET_REPLICATED_JOB_REPLICAS": "2", "JOBSET_GLOBAL_REPLICAS": "3",
    "JOBSET_COORDINATOR": "js-driver-0-0.js", "JOBSET_PODS_PER_JOB": "2",
}


def values(d: Detected) -> tuple:
    return (d.source, d.coordinator, d.process_id, d.num_processes, d.local_rank, d.local_world_size)


# --- nothing present ---------------------------------------------------------------------------------------------


def test_an_empty_environment_detects_nothing():
    assert detect({}) is None
    assert present({}) == []


def test_a_plain_shell_or_pod_detects_nothing():
    # Every pod has KUBERNETES_SERVICE_HOST; only Indexed Jobs say which process they are.
    assert detect(BASE | {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "web-7d9f"}) is None
    # A MASTER_ADDR exported for later, without a rank, is not a torch launch.
    assert detect(BASE | {"MASTER_ADDR": "node001"}) is None


# --- SLURM -------------------------------------------------------------------------------------------------------


def test_srun_n3_n6_is_detected_from_its_step_variables():
    d = detect(SRUN_N3_N6)
    assert d is not None
    assert values(d) == ("slurm", f"node001:{DEFAULT_PORT}", 3, 6, 1, 2)
    assert {"SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_NODELIST",
            "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"} <= set(d.variables)


def test_srun_over_uneven_nodes_takes_this_nodes_task_count():
    # srun -n7 over node[001-003,007]: two tasks on each of the first three nodes, one on node007.
    env = SRUN_N3_N6 | {"SLURM_STEP_NODELIST": "node[001-003,007]", "SLURM_STEP_NUM_TASKS": "7", "SLURM_NTASKS": "7",
                        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3", "SLURM_PROCID": "6",
                        "SLURM_LOCALID": "0"}
    assert values(Slurm.detect(env)) == ("slurm", f"node001:{DEFAULT_PORT}", 6, 7, 0, 1)


def test_a_step_that_is_a_subset_of_the_job_uses_the_steps_nodes():
    env = SRUN_N3_N6 | {"SLURM_JOB_NODELIST": "login[1-2],node[001-003]", "SLURM_STEP_NODELIST": "node[002-003]"}
    assert Slurm.detect(env).coordinator == f"node002:{DEFAULT_PORT}"


def test_an_sbatch_script_falls_back_to_the_jobs_variables():
    # The batch script itself (no srun): no SLURM_STEP_* variables.
    env = BASE | {"SLURM_JOB_ID": "4243", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2",
                  "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert values(Slurm.detect(env)) == ("slurm", f"gpu07:{DEFAULT_PORT}", 0, 2, 0, 1)


def test_an_salloc_shell_has_no_process_id():
    env = BASE | {"SLURM_JOB_ID": "4244", "SLURM_NODELIST": "node9", "SLURM_JOB_NUM_NODES": "1"}
    assert values(Slurm.detect(env)) == ("slurm", f"node9:{DEFAULT_PORT}", None, None, None, None)


@pytest.mark.parametrize(("value", "node", "count"), [
    ("2(x3)", 2, 2), ("2(x3),1", 3, 1), ("2(x3),1", 0, 2), ("4", None, 4), ("4(x2)", None, 4), ("2(x3),1", None, None),
    ("1(x100000000),9", 100000000, 9),
])
def test_tasks_per_node_is_read_without_expanding_repeats(value, node, count):
    assert tasks_on_node(value, node) == count


# --- torchrun ----------------------------------------------------------------------------------------------------


def test_torchrun_2_nodes_4_procs_is_detected_and_uses_ifrts_port_not_master_port():
    d = detect(TORCHRUN_2X4)
    assert d is not None
    assert values(d) == ("torchrun", f"node001.cluster:{DEFAULT_PORT}", 6, 8, 2, 4)
    assert "MASTER_PORT" not in d.variables


def test_ifrt_coordinator_port_overrides_the_default_port():
    assert Torchrun.detect(TORCHRUN_2X4 | {"IFRT_COORDINATOR_PORT": "9100"}).coordinator == "node001.cluster:9100"


def test_an_ipv6_master_addr_gets_brackets():
    assert Torchrun.detect(TORCHRUN_2X4 | {"MASTER_ADDR": "fd00::2"}).coordinator == f"[fd00::2]:{DEFAULT_PORT}"


def test_torch_env_init_without_torchrun_is_detected_without_a_local_world_size():
    # torch.distributed.launch --use-env, or a PyTorchJob pod: no TORCHELASTIC_*, no LOCAL_WORLD_SIZE.
    env = BASE | {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "23456", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert values(detect(env)) == ("torchrun", f"10.0.0.2:{DEFAULT_PORT}", 1, 2, 0, None)


# --- Open MPI ----------------------------------------------------------------------------------------------------


def test_mpirun_np4_open_mpi_4_takes_the_coordinator_host_from_the_orte_uri():
    assert values(detect(MPIRUN_NP4_OMPI4)) == ("ompi", f"10.128.0.2:{DEFAULT_PORT}", 3, 4, 1, 2)


def test_mpirun_open_mpi_5_detects_ranks_but_no_coordinator():
    assert values(detect(MPIRUN_NP4_OMPI5)) == ("ompi", None, 3, 4, 1, 2)


def test_a_pmix_only_prrte_launch_gives_only_the_rank():
    env = BASE | {"PRTE_LAUNCHED": "1", "PMIX_RANK": "5", "PMIX_NAMESPACE": "prterun-login1-9@1"}
    assert values(detect(env)) == ("ompi", None, 5, None, None, None)


def test_srun_with_pmix_is_left_to_slurm():
    env = SRUN_N3_N6 | {"PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.4242.0", "PMI_RANK": "3", "PMI_SIZE": "6"}
    assert detect(env).source == "slurm"


@pytest.mark.parametrize(("uri", "coordinator"), [
    ("1531576320.0;tcp://10.96.0.1,10.148.0.1,10.108.0.1:34911", "10.96.0.1"),
    ("1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d:c083:150e::3000:2]:43370", "[fe80::b9b:ac5d:9cf0:b858]"),
    ("1531576320.0;tcp6://[fd00::1]:43370;tcp://10.0.0.1:34911", "10.0.0.1"),
])
def test_orte_uris_give_the_first_address_ipv4_first(uri, coordinator):
    env = MPIRUN_NP4_OMPI4 | {"OMPI_MCA_orte_hnp_uri": uri}
    assert Ompi.detect(env).coordinator == f"{coordinator}:{DEFAULT_PORT}"


# --- Kubernetes --------------------------------------------------------------------------------------------------


def test_an_indexed_job_pod_finds_pod_zero_behind_its_headless_service():
    d = Kubernetes.detect(K8S_INDEXED_POD, fqdn=K8S_FQDN)
    assert values(d) == ("kubernetes", f"trainer-0.workers.default.svc.cluster.local:{DEFAULT_PORT}", 2, None, None,
                         None)
    assert d.variables == ("JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST")


def test_job_names_with_dashes_and_digits_keep_their_name():
    env = K8S_INDEXED_POD | {"JOB_COMPLETION_INDEX": "12"}
    assert Kubernetes.detect(env, fqdn="llm-run-3-12.w.ml.svc.cluster.local.").coordinator == (
        f"llm-run-3-0.w.ml.svc.cluster.local:{DEFAULT_PORT}")


@pytest.mark.parametrize("fqdn", ["trainer-2", "custom-host.workers.default.svc.cluster.local", "-2.workers.svc"])
def test_a_pod_without_subdomain_or_with_a_custom_hostname_has_no_coordinator(fqdn):
    assert Kubernetes.detect(K8S_INDEXED_POD, fqdn=fqdn).coordinator is None


def test_the_registry_asks_the_host_for_its_fqdn(monkeypatch):
    monkeypatch.setattr("ifrt.clusters.kubernetes.socket.getfqdn", lambda: K8S_FQDN)
    assert values(detect(K8S_INDEXED_POD)) == ("kubernetes", f"trainer-0.workers.default.svc.cluster.local:"
                                               f"{DEFAULT_PORT}", 2, None, None, None)


# --- LeaderWorkerSet, Kubeflow Trainer, GKE TPU, JobSet -------------------------------------------------------


def test_a_leaderworkerset_worker_is_its_index_in_the_group_and_dials_the_leader():
    d = detect(LWS_WORKER)
    assert values(d) == ("lws", f"vllm-0.vllm.default:{DEFAULT_PORT}", 2, 4, None, None)
    assert d.variables == ("LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX", "LWS_GROUP_SIZE")


def test_the_leaderworkerset_leader_is_process_zero():
    assert LeaderWorkerSet.detect(LWS_WORKER | {"LWS_WORKER_INDEX": "0"}).process_id == 0


def test_kubeflow_jax_runtime_takes_the_host_of_its_coordinator_address_with_ifrts_port(caplog):
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        d = detect(KUBEFLOW_JAX)
    assert values(d) == ("kubeflow", f"llm-node-0-0.llm:{DEFAULT_PORT}", 1, 3, None, None)
    assert not caplog.records  # the JobSet's completion index agrees


def test_kubeflow_torch_runtime_node_with_one_process_is_the_node_rank():
    env = KUBEFLOW_TORCH | {"PET_NPROC_PER_NODE": "1"}
    assert values(detect(env)) == ("kubeflow", f"llm-node-0-0.llm:{DEFAULT_PORT}", 1, 2, None, 1)


def test_kubeflow_torch_runtime_node_with_four_processes_counts_them_but_is_none_of_them():
    assert values(KubeflowTrainer.detect(KUBEFLOW_TORCH)) == ("kubeflow", f"llm-node-0-0.llm:{DEFAULT_PORT}", None, 8,
                                                               None, 4)


@pytest.mark.parametrize("nproc", ["auto", "gpu", "cpu"])
def test_kubeflow_torch_runtime_leaves_a_count_torchrun_decides_unknown(nproc):
    d = KubeflowTrainer.detect(KUBEFLOW_TORCH | {"PET_NPROC_PER_NODE": nproc})
    assert (d.process_id, d.num_processes, d.coordinator) == (None, None, f"llm-node-0-0.llm:{DEFAULT_PORT}")


def test_torchrun_inside_the_kubeflow_torch_runtime_wins_and_agrees(caplog):
    # The runtime's torchrun, started with PET_*, runs worker 6 (local rank 2) on node 1.
    env = KUBEFLOW_TORCH | {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                            "MASTER_ADDR": "llm-node-0-0.llm", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "llm"}
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        d = detect(env)
    assert values(d) == ("torchrun", f"llm-node-0-0.llm:{DEFAULT_PORT}", 6, 8, 2, 4)
    assert [p.source for p in present(env)] == ["torchrun", "kubeflow"]
    assert not caplog.records


def test_a_single_tpu_slice_numbers_hosts_by_worker_id_and_dials_the_first():
    d = detect(TPU_ONE_SLICE)
    assert values(d) == ("tpu", f"tpu-0.tpu-svc:{DEFAULT_PORT}", 3, 4, None, None)
    assert d.slice_index == 0


def test_tpu_multislice_offsets_the_id_by_the_slice_and_dials_slice_zeros_host(caplog):
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        d = detect(TPU_MULTISLICE)
    # process id = id within the slice + slice id x hosts per slice (as jax/_src/clusters/cloud_tpu_cluster.py)
    assert values(d) == ("tpu", f"js-slice-0-0.js:{DEFAULT_PORT}", 1 + 1 * 2, 2 * 2, None, None)
    assert d.slice_index == 1
    # The completion index (1) is per slice: the kubernetes detector stands aside rather than disagree.
    assert [p.source for p in present(TPU_MULTISLICE)] == ["tpu"]
    assert not caplog.records


def test_tpu_process_addresses_are_preferred_to_worker_hostnames():
    env = TPU_ONE_SLICE | {"TPU_PROCESS_ADDRESSES": "10.8.0.5:8471,10.8.0.6:8471,10.8.0.7:8471,10.8.0.8:8471"}
    assert GkeTpu.detect(env).coordinator == f"10.8.0.5:{DEFAULT_PORT}"


def test_a_tpu_slice_inside_a_leaderworkerset_agrees_with_it(caplog):
    # LWS's webhook sets the TPU variables of a group that requests TPUs: group 1 of "tpu", worker 1.
    env = K8S_POD | {"LWS_LEADER_ADDRESS": "tpu-1.tpu.default", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1",
                     "TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "tpu-1.tpu,tpu-1-1.tpu"}
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        assert values(detect(env))[:4] == ("tpu", f"tpu-1.tpu:{DEFAULT_PORT}", 1, 2)
    assert not caplog.records  # "tpu-1.tpu" and "tpu-1.tpu.default" are the same host


def test_a_jobset_pod_is_numbered_across_the_set(caplog):
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        d = detect(JOBSET_WORKER)
    # global job index 2 (the driver's Job is 0) x 2 pods per Job + completion index 1
    assert values(d) == ("jobset", f"js-driver-0-0.js:{DEFAULT_PORT}", 5, 6, None, None)
    assert [p.source for p in present(JOBSET_WORKER)] == ["jobset"]
    assert not caplog.records


def test_a_jobset_without_global_variables_uses_its_replicated_jobs_own():
    env = {k: v for k, v in JOBSET_WORKER.items() if k not in ("JOBSET_JOB_GLOBAL_INDEX", "JOBSET_GLOBAL_REPLICAS")}
    assert values(JobSet.detect(env))[2:4] == (1 * 2 + 1, 2 * 2)


def test_a_jobset_annotation_the_pod_lacks_arrives_empty_and_reads_as_unset():
    # The downward API gives "" for a missing annotation: no spec.coordinator, one pod per child Job.
    env = JOBSET_WORKER | {"JOBSET_COORDINATOR": "", "JOBSET_PODS_PER_JOB": "", "JOB_COMPLETION_INDEX": "0"}
    assert values(JobSet.detect(env)) == ("jobset", None, 2, 3, None, None)


def test_a_multi_pod_jobset_without_its_pods_per_job_says_what_to_set():
    env = {k: v for k, v in JOBSET_WORKER.items() if k != "JOBSET_PODS_PER_JOB"}
    with pytest.raises(InvalidArgument, match="JOB_COMPLETION_INDEX='1' is malformed: expected 0, as "
                                              "JOBSET_PODS_PER_JOB is not set"):
        detect(env)


@pytest.mark.parametrize(("env", "variable", "value"), [
    (LWS_WORKER | {"LWS_WORKER_INDEX": "leader"}, "LWS_WORKER_INDEX", "leader"),
    (LWS_WORKER | {"LWS_LEADER_ADDRESS": "vllm-0:8080"}, "LWS_LEADER_ADDRESS", "vllm-0:8080"),
    (KUBEFLOW_JAX | {"JAX_COORDINATOR_ADDRESS": "a:b:c:d"}, "JAX_COORDINATOR_ADDRESS", "a:b:c:d"),
    (KUBEFLOW_TORCH | {"PET_NPROC_PER_NODE": "many"}, "PET_NPROC_PER_NODE", "many"),
    (KUBEFLOW_TORCH | {"PET_NODE_RANK": "2"}, "PET_NODE_RANK", "2"),
    (TPU_MULTISLICE | {"TPU_WORKER_ID": "2"}, "TPU_WORKER_ID", "2"),
    (TPU_MULTISLICE | {"MEGASCALE_SLICE_ID": "2"}, "MEGASCALE_SLICE_ID", "2"),
    (TPU_MULTISLICE | {"TPU_WORKER_HOSTNAMES": "a,,b"}, "TPU_WORKER_HOSTNAMES", "a,,b"),
    (JOBSET_WORKER | {"JOB_COMPLETION_INDEX": "2"}, "JOB_COMPLETION_INDEX", "2"),
    (JOBSET_WORKER | {"JOBSET_JOB_GLOBAL_INDEX": "3"}, "JOBSET_JOB_GLOBAL_INDEX", "3"),
])
def test_a_malformed_kubernetes_launcher_value_names_the_variable_and_what_was_expected(env, variable, value):
    with pytest.raises(InvalidArgument, match=re.escape(f"{variable}={value!r}")) as info:
        detect(env)
    assert "expected" in str(info.value)


def test_a_contradicting_slice_is_a_disagreement(caplog):
    # A JobSet manifest that numbers hosts differently from the TPU slices: both sources are named.
    env = TPU_MULTISLICE | {"JOBSET_JOB_INDEX": "0", "JOBSET_REPLICATED_JOB_REPLICAS": "2", "JOBSET_PODS_PER_JOB": "2"}
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        assert detect(env).process_id == 3
    assert "process id: tpu TPU_WORKER_ID='1' + MEGASCALE_SLICE_ID='1' x 2 hosts vs jobset JOBSET_JOB_INDEX='0'" in (
        caplog.text)


def test_ifrt_env_json_shows_a_multislice_tpu_hosts_launcher_and_slice():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "SLURM_", "OMPI_", "PMIX_", "TPU_"))}
    out = subprocess.run([str(BIN / "ifrt"), "env", "--json"], env=env | TPU_MULTISLICE, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["launchers"] == [{"source": "tpu", "coordinator": f"js-slice-0-0.js:{DEFAULT_PORT}", "process_id": 3,
                                   "num_processes": 4, "local_rank": None, "local_world_size": None,
                                   "slice_index": 1}]
    assert (shown["settings"]["process_id"], shown["settings"]["launcher"]) == (3, "tpu")


# --- host lists --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("hostlist", "hosts"), [
    ("node001", ["node001"]),
    ("node[001-003,007],gpu5", ["node001", "node002", "node003", "node007", "gpu5"]),
    ("login1,node[1-2]", ["login1", "node1", "node2"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[3],b[5,1]", ["a3", "b5", "b1"]),
    ("gpu-a100-[0-1].ib", ["gpu-a100-0.ib", "gpu-a100-1.ib"]),
])
def test_slurm_host_lists_expand(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", [
    "", "node[1-", "node]1[", "node[1-2]]", "node[a-b]", "node[3-1]", "node[]", "a,,b", "a,", "n[[1]]", "n[1--2]",
])
def test_malformed_host_lists_are_rejected(hostlist):
    with pytest.raises(ValueError):
        expand_hostlist(hostlist)


def test_the_first_host_of_a_huge_range_costs_nothing():
    assert next(iter_hostlist("n[0-999999999999]")) == "n0"


# --- malformed values --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "variable", "value"), [
    (SRUN_N3_N6 | {"SLURM_PROCID": "three"}, "SLURM_PROCID", "three"),
    (SRUN_N3_N6 | {"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS", "0"),
    (SRUN_N3_N6 | {"SLURM_LOCALID": "-1"}, "SLURM_LOCALID", "-1"),
    (SRUN_N3_N6 | {"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, "SLURM_STEP_TASKS_PER_NODE", "2(x)"),
    (SRUN_N3_N6 | {"SLURM_STEP_NODELIST": "node[001-003"}, "SLURM_STEP_NODELIST", "node[001-003"),
    (SRUN_N3_N6 | {"SLURM_NODEID": "5"}, "SLURM_NODEID", "5"),
    (TORCHRUN_2X4 | {"RANK": "6.0"}, "RANK", "6.0"),
    (TORCHRUN_2X4 | {"WORLD_SIZE": "eight"}, "WORLD_SIZE", "eight"),
    (TORCHRUN_2X4 | {"LOCAL_WORLD_SIZE": ""}, "LOCAL_WORLD_SIZE", ""),
    (TORCHRUN_2X4 | {"MASTER_ADDR": "node001:29500"}, "MASTER_ADDR", "node001:29500"),
    (TORCHRUN_2X4 | {"IFRT_COORDINATOR_PORT": "99999"}, "IFRT_COORDINATOR_PORT", "99999"),
    (MPIRUN_NP4_OMPI4 | {"OMPI_COMM_WORLD_SIZE": "4 procs"}, "OMPI_COMM_WORLD_SIZE", "4 procs"),
    (MPIRUN_NP4_OMPI4 | {"OMPI_MCA_orte_hnp_uri": "10.128.0.2:34911"}, "OMPI_MCA_orte_hnp_uri", "10.128.0.2:34911"),
    (K8S_INDEXED_POD | {"JOB_COMPLETION_INDEX": "two"}, "JOB_COMPLETION_INDEX", "two"),
])
def test_a_malformed_value_names_the_variable_its_value_and_what_was_expected(env, variable, value):
    with pytest.raises(InvalidArgument, match=re.escape(f"{variable}={value!r}")) as info:
        detect(env)
    assert "expected" in str(info.value)


def test_a_rank_outside_the_world_names_both_variables():
    with pytest.raises(InvalidArgument, match=r"RANK='8' is out of range: expected it below WORLD_SIZE='8'"):
        detect(TORCHRUN_2X4 | {"RANK": "8"})


def test_torchrun_without_a_rank_says_which_variable_is_missing():
    env = {k: v for k, v in TORCHRUN_2X4.items() if k != "RANK"}
    with pytest.raises(InvalidArgument, match="torchrun environment: RANK is not set"):
        detect(env)


def test_other_ifrt_variables_are_left_to_the_settings():
    env = SRUN_N3_N6 | {"IFRT_PROCESS_ID": "5", "IFRT_NUM_PROCESSES": "9", "IFRT_COORDINATOR": "elsewhere:1"}
    d = detect(env)
    assert (d.process_id, d.num_processes, d.coordinator) == (3, 6, f"node001:{DEFAULT_PORT}")
    assert not [v for v in d.variables if v.startswith("IFRT_")]


# --- several launchers at once -----------------------------------------------------------------------------------

# `srun -N2 --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 4 ...`: SLURM's task 1 runs torchrun,
# whose worker 6 is this process.
SRUN_TORCHRUN = TORCHRUN_2X4 | {
    k: v for k, v in SRUN_N3_N6.items() if k.startswith("SLURM")
} | {
    "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
}


def test_torchrun_under_srun_picks_torchrun_and_warns_about_the_disagreement(caplog):
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        d = detect(SRUN_TORCHRUN)
    assert values(d) == ("torchrun", f"node001.cluster:{DEFAULT_PORT}", 6, 8, 2, 4)
    [record] = [r for r in caplog.records if r.name == "ifrt.clusters"]
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    for text in ("torchrun wins over slurm by priority", "RANK='6'", "SLURM_PROCID='1'", "WORLD_SIZE='8'",
                 "SLURM_STEP_NUM_TASKS='2'", "LOCAL_RANK='2'", "SLURM_LOCALID='0'"):
        assert text in message
    # node001.cluster and node001 are the same host: not a disagreement.
    assert "coordinator host" not in message


def test_agreeing_launchers_do_not_warn(caplog):
    # A batch script that exports torch's variables from SLURM's, then runs one process per task.
    env = SRUN_N3_N6 | {"MASTER_ADDR": "node001", "RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1"}
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        assert detect(env).source == "torchrun"
    assert not caplog.records


def test_a_different_coordinator_host_is_a_disagreement(caplog):
    env = SRUN_N3_N6 | {"MASTER_ADDR": "10.0.0.9", "RANK": "3", "WORLD_SIZE": "6", "LOCAL_RANK": "1"}
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        detect(env)
    assert "coordinator host: torchrun '10.0.0.9'" in caplog.text
    assert "slurm 'node001' from SLURM_STEP_NODELIST='node[001-003]'" in caplog.text


def test_mpirun_inside_an_sbatch_allocation_picks_ompi():
    env = MPIRUN_NP4_OMPI4 | {"SLURM_JOB_ID": "4245", "SLURM_JOB_NODELIST": "a,b", "SLURM_NTASKS": "4",
                              "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
    assert [d.source for d in present(env)] == ["ompi", "slurm"]
    assert detect(env).source == "ompi"


def test_a_malformed_losing_environment_is_reported_not_fatal(caplog):
    env = TORCHRUN_2X4 | {"SLURM_JOB_ID": "1", "SLURM_PROCID": "bad"}
    with caplog.at_level(logging.WARNING, logger="ifrt.clusters"):
        assert detect(env).source == "torchrun"
    assert "slurm environment is also present but unreadable" in caplog.text
    assert "SLURM_PROCID='bad'" in caplog.text
    with pytest.raises(InvalidArgument, match="SLURM_PROCID='bad'"):
        present(env)


def test_present_lists_every_launcher_highest_priority_first(monkeypatch):
    monkeypatch.setattr("ifrt.clusters.kubernetes.socket.getfqdn", lambda: K8S_FQDN)
    env = SRUN_TORCHRUN | MPIRUN_NP4_OMPI4 | K8S_INDEXED_POD
    assert [d.source for d in present(env)] == ["torchrun", "ompi", "slurm", "kubernetes"]


# --- the registry ------------------------------------------------------------------------------------------------


def test_the_priority_order_is_the_documented_order():
    documented = re.findall(r"^\d+\. ``(\w+)`` \((\d+)\)", ifrt.clusters.__doc__, re.MULTILINE)
    assert [(d.name, str(d.priority)) for d in DETECTORS] == documented
    assert [d.priority for d in DETECTORS] == sorted({d.priority for d in DETECTORS}, reverse=True)
    assert [d.name for d in DETECTORS] == ["torchrun", "ompi", "slurm", "tpu", "kubeflow", "lws", "jobset",
                                           "kubernetes"]


def test_the_launchers_slice_reaches_the_published_topology(start_coordinator):
    # Two single-host slices of a multislice job; the cpu plugin names no slice, so the launcher's does.
    from tests.helpers import discover_process, finish

    coordinator = start_coordinator(num_processes=2)
    children = [discover_process(coordinator.address, env={
        "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost", "MEGASCALE_SLICE_ID": str(s),
        "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_COORDINATOR_ADDRESS": "localhost"}) for s in (1, 0)]
    results = [finish(c, 90) for c in children]
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    topology = json.loads(results[0][1])
    by_process = {d["process_id"]: d["slice_index"] for d in topology["devices"]}
    assert by_process == {0: 0, 1: 1}
