"""A program that waits on the coordinator says so, on stderr when it set up no logging and through its own
handlers when it did, within seconds and then every few seconds; Ctrl-C ends `ifrt discover` with 130; a misspelt
IFRT_* variable is named."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ifrt import variables
from tests.helpers import BIN, discover_process
from tests.replicas import Replicas

PROGRAM = """
import sys, ifrt, ifrt.client  # what discover loads first: the clock starts at the wait, not at the imports
print("discovering", flush=True)
try:
    ifrt.discover(timeout={timeout})
except ifrt.IfrtError as e:
    print("gave up:", type(e).__name__, flush=True)
"""
FIRST_LINE_S = 3.0
"""The first line is due 1.5 s into the wait (ClientConfig.first_report_s, unreachable_report_after_s), counted from
the program's first line, after its imports; the bound leaves room for a loaded machine."""


def waiting_program(coordinator: str, timeout: float = 6, setup: str = "", **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    return subprocess.Popen([sys.executable, "-c", setup + PROGRAM.format(timeout=timeout)],
                            env={**clean, "IFRT_COORDINATOR": coordinator, "IFRT_PROCESS_ID": "0",
                                 "IFRT_NUM_PROCESSES": "2", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines_after_start(child: subprocess.Popen) -> list[tuple[float, str]]:
    """Each stderr line with the seconds since the program began to discover, until it exits."""
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline().strip() == "discovering"
    began = time.monotonic()
    seen = [(time.monotonic() - began, line.rstrip("\n")) for line in iter(child.stderr.readline, "")]
    child.wait(30)
    return seen


def test_a_program_without_logging_hears_of_an_unserved_port_within_seconds_and_again(free_port):
    seen = lines_after_start(waiting_program(f"127.0.0.1:{free_port}", timeout=9))
    reports = [(t, line) for t, line in seen if line.startswith(f"ifrt: cannot reach 127.0.0.1:{free_port}: "
                                                                "connection refused (retrying for")]
    assert reports and reports[0][0] < FIRST_LINE_S, seen
    assert len(reports) >= 2, seen  # said again while it retries


def test_a_program_without_logging_hears_which_peers_it_waits_for(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    seen = lines_after_start(waiting_program(coordinator.address))
    waits = [(t, line) for t, line in seen if line.startswith("ifrt: waiting for the topology from ")]
    assert waits and waits[0][0] < FIRST_LINE_S, seen
    assert "1/2 processes registered; missing process ids [1]" in waits[0][1]


def test_a_program_pointed_at_a_standby_alone_hears_that_it_does_not_serve(etcd):
    with Replicas(etcd, num_processes=2) as replicas:
        standby = next(c for c in replicas.all if c is not replicas.leader)
        seen = lines_after_start(waiting_program(standby.address))
    reports = [(t, line) for t, line in seen if line.startswith(f"ifrt: no serving coordinator at {standby.address}")]
    assert reports and reports[0][0] < FIRST_LINE_S, seen


def test_a_program_that_set_up_logging_gets_each_line_once_through_its_handler(free_port):
    setup = "import logging; logging.basicConfig(level=logging.INFO, format='LOGGED %(name)s: %(message)s')\n"
    seen = lines_after_start(waiting_program(f"127.0.0.1:{free_port}", setup=setup))
    logged = [line for _, line in seen if line.startswith("LOGGED ifrt.wait: cannot reach")]
    assert logged, seen
    assert not [line for _, line in seen if line.startswith("ifrt: ")], seen  # never also on stderr directly


def test_ctrl_c_ends_ifrt_discover_with_130_and_no_traceback(start_coordinator):
    coordinator = start_coordinator(num_processes=2)
    child = discover_process(coordinator.address, "--process-id", "0", "--num-processes", "2", timeout=60)
    assert child.stderr is not None
    line = child.stderr.readline()  # it says what it waits for: it is inside its wait now
    assert "waiting for the topology" in line, line
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 130, err
    assert "Traceback" not in err and err.strip().endswith("ifrt: interrupted"), err


def test_a_misspelt_variable_is_named_with_the_one_meant(free_port):
    child = waiting_program(f"127.0.0.1:{free_port}", timeout=0.5, IFRT_PROCES_ID="1", IFRT_PLUGN="cpu")
    _, err = child.communicate(timeout=30)
    assert "IFRT_PROCES_ID is set but ifrt reads no such variable: did you mean IFRT_PROCESS_ID?" in err, err
    assert "IFRT_PLUGN is set but ifrt reads no such variable: did you mean IFRT_PLUGIN?" in err, err
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IFRT_")}
    shown = subprocess.run([str(BIN / "ifrt"), "env"], env={**clean, "IFRT_COORDNATOR": "h:1"}, capture_output=True,
                           text=True, timeout=30)
    assert "warning: IFRT_COORDNATOR is set but ifrt reads no such variable: did you mean IFRT_COORDINATOR?" in \
        shown.stdout, shown.stdout


def test_every_ifrt_variable_the_project_names_is_one_it_knows():
    root = Path(__file__).resolve().parent.parent
    named = set()
    for folder in ("ifrt", "coordinator", "plugins", "deploy", "examples", "scripts"):
        for path in (root / folder).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".md", ".yaml", ".sh"} and path.name != "variables.py":
                named |= set(re.findall(r"\bIFRT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    named |= set(re.findall(r"\bIFRT_[A-Z0-9_]*[A-Z0-9]\b", (root / "docker-compose.yml").read_text()))
    foreign = sorted(n for n in named if n not in variables.READ and not n.startswith(variables.OWN_PREFIXES)
                     and not any(known.startswith(n + "_") for known in variables.READ))  # families: IFRT_TLS_*
    assert foreign == [], f"named in the project but not in ifrt.variables.READ: {foreign}"


@pytest.mark.parametrize("name", sorted(variables.READ))
def test_no_variable_ifrt_reads_is_reported_as_unknown(name):
    assert variables.unknown({name: "1"}) == []
