import pytest

from ifrt.errors import InvalidArgument
from ifrt.settings import preflight_timeout, resolve


def test_arguments_win_over_environment():
    env = {"IFRT_COORDINATOR": "env:1", "IFRT_PROCESS_ID": "1", "IFRT_NUM_PROCESSES": "4", "IFRT_PLUGIN": "x"}
    s = resolve("arg:2", process_id=3, num_processes=8, plugin="cpu", environ=env)
    assert (s.coordinators, s.process_id, s.num_processes, s.plugin) == (("arg:2",), 3, 8, "cpu")


def test_environment_fills_in_and_plugin_defaults_to_cpu():
    s = resolve(environ={"IFRT_COORDINATOR": "c1:8476, c2:8477", "IFRT_PROCESS_ID": "2",
                         "IFRT_NUM_PROCESSES": "4", "IFRT_LOCAL_RANK": "1"})
    assert (s.coordinators, s.process_id, s.num_processes, s.plugin, s.local_rank) == (
        ("c1:8476", "c2:8477"), 2, 4, "cpu", 1)


def test_without_process_id_the_coordinator_assigns():
    assert resolve(environ={"IFRT_COORDINATOR": "c:1"}).process_id is None


@pytest.mark.parametrize(("env", "message"), [
    ({}, "set IFRT_COORDINATOR"),
    ({"IFRT_COORDINATOR": "c:1", "IFRT_PROCESS_ID": "two"}, "IFRT_PROCESS_ID='two' is not an integer"),
    ({"IFRT_COORDINATOR": "c:1", "IFRT_NUM_PROCESSES": "0"}, "IFRT_NUM_PROCESSES=0 is out of range"),
    ({"IFRT_COORDINATOR": "c:99999"}, "port from 1 to 65535"),
    ({"IFRT_COORDINATOR": "c:1", "IFRT_PROCESS_ID": "4", "IFRT_NUM_PROCESSES": "4"}, "process id 4 is out of range"),
])
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(InvalidArgument, match=message):
        resolve(environ=env)


TORCHRUN = {"TORCHELASTIC_RUN_ID": "42", "MASTER_ADDR": "node001", "MASTER_PORT": "29500", "RANK": "5",
            "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def test_launcher_environment_needs_no_flags():
    s = resolve(environ=TORCHRUN)
    assert (s.coordinators, s.process_id, s.num_processes, s.local_rank, s.local_world_size, s.launcher) == (
        ("node001:8476",), 5, 8, 1, 4, "torchrun")


def test_ifrt_coordinator_with_torchrun_ranks():
    s = resolve(environ={**TORCHRUN, "IFRT_COORDINATOR": "coord:9000"})
    assert (s.coordinators, s.process_id, s.num_processes) == (("coord:9000",), 5, 8)


def test_explicit_arguments_win_over_the_launcher():
    s = resolve("c:1", process_id=2, num_processes=4, environ=TORCHRUN)
    assert (s.coordinators, s.process_id, s.num_processes) == (("c:1",), 2, 4)


def test_ifrt_variable_contradicting_the_launcher_is_reported():
    with pytest.raises(InvalidArgument, match="IFRT_PROCESS_ID=3 contradicts the torchrun environment's RANK='5'"):
        resolve(environ={**TORCHRUN, "IFRT_PROCESS_ID": "3"})


def test_agreeing_ifrt_variable_is_fine():
    assert resolve(environ={**TORCHRUN, "IFRT_NUM_PROCESSES": "8"}).num_processes == 8


def test_no_coordinator_anywhere_lists_what_was_tried():
    with pytest.raises(InvalidArgument,
                       match="looked for: torchrun, ompi, slurm, tpu, kubeflow, lws, jobset, kubernetes; none found"):
        resolve(environ={})


def test_a_misspelt_discover_option_is_refused_by_name():
    with pytest.raises(TypeError, match="unexpected keyword argument 'proces_id'"):
        resolve("c:1", proces_id=1, environ={})  # type: ignore[call-arg]


def test_discover_options_take_their_defaults_when_not_given():
    s = resolve("c:1", environ={})
    assert (s.process_id, s.num_processes, s.plugin, s.local_device_ids, s.timeout, s.token) == (
        None, None, "cpu", None, 300.0, None)


@pytest.mark.parametrize(("env", "seconds"), [
    ({}, None), ({"IFRT_PREFLIGHT": "0"}, None), ({"IFRT_PREFLIGHT": "1"}, 60.0),
    ({"IFRT_PREFLIGHT": "yes", "IFRT_PREFLIGHT_TIMEOUT": "12.5"}, 12.5),
])
def test_discover_runs_a_preflight_only_when_the_environment_asks(env, seconds):
    assert preflight_timeout(60.0, env) == seconds


def test_a_preflight_timeout_that_is_not_a_number_is_named():
    with pytest.raises(InvalidArgument, match="IFRT_PREFLIGHT_TIMEOUT='soon' is not a number of seconds"):
        preflight_timeout(60.0, {"IFRT_PREFLIGHT": "1", "IFRT_PREFLIGHT_TIMEOUT": "soon"})
