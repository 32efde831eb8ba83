"""Device plugins: built-ins, third-party plugins through entry points, and the `ifrt plugins` listing."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ifrt
from ifrt.records import LocalDevice
from plugins import PluginError, all_plugins, get_plugin
from plugins.cpu import CpuPlugin
from plugins.cuda import CudaPlugin
from plugins.sim import devices_from_spec
from tests.helpers import discover_process, finish

FIXTURES = Path(__file__).with_name("fixture_plugins")
ROOT = Path(__file__).parents[1]
CHILD_PATH = os.pathsep.join([str(FIXTURES), str(ROOT)])
"""PYTHONPATH for a child: the fixture distributions, and this tree's own ifrt and plugins."""
NVML_INSTALLED = importlib.util.find_spec("pynvml") is not None


@pytest.fixture
def third_party(monkeypatch):
    """Puts the fixture distributions (a working plugin and a broken one) on sys.path."""
    monkeypatch.syspath_prepend(str(FIXTURES))


# cpu
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


# sim
def test_sim_spec_gives_kinds_slices_and_coordinates():
    devices = devices_from_spec("kind=tpu-v5e,devices=8,slices=2,coords=2x4,memory=16G")
    assert [d.kind for d in devices] == ["tpu-v5e"] * 8
    assert [d.slice_key for d in devices] == ["0"] * 4 + ["1"] * 4
    assert [d.coordinates for d in devices] == [(x, y) for x in range(2) for y in range(4)]
    assert devices[0].attributes["memory_bytes"] == str(16 << 30)
    assert {d.platform for d in devices} == {"sim"}


def test_sim_spec_with_one_slice_for_the_process():
    assert {d.slice_key for d in devices_from_spec("devices=4,slice=pod-3")} == {"pod-3"}


@pytest.mark.parametrize(("spec", "message"), [
    ("devices=eight", "devices=eight is not a whole number"),
    ("devices=0", "devices=0 is not a whole number from 1"),
    ("devices=6,slices=4", "do not split into slices=4"),
    ("devices=8,coords=3x3", "has 9 points for devices=8"),
    ("devices=8,coords=2by4", "is not a grid"),
    ("colour=red", "unknown key 'colour'"),
    ("kind", "'kind' is not key=value"),
    ("devices=2,devices=3", "'devices' is given twice"),
    ("slices=2,slice=a,devices=2", "not both"),
    ("memory=lots", "not a byte count"),
])
def test_bad_sim_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        devices_from_spec(spec)


def test_sim_plugin_through_discover(start_coordinator, monkeypatch):
    coordinator = start_coordinator(num_processes=1)
    monkeypatch.setenv("IFRT_PLUGIN", "sim")
    monkeypatch.setenv("IFRT_SIM_SPEC", "kind=tpu-v5e,devices=8,slices=2,coords=2x4")
    with ifrt.Client(coordinator.address, process_id=0, timeout=30) as client:
        topology = client.discover()
    assert len(topology.devices) == 8
    assert {(d.kind, d.plugin) for d in topology.devices} == {("tpu-v5e", "sim")}
    assert [d.slice_index for d in topology.devices] == [0] * 4 + [1] * 4
    assert topology.devices[5].coordinates == (1, 1)


# cuda
def test_cuda_without_nvml_is_unavailable_and_says_why():
    reason = CudaPlugin().check()
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert reason is not None and "nvidia-ml-py is not installed" in reason
    else:
        pytest.skip("nvidia-ml-py is installed here; this test covers its absence")
    with pytest.raises(ValueError, match="the cuda plugin cannot list GPUs here"):
        CudaPlugin().local_devices()


# jax
def test_jax_plugin_reports_the_devices_jax_has(tmp_path):
    pytest.importorskip("jax", reason="the jax extra is not installed (scripts/test.sh installs it)")
    script = (
        "import json, jax\n"
        "from plugins import get_plugin\n"
        "ours = get_plugin('jax').local_devices()\n"
        "print(json.dumps({'jax': [[d.platform, d.device_kind] for d in jax.local_devices()],"
        " 'ours': [[d.platform, d.kind, d.local_id] for d in ours]}))\n"
    )
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert len(seen["jax"]) == 4
    assert [o[:2] for o in seen["ours"]] == seen["jax"]
    assert [o[2] for o in seen["ours"]] == [0, 1, 2, 3]


