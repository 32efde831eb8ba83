"""docker-compose.yml, checked offline: references, the image, and that every ifrt command in it parses with the
real command-line parsers (tests/test_compose_demo.py runs it for real)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from coordinator.main import parser as coordinator_parser
from coordinator.store import open_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_no_top_level_name_key(compose):
    assert "name" not in compose  # Docker Compose v1 rejects it


def test_references_resolve(compose):
    services = compose["services"]
    for name, service in services.items():
        assert "build" in service or "image" in service, name
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown service {dependency}"
        for network in service.get("networks", []):
            assert network in compose["networks"], f"{name} uses undeclared network {network}"
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in compose["volumes"], f"{name} uses undeclared volume {volume}"


def test_the_image_copies_what_exists():
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            sources = line.split()[1:-1]
            for source in sources:  # a pattern may match nothing (wheelhouse*: only in the demo's build context)
                assert any(ROOT.glob(source)) or "*" in source, f"Dockerfile copies missing {source}"
            assert any(any(ROOT.glob(source)) for source in sources), f"nothing to copy in: {line}"


def test_the_registry_path_is_the_default_and_a_local_base_can_replace_it(compose):
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}\n" in dockerfile
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["build"]["args"]["BASE_IMAGE"] == "${IFRT_BASE_IMAGE:-python:3.11-slim}", name
            assert service["build"]["context"] == "${IFRT_BUILD_CONTEXT:-.}", name
        elif name.startswith("etcd"):
            assert service["image"] == "${IFRT_ETCD_IMAGE:-quay.io/coreos/etcd:v3.5.17}", name


def test_every_host_has_its_own_name(compose):
    names = [service.get("hostname") for service in compose["services"].values()]
    assert names == list(compose["services"])
    # The loaded mapping keeps one service per name whatever the file says: count the names the file itself holds.
    root = yaml.compose((ROOT / "docker-compose.yml").read_text())
    [services] = [value for key, value in root.value if key.value == "services"]
    written = [key.value for key, _ in services.value]
    assert len(set(written)) == len(written), f"a service name stands twice in docker-compose.yml: {written}"


def test_coordinator_commands_parse_and_point_at_the_etcd_services(compose):
    services = compose["services"]
    coordinators = {n: s for n, s in services.items() if s.get("command", [""])[0] == "ifrt-coordinator"}
    assert len(coordinators) == 2
    for name, service in coordinators.items():
        args = coordinator_parser().parse_args(service["command"][1:])
        open_store(args.store, args.cluster_id)
        for host in re.findall(r"([\w-]+):2379", args.store):
            assert host in services, f"{name} stores in unknown service {host}"
        assert args.advertise == f"{name}:8476"


def test_workers_form_the_cluster_the_coordinators_expect(compose):
    services = compose["services"]
    coordinator_args = coordinator_parser().parse_args(services["coordinator1"]["command"][1:])
    workers = [s for s in services.values() if "IFRT_PROCESS_ID" in s.get("environment", {})]
    assert sorted(int(w["environment"]["IFRT_PROCESS_ID"]) for w in workers) == list(
        range(coordinator_args.num_processes))
    for w in workers:
        env = w["environment"]
        assert int(env["IFRT_NUM_PROCESSES"]) == coordinator_args.num_processes
        assert env["IFRT_CLUSTER_ID"] == coordinator_args.cluster_id
        assert {a.split(":")[0] for a in env["IFRT_COORDINATOR"].split(",")} == {"coordinator1", "coordinator2"}
        assert (ROOT / w["command"][1]).exists()


def test_etcd_members_agree_on_the_initial_cluster(compose):
    members = {n: s["command"] for n, s in compose["services"].items() if s.get("command", [""])[0] == "etcd"}
    clusters = {cmd[cmd.index("--initial-cluster") + 1] for cmd in members.values()}
    assert len(clusters) == 1
    assert sorted(entry.split("=")[0] for entry in clusters.pop().split(",")) == sorted(members)
    for name, cmd in members.items():
        assert cmd[cmd.index("--name") + 1] == name
