import pytest

from ifrt.errors import InvalidArgument
from ifrt.settings import resolve
from plugins import get_plugin
from plugins.cpu import CpuPlugin


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


def test_cpu_plugin_reports_the_configured_count(monkeypatch):
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "4")
    devices = get_plugin("cpu").local_devices()
    assert [(d.local_id, d.platform) for d in devices] == [(i, "cpu") for i in range(4)]
    assert [d.local_id for d in CpuPlugin().local_devices([1, 3])] == [1, 3]


def test_cpu_plugin_defaults_to_one_device(monkeypatch):
    monkeypatch.delenv("IFRT_CPU_DEVICE_COUNT", raising=False)
    assert len(CpuPlugin().local_devices()) == 1


@pytest.mark.parametrize(("value", "message"), [("many", "is not an integer"), ("-1", "out of range")])
def test_cpu_plugin_rejects_bad_counts(monkeypatch, value, message):
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", value)
    with pytest.raises(ValueError, match=message):
        CpuPlugin().local_devices()


def test_selecting_unknown_local_ids_names_them(monkeypatch):
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "2")
    with pytest.raises(ValueError, match=r"local device ids \[5\] do not exist"):
        CpuPlugin().local_devices([0, 5])


def test_unknown_plugin_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown device plugin 'tpu'.*\['cpu'\]"):
        get_plugin("tpu")
