"""Layers: plain values, ids, errors and plugins import without grpc or numpy; each error keeps its gRPC status."""

import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import ifrt
from ifrt.errors import ERROR_CLASSES

ROOT = Path(__file__).parents[1]


def run_fresh(code: str) -> dict:
    """Runs ``code`` in a fresh interpreter on this tree; returns the JSON object it prints last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


HEAVY = ("grpc", "numpy", "google.protobuf", "ifrt.client", "ifrt._generated")


def test_values_ids_errors_and_plugins_import_without_grpc_or_numpy():
    seen = run_fresh(
        "import json, sys\n"
        "import ifrt.records, ifrt.ids, ifrt.errors, plugins\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps({'loaded': sorted(m for m in sys.modules if m.startswith(heavy))}))\n"
    )
    assert seen == {"loaded": []}


CLIENT = ("ifrt.client", "ifrt.client_kv", "ifrt.agent_link", "ifrt.pushed", "ifrt.connection", "ifrt.session",
          "ifrt.settings", "ifrt.clusters", "ifrt.security",
          "ifrt.status", "ifrt.topology", "ifrt.transfer", "ifrt.preflight", "ifrt.failfast", "ifrt.jax", "ifrt.torch",
          "ifrt.torch.store", "ifrt.run", "plugins")
"""What a job's process imports to reach the coordinator: the coordinator and the shared modules load none of it."""


def test_the_coordinator_and_the_shared_modules_load_no_client_module():
    seen = run_fresh(
        "import json, sys\n"
        "import coordinator.main, coordinator.server, coordinator.metrics, ifrt.hostport, ifrt.protocol, ifrt.records\n"
        "import ifrt.status_view, ifrt.wire\n"
        f"client = {CLIENT!r}\n"
        "print(json.dumps({'loaded': sorted(m for m in sys.modules if m.split('.')[0] in client\n"
        "                                   or '.'.join(m.split('.')[:2]) in client)}))\n"
    )
    assert seen == {"loaded": []}


def test_the_ifrt_run_agent_loads_neither_numpy_nor_the_client():
    seen = run_fresh(  # an agent per host in every job: numpy alone cost each one a third of its start
        "import json, sys\n"
        "import ifrt.cli, ifrt.run.shell\n"
        "print(json.dumps({'loaded': sorted(m for m in sys.modules if m.split('.')[0] == 'numpy'\n"
        "                                   or m in ('ifrt.client', 'ifrt.topology', 'ifrt.transfer'))}))\n"
    )
    assert seen == {"loaded": []}


def test_the_package_still_offers_discover_client_topology_and_mesh():
    seen = run_fresh(
        "import json, sys\n"
        "import ifrt\n"
        "names = {'discover': ifrt.discover.__module__, 'Client': ifrt.Client.__module__,\n"
        "         'Topology': ifrt.Topology.__module__, 'Mesh': ifrt.Mesh.__module__}\n"
        "star = {}\n"
        "exec('from ifrt import *', star)\n"
        "print(json.dumps({'names': names, 'star': sorted(set(star) - {'__builtins__'}),\n"
        "                  'grpc': 'grpc' in sys.modules}))\n"
    )
    assert seen["names"] == {"discover": "ifrt", "Client": "ifrt.client", "Topology": "ifrt.topology",
                             "Mesh": "ifrt.mesh"}
    assert seen["star"] == sorted(ifrt.__all__)
    assert seen["grpc"] is True  # ifrt.Client brought it in, when it was asked for


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'ifrt' has no attribute 'Clinet'"):
        ifrt.Clinet  # noqa: B018


