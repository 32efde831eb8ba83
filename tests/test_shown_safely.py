"""Strings from the wire shown safely: a hostname or reason with a newline, a terminal escape or a bidi override
cannot forge a line in the coordinator's log or an ``ifrt run`` agent's stderr, or recolor a terminal; it shows as
a visible escape (``ifrt.safe_text``). Real processes: a coordinator, an agent, a caller registering on the wire."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading

import grpc
import pytest

from ifrt import render, status_view, wire
from ifrt._generated import coordinator_pb2 as pb
from ifrt._generated.coordinator_pb2_grpc import CoordinatorStub
from ifrt.records import Device, Process, TopologyContent
from ifrt.safe_text import SafeFormatter, safe, safe_lines
from ifrt.topology import Topology
from tests.helpers import BIN, register_request, wait_status
from tests.run_agents import RUN_WORKER

EVIL_HOST = "evil\n\x1b[31mFAKE LOG LINE"
SHOWN_HOST = "evil\\n\\x1b[31mFAKE LOG LINE"
COORDINATOR_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")
GRPC_CORE = re.compile(r"[EWID]\d{4} ")
"""gRPC's C core writes its own (rare) errors to stderr in its own format, past Python's logging."""


# The function.

@pytest.mark.parametrize(("text", "shown"), [
    ("node-1", "node-1"),
    ("שרת-7", "שרת-7"),  # letters of every script are left as they are
    ("naïve host", "naïve host"),
    (EVIL_HOST, SHOWN_HOST),
    ("a\rb\tc\x00d\x7fe", "a\\rb\\tc\\x00d\\x7fe"),
    ("csi\x9b31m", "csi\\x9b31m"),  # C1: a one-byte CSI on some terminals
    ("host\u202egnp.exe", "host\\u202egnp.exe"),  # RIGHT-TO-LEFT OVERRIDE
    ("\u2066x\u2069 \u200e\u200f\u061c", "\\u2066x\\u2069 \\u200e\\u200f\\u061c"),  # isolates, marks
    ("\u202a\u202b\u202c\u202d", "\\u202a\\u202b\\u202c\\u202d"),  # embeddings, pop, LTR override
    ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),  # other format characters
    ("line\u2028para\u2029", "line\\u2028para\\u2029"),
    ("tag\U000e0041", "tag\\U000e0041"),
    ("lone \ud800", "lone \\ud800"),
])
def test_controls_and_bidi_characters_are_escaped_and_letters_are_not(text, shown):
    assert safe(text) == shown
    assert safe(shown) == shown  # already safe: unchanged
    assert shown.isascii() or shown == text


def test_multi_line_text_keeps_its_own_line_breaks_only():
    assert safe_lines("first\nsecond \x1b[2J") == "first\nsecond \\x1b[2J"


def test_the_formatter_writes_one_line_per_record_whatever_the_arguments():
    record = logging.LogRecord("ifrt.coordinator", logging.WARNING, __file__, 1, "process %s failed: %s",
                               (EVIL_HOST, "bye\u202e"), None)
    line = SafeFormatter("%(levelname)s %(message)s").format(record)
    assert line == f"WARNING process {SHOWN_HOST} failed: bye\\u202e"


def test_the_status_table_and_topology_table_show_callers_names_escaped():
    view = status_view.to_dict(pb.StatusResponse(
        cluster_id="job\x1b]0;title\x07", state=pb.CLUSTER_PHASE_DEGRADED, expected=1, registered=1,
        processes=[pb.ProcessStatus(process_id=0, hostname=EVIL_HOST, host_address="127.0.0.1",
                                    phase=pb.PROCESS_PHASE_FAILED, reason="gone\nFORGED")]))
    view["replicas"] = [{"address": "127.0.0.1:8476\u202e", "role": "leader"}]  # as ifrt status adds them
    text = status_view.render(view)
    assert "\x1b" not in text and "\x07" not in text
    assert not any(line.startswith(("FAKE", "FORGED")) for line in text.splitlines())
    assert f"failed:     process 0 on {SHOWN_HOST} (127.0.0.1): gone\\nFORGED" in text
    assert "cluster job\\x1b]0;title\\x07: degraded" in text
    assert "replicas:   127.0.0.1:8476\\u202e leader" in text

    processes = (Process(0, "a\u202eb", "10.0.0.1:9000"),)
    devices = (Device(0, 0, 0, "cpu\n", "cpu"),)
    topology = Topology(wire.encode(TopologyContent("", 1, 1, processes, devices)), 0)
    table = render.table(topology)
    assert "a\\u202eb" in table and "cpu\\n" in table and "\u202e" not in table


# Real processes.

def register_raw(address: str, hostname: str, process_id: int, num_processes: int) -> threading.Thread:
    """Registers process ``process_id`` as a caller on the wire would, with ``hostname``, and opens no session (so
    the coordinator declares it failed after the heartbeat timeout); the call waits for the topology in a thread."""
    def call() -> None:
        # the job may end first: only what the others print of this process matters
        with grpc.insecure_channel(address) as channel, contextlib.suppress(grpc.RpcError):
            CoordinatorStub(channel).Register(register_request(process_id, hostname=hostname,
                                                               num_processes=num_processes), timeout=60)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_hostname_with_a_newline_and_an_escape_forges_no_line_in_the_coordinators_log(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=1)
    register_raw(coordinator.address, EVIL_HOST, 0, 1).join(30)
    coordinator.wait_for_log(f"process 0 ({SHOWN_HOST} (127.0.0.1)) failed: ")
    coordinator.stop()
    log = coordinator.log
    assert "\x1b" not in log, log
    assert f"registered process 0 on {SHOWN_HOST} (127.0.0.1) with 1 devices" in log, log
    for line in log.splitlines():  # every line is one the coordinator began: none starts with the caller's text
        assert COORDINATOR_LINE.match(line) or GRPC_CORE.match(line), f"a forged line: {line!r}\n{log}"


def test_a_failed_hosts_name_forges_no_line_in_an_agents_stderr(start_coordinator):
    """The agent runs process 0; process 1 registers from the wire with a hostname carrying a newline and a color
    escape, and never opens a session: the coordinator declares it failed, and every agent says so on stderr."""
    coordinator = start_coordinator("--heartbeat-timeout", "1", num_processes=2, log_level="WARNING")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
    env.update(IFRT_COORDINATOR=coordinator.address, IFRT_CPU_DEVICE_COUNT="1", IFRT_FAILOVER_WINDOW="10")
    agent = subprocess.Popen([str(BIN / "ifrt"), "run", "--nproc-per-host", "1", "--host-rank", "0", "--num-hosts",
                              "2", "--max-restarts", "0", "--grace-seconds", "2", "--", sys.executable,
                              str(RUN_WORKER), "loop"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_status(coordinator.address, lambda v: v["registered"] == 1, timeout=30)  # the agent's worker, first:
        register_raw(coordinator.address, EVIL_HOST, 1, 2)  # else process 1 could be forgotten before publication
        _, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    text = err.decode(errors="replace")
    assert f"process 1 on {SHOWN_HOST} failed: " in text, text
    assert b"\x1b" not in err, text
    for line in text.splitlines():  # the agent's own lines, and its worker's stderr behind its prefix
        assert line.startswith(("ifrt run: ", "[0] ")) or GRPC_CORE.match(line), f"a forged line: {line!r}\n{text}"
    log = coordinator.log  # the coordinator's own lines about the same failure
    assert f"process 1 ({SHOWN_HOST} (127.0.0.1)) failed: " in log and "\x1b" not in log, log
    assert all(COORDINATOR_LINE.match(line) or GRPC_CORE.match(line) for line in log.splitlines()), log

