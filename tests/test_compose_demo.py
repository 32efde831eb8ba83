"""The multi-host demos run for real: scripts/compose-demo.sh on a real Docker engine (Compose v2 or v1; a local
base image built by debootstrap when no registry can be reached, cached after the first run) and
scripts/multihost.sh on network namespaces. Each must show its steps and its closing line, and leave nothing."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.etcd_cluster import skip_without_etcd
from tests.netns import skip_without_netns
from tests.requirements import require

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = "ifrt-topology-base:bookworm"  # scripts/compose-demo.sh's cached local base
DEMO_TIMEOUT = 900  # seconds: a first run builds the base image (about 80 s here) and the ifrt image
CLOSING = re.compile(r"^(compose|multihost): 4 workers on 4 hosts hold one topology "
                     r"\(fingerprint ([0-9a-f]{12})\.\.\.\), failover kept it, a killed worker was reported to 3$")
ADVICE = "scripts/test.sh installs it as root, or run: apt-get install -y docker.io docker-compose debootstrap"
pytestmark = pytest.mark.serial  # Docker, and checks that nothing of the demo is left anywhere on the machine


def _docker_ready() -> None:
    """Fails (CI=true) or skips unless the demo can run here: Docker, an engine (or dockerd to start), Compose,
    and the local base image or debootstrap to build it."""
    if shutil.which("docker") is None:
        require("docker", f"no `docker` on PATH; {ADVICE}")
    engine = subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    if not engine and (shutil.which("dockerd") is None or os.geteuid() != 0):
        require("docker", f"no Docker engine running, and no dockerd to start as root; {ADVICE}")
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode == 0
    if not v2 and shutil.which("docker-compose") is None:
        require("docker compose", f"neither `docker compose` (v2) nor `docker-compose` (v1); {ADVICE}")
    cached = engine and subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True,
                                       timeout=60).returncode == 0
    if not cached and shutil.which("debootstrap") is None:
        require("debootstrap", f"no registry here, no cached {BASE_IMAGE} and no debootstrap to build it; {ADVICE}")


def _left_of(project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    listed = {kind: subprocess.run(["docker", *command, "--filter", label], capture_output=True, text=True,
                                   timeout=60).stdout.split()
              for kind, command in (("containers", ["ps", "-aq"]), ("networks", ["network", "ls", "-q"]),
                                    ("volumes", ["volume", "ls", "-q"]))}
    return {kind: ids for kind, ids in listed.items() if ids}


def _steps(output: str, label: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"{label}: ")]


def _check_the_story(lines: list[str]) -> None:
    """The steps happened in order, and the topology that the workers held at first is the one they kept."""
    closing = CLOSING.match(lines[-1])
    assert closing, "no closing line; the demo printed:\n" + "\n".join(lines)
    fingerprint = closing.group(2)
    story = "\n".join(lines)
    held = re.search(r": 4 workers hold generation (\d+), fingerprint ([0-9a-f]{12})\.\.\.: (.*)$", story, re.M)
    assert held and held.group(2) == fingerprint, story
    assert len({entry.split(" ")[0] for entry in held.group(3).split(", ")}) == 4, story  # 4 host names
    assert re.search(r": pre-flight: 12 pairs probed, every transfer endpoint reachable", story), story
    assert re.search(r": coordinator\d took over after [\d.]+s \(serving: replayed \d+ journal entries \(generation "
                     + held.group(1) + " published\\)\\)", story), story
    assert re.search(r": 4 sessions re-attached to .* generation " + held.group(1) + ", fingerprint " + fingerprint
                     + r"\.\.\. \(unchanged\)", story), story
    assert re.search(r": 3 workers received ProcessFailed for process 3 within [\d.]+s", story), story


def _script(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs a demo script; past ``timeout`` it gets SIGTERM (its teardown runs) and the test fails saying so."""
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        out, err = process.communicate(timeout=300)
        pytest.fail(f"{argv[1]} did not finish within {timeout}s; it printed:\n{out}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _engine_running() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


@contextlib.contextmanager
def _engine():
    """A Docker engine to ask questions of: the running one, or a dockerd started here and stopped by its pid."""
    if _engine_running():
        yield
        return
    dockerd = subprocess.Popen(["dockerd"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not _engine_running():
            assert dockerd.poll() is None and time.monotonic() < deadline, "dockerd did not answer within 30s"
            time.sleep(0.1)
        yield
    finally:
        dockerd.terminate()
        dockerd.wait(60)


@pytest.mark.slow
def test_compose_demo_runs_the_deployment_for_real_and_leaves_nothing():
    _docker_ready()
    project = f"ifrttest{os.getpid()}"
    engine_was_running = _engine_running()
    run = _script(["bash", str(ROOT / "scripts" / "compose-demo.sh"), "--offline", "--project", project],
                  DEMO_TIMEOUT)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    _check_the_story(_steps(run.stdout, "compose"))
    if not engine_was_running:  # the script started dockerd, and stopped it at exit
        assert "the Docker engine was not running: started dockerd" in run.stdout
        assert "stopping the dockerd this script started" in run.stderr
    with _engine():
        assert _left_of(project) == {}


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("ifrtmh")}


@pytest.mark.slow
def test_multihost_demo_runs_the_same_steps_on_network_namespaces_and_leaves_nothing():
    skip_without_netns()
    skip_without_etcd()
    before = _namespaces()
    run = _script(["bash", str(ROOT / "scripts" / "multihost.sh")], 300)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    _check_the_story(_steps(run.stdout, "multihost"))
    assert _namespaces() == before


def test_a_step_that_does_not_happen_fails_the_demo_names_it_and_still_tears_down():
    skip_without_netns()
    skip_without_etcd()
    before = _namespaces()
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "multihost_demo.py"), "--step-timeout", "0.2",
                          "netns"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = _steps(run.stdout, "multihost")
    assert run.returncode == 1, run.stdout
    assert any(re.search(r"FAILED: worker\d printed no topology in time", line) for line in lines), run.stdout
    assert lines[-1] == "multihost: tearing down" and not CLOSING.match(lines[-1])
    assert _namespaces() == before
