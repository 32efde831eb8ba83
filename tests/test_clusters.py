"""Cluster-environment detection: realistic launcher environments in, Detected out; pure functions on env dicts."""

from __future__ import annotations

import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ifrt.clusters
from ifrt.clusters import DEFAULT_PORT, DETECTORS, Detected, detect, present
from ifrt.clusters.hostlist import expand_hostlist, format_hostlist, iter_hostlist
from ifrt.clusters.kubernetes import Kubernetes
from ifrt.clusters.ompi import Ompi
from ifrt.clusters.slurm import Slurm, tasks_on_node
from ifrt.clusters.torchrun import Torchrun
from ifrt.errors import InvalidArgument

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


_name = st.text("abz09-.", min_size=1, max_size=4)
_host = st.one_of(
    _name,
    st.builds(lambda prefix, n, pad: f"{prefix}{str(n).zfill(pad)}", _name, st.integers(0, 130), st.integers(1, 4)),
)


@given(st.lists(_host, min_size=1, max_size=25))
def test_expanding_a_formatted_host_list_returns_the_list(hosts):
    assert expand_hostlist(format_hostlist(hosts)) == hosts


@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(1, 4))
def test_consecutive_numbers_compress_to_ranges_and_back(numbers, pad):
    hosts = [f"node{str(n).zfill(pad)}" for n in sorted(set(numbers))]
    formatted = format_hostlist(hosts)
    assert expand_hostlist(formatted) == hosts
    assert len(formatted) <= len(",".join(hosts))


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
    assert [d.name for d in DETECTORS] == ["torchrun", "ompi", "slurm", "kubernetes"]