def test_jax_keeps_the_local_hardware_id_on_the_host_and_publishes_where_a_core_is():
    from plugins.jax_plugin import _record

    chip = _record(2, "tpu", "TPU v4", 2, (1, 0, 0), 3, 0)
    assert (chip.slice_key, chip.coordinates) == ("3", (1, 0, 0))
    assert (dict(chip.attributes), dict(chip.host_attributes)) == ({"core_on_chip": "0"}, {"local_hardware_id": "2"})
    cpu = _record(0, "cpu", "cpu", 0, None, None, None)
    assert (dict(cpu.attributes), dict(cpu.host_attributes), cpu.slice_key) == ({}, {}, "")


# host-only attributes
def test_host_attributes_stay_in_the_process_and_out_of_the_topology(start_coordinator, third_party):
    coordinator = start_coordinator(num_processes=1)
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, plugin="fake-accel", timeout=30,
                     session=False, transfer=False) as client:
        assert client.local_devices == ()
        topology = client.discover()
        mine = client.local_devices
    assert [dict(d.host_attributes) for d in mine] == [{"bus": "0000:41:00.0"}, {"bus": "0000:42:00.0"},
                                                       {"bus": "0000:43:00.0"}]
    assert [d.local_id for d in mine] == [d.local_id for d in topology.local_devices] == [0, 1, 2]
    assert [dict(d.attributes) for d in topology.devices] == [{"serial": f"FA{i:04d}"} for i in range(3)]
    assert b"0000:4" not in topology.canonical_bytes  # uncompressed: a bus id sent would show


# third-party plugins
def test_third_party_plugin_is_found_and_used(third_party, monkeypatch):
    plugin = get_plugin("fake-accel")
    assert [d.kind for d in plugin.local_devices()] == ["fa-1"] * 3
    assert isinstance(plugin.local_devices([2])[0], LocalDevice)


def test_broken_plugin_is_reported_and_breaks_nothing_else(third_party):
    with pytest.raises(PluginError, match=r"plugin 'broken' .* failed to load: ModuleNotFoundError"):
        get_plugin("broken")
    infos = {i.name: i for i in all_plugins()}
    assert infos["broken"].status.startswith("broken: plugin 'broken'")
    assert infos["fake-accel"].status == "available"
    assert infos["cpu"].status == "available"


def test_unknown_plugin_lists_the_known_ones(third_party):
    with pytest.raises(PluginError, match=r"unknown device plugin 'tpu'.*'cpu'.*'fake-accel'"):
        get_plugin("tpu")