STATUS = {
    "InvalidArgument": "INVALID_ARGUMENT",
    "PluginError": "INVALID_ARGUMENT",
    "ProcessIdTaken": "ALREADY_EXISTS",
    "ClusterMismatch": "FAILED_PRECONDITION",
    "UnknownClient": "NOT_FOUND",
    "ProcessDeclaredFailed": "FAILED_PRECONDITION",
    "StaleSession": "FAILED_PRECONDITION",
    "AttemptEnded": "ABORTED",
    "ResourceExhausted": "RESOURCE_EXHAUSTED",
    "Overloaded": "RESOURCE_EXHAUSTED",
    "BarrierFailed": "ABORTED",
    "BarrierTimeout": "DEADLINE_EXCEEDED",
    "BarrierCancelled": "CANCELLED",
    "KeyExists": "ALREADY_EXISTS",
    "KeyValueTimeout": "DEADLINE_EXCEEDED",
    "TopologyError": "DATA_LOSS",
    "CoordinatorUnavailable": "UNAVAILABLE",
    "DiscoveryTimeout": "DEADLINE_EXCEEDED",
    "Unauthenticated": "UNAUTHENTICATED",
    "PermissionDenied": "PERMISSION_DENIED",
    "HostHeld": "PERMISSION_DENIED",
    "TransportMismatch": "UNAVAILABLE",
    "CertificateRejected": "UNAVAILABLE",
    "JobFailed": "ABORTED",
    "PeerFailed": "ABORTED",
    "CollectiveFailed": "ABORTED",
    "StateLost": "FAILED_PRECONDITION",
    "CoordinatorGone": "UNAVAILABLE",
    "AgentGone": "UNAVAILABLE",
    "BackendAlreadyInitialized": "FAILED_PRECONDITION",
    "PreflightFailed": "FAILED_PRECONDITION",
    "TransferError": "DATA_LOSS",
    "OldIncarnation": "DATA_LOSS",
    "TransferTimeout": "DEADLINE_EXCEEDED",
}


@pytest.mark.parametrize("name", sorted(STATUS))
def test_each_error_has_its_one_grpc_status(name):
    cls = ERROR_CLASSES[name]
    assert cls.status == STATUS[name]
    assert cls.code is getattr(grpc.StatusCode, STATUS[name])
    assert cls("x").code is getattr(grpc.StatusCode, STATUS[name])


def test_every_error_class_is_in_the_status_table():
    assert set(ERROR_CLASSES) == set(STATUS)
    assert ifrt.IfrtError.code is grpc.StatusCode.UNKNOWN


def test_every_error_class_in_any_module_is_defined_in_ifrt_errors_with_its_status():
    seen = run_fresh(
        "import importlib, json, pkgutil\n"
        "import coordinator, ifrt, plugins\n"
        "from ifrt.errors import IfrtError\n"
        "for package in (ifrt, coordinator, plugins):\n"
        "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(module.name)\n"
        "def below(cls):\n"
        "    for sub in cls.__subclasses__():\n"
        "        yield sub\n"
        "        yield from below(sub)\n"
        "print(json.dumps({'errors': sorted({f'{c.__module__}.{c.__qualname__}' for c in below(IfrtError)})}))\n"
    )
    assert [name for name in seen["errors"] if not name.startswith("ifrt.errors.")] == []
    assert seen["errors"] == sorted(f"ifrt.errors.{name}" for name in STATUS)


def test_a_status_without_a_trailer_still_maps_to_its_class():
    by_code = ifrt.errors._BY_CODE  # what the client falls back on, keyed by grpc.StatusCode
    assert by_code == {
        grpc.StatusCode.INVALID_ARGUMENT: ifrt.InvalidArgument,
        grpc.StatusCode.RESOURCE_EXHAUSTED: ifrt.InvalidArgument,
        grpc.StatusCode.ALREADY_EXISTS: ifrt.ProcessIdTaken,
        grpc.StatusCode.FAILED_PRECONDITION: ifrt.ClusterMismatch,
        grpc.StatusCode.UNAUTHENTICATED: ifrt.Unauthenticated,
        grpc.StatusCode.PERMISSION_DENIED: ifrt.PermissionDenied,
    }


def test_an_error_raised_by_the_coordinator_arrives_as_its_class(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    with ifrt.Client(coordinator.address, process_id=0, num_processes=3, timeout=30) as client, pytest.raises(
            ifrt.ClusterMismatch, match=r"\(FAILED_PRECONDITION\)$"):
        client.discover()