def test_a_process_imports_only_the_built_in_plugin_it_uses():
    script = ("import sys\nfrom plugins import get_plugin\nfrom plugins.registry import BUILTIN\n"
              "assert get_plugin('cpu').name == 'cpu'\n"
              "print(sorted(m for m in sys.modules if m.startswith('plugins.')))\n"
              "print([get_plugin(n).name for n in BUILTIN] == list(BUILTIN))\n")
    out = subprocess.run([sys.executable, "-c", script], env={"PYTHONPATH": CHILD_PATH, "PATH": "/usr/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['plugins.base', 'plugins.cpu', 'plugins.registry']", "True"]


def test_ifrt_plugins_lists_everything_and_exits_zero():
    env = {"PYTHONPATH": CHILD_PATH, "PATH": "/usr/bin"}
    out = subprocess.run([str(Path(sys.executable).parent / "ifrt"), "plugins", "--json"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = {row["name"]: row for row in map(json.loads, out.stdout.splitlines())}
    assert {"cpu", "sim", "cuda", "jax", "fake-accel", "broken", "faulty-check", "faulty-devices"} <= set(listed)
    assert listed["cpu"]["status"] == "available"
    assert listed["fake-accel"]["status"] == "available"
    assert listed["faulty-devices"]["status"] == "available"  # its bug shows only when it lists devices
    assert "ModuleNotFoundError" in listed["broken"]["status"]
    assert listed["faulty-check"]["status"] == (
        "broken: plugin 'faulty-check': check() raised RuntimeError: the accelerator driver crashed")
    cuda = listed["cuda"]["status"]
    if NVML_INSTALLED:  # then it depends on the driver, and only one of two things may be said
        assert cuda == "available" or cuda.startswith("unavailable: NVML did not start ("), cuda
    else:
        assert cuda == "unavailable: nvidia-ml-py is not installed (pip install 'ifrt-topology[cuda]')"


def test_a_plugin_whose_check_raises_is_listed_with_its_error(third_party):
    infos = {i.name: i for i in all_plugins()}
    assert infos["faulty-check"].status == (
        "broken: plugin 'faulty-check': check() raised RuntimeError: the accelerator driver crashed")
    assert infos["fake-accel"].status == "available"
    assert infos["cpu"].status == "available"


def test_a_plugin_raising_while_listing_devices_is_a_plugin_error(start_coordinator, third_party):
    coordinator = start_coordinator(num_processes=1)
    with ifrt.Client(coordinator.address, process_id=0, plugin="faulty-devices", timeout=30) as client, \
            pytest.raises(ifrt.PluginError) as info:
        client.discover()
    assert str(info.value) == "device plugin 'faulty-devices': KeyError: 'fabric_id'"
    assert isinstance(info.value, ifrt.InvalidArgument)
    assert isinstance(info.value.__cause__, KeyError)
    with ifrt.Client(coordinator.address, process_id=0, timeout=30) as client:  # the coordinator is unaffected
        assert len(client.discover().devices) == 1


def test_a_plugins_value_error_is_a_plugin_error_naming_it(start_coordinator, monkeypatch):
    coordinator = start_coordinator(num_processes=1)
    monkeypatch.setenv("IFRT_CPU_DEVICE_COUNT", "many")
    with ifrt.Client(coordinator.address, process_id=0, plugin="cpu", timeout=30) as client, pytest.raises(
            ifrt.PluginError, match=r"^device plugin 'cpu': IFRT_CPU_DEVICE_COUNT='many' is not an integer: "
                                    r"expected 0 <= count <= 131072$"):
        client.discover()


def test_ifrt_discover_reports_a_raising_plugin_as_a_typed_error(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    code, out, err = finish(discover_process(coordinator.address, "--process-id", "0", "--plugin", "faulty-devices",
                                             env={"PYTHONPATH": CHILD_PATH}))
    assert (code, out) == (1, "")
    assert err.strip() == "ifrt discover: PluginError: device plugin 'faulty-devices': KeyError: 'fabric_id'"


def test_third_party_plugin_through_discover(start_coordinator):
    coordinator = start_coordinator(num_processes=1)
    code, out, err = finish(discover_process(coordinator.address, "--process-id", "0", "--plugin", "fake-accel",
                                             env={"PYTHONPATH": CHILD_PATH}))
    assert code == 0, err
    topology = ifrt.Topology.from_dict(json.loads(out))
    assert [(d.kind, d.plugin, d.attributes["serial"]) for d in topology.devices] == [
        ("fa-1", "fake-accel", f"FA{i:04d}") for i in range(3)]


# mixed clusters
def test_mixed_plugins_are_refused_unless_allowed(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    first = discover_process(coordinator.address, "--process-id", "0", "--plugin", "cpu")
    coordinator.wait_for_log("registered process 0")
    code, _, err = finish(discover_process(coordinator.address, "--process-id", "1", "--plugin", "sim",
                                           env={"IFRT_SIM_SPEC": "devices=2"}))
    assert code != 0 and "ClusterMismatch" in err and "--allow-mixed-platforms" in err
    finish(discover_process(coordinator.address, "--process-id", "1", "--plugin", "cpu"))
    assert finish(first)[0] == 0

    mixed = start_coordinator("--allow-mixed-platforms", num_processes=2)
    children = [discover_process(mixed.address, "--process-id", "0", "--plugin", "cpu"),
                discover_process(mixed.address, "--process-id", "1", "--plugin", "sim",
                                 env={"IFRT_SIM_SPEC": "devices=2"})]
    outputs = [finish(c) for c in children]
    assert [code for code, _, _ in outputs] == [0, 0], outputs
    topology = ifrt.Topology.from_dict(json.loads(outputs[0][1]))
    assert {d.plugin for d in topology.devices} == {"cpu", "sim"}
