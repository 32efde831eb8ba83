"""The daemon as operators meet it: --help, bad flags, a taken port, signals."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from coordinator.local import LocalCoordinator
from coordinator.main import parser
from ifrt import Topology
from tests.helpers import discover_process, finish, register_request, run_coordinator, taken_port


def listed(flag: str, help_text: str) -> bool:
    """Whether ``help_text`` explains ``flag`` (it begins one of its entries)."""
    return re.search(rf"^  {re.escape(flag)}(?=[ \n])", help_text, re.MULTILINE) is not None


def test_help_shows_how_to_start_and_help_limits_explains_every_flag():
    short, full = run_coordinator("--help").stdout, run_coordinator("--help-limits").stdout
    actions = [a for a in parser(full=True)._actions if a.option_strings and a.dest != "help"]
    assert len(actions) >= 60
    for action in actions:
        assert action.help, f"{action.option_strings} has no help"
        assert listed(action.option_strings[-1], full), action.option_strings
    for flag in ("--num-processes", "--bind", "--store", "--token-file", "--agent-key-file", "--tls-cert",
                 "--heartbeat-timeout", "--on-failure", "--metrics-port", "--help-limits"):
        assert listed(flag, short), flag
    hidden = [a.option_strings[-1] for a in actions if not listed(a.option_strings[-1], short)]
    assert {"--max-barrier-bytes", "--kv-max-bytes", "--max-connections", "--hung-timeouts"} <= set(hidden)
    assert f"({len(hidden)} more flags, each with a safe default): ifrt-coordinator --help-limits" in " ".join(
        short.split())
    assert short.count("\n") < full.count("\n") / 1.8  # the short help is the shorter by far


def test_ifrt_cli_help_explains_every_flag():
    for sub in ("discover", "plugins", "env"):
        result = subprocess.run([str(Path(sys.executable).parent / "ifrt"), sub, "--help"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and "usage: ifrt " + sub in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    ((), "--num-processes"),
    (("--num-processes", "0"), "num_processes 0 is out of range"),
    (("--num-processes", "20000"), "expected 1 <= num_processes <= 16384"),
    (("--num-processes", "2", "--min-processes", "3"), "min_processes 3 is out of range"),  # a shrink's floor too
    (("--num-processes", "2", "--on-failure", "elastic", "--min-processes", "3"), "min_processes 3 is out of range"),
    (("--num-processes", "2", "--store", "redis://db:6379"), "expected memory or etcd://HOST:PORT"),
])
def test_bad_flags_exit_with_a_usage_error(args, message):
    result = run_coordinator(*args)
    assert result.returncode == 2
    assert message in result.stderr


INT32_PROCESSES = 1 << 14  # process ids below this keep every global id (process_id << 17 | local_id) in int32
REGISTER = "/ifrt.topology.v1.Coordinator/Register"


def log_has(coordinator: LocalCoordinator, text: str, timeout: float) -> None:
    """Waits until the daemon's log holds ``text``, reading only what is new (the log grows by 16k lines here)."""
    deadline = time.monotonic() + timeout
    seen = b""
    with open(coordinator.log_path, "rb") as log:
        while text.encode() not in seen:
            assert time.monotonic() < deadline, f"ifrt-coordinator did not log {text!r} within {timeout}s"
            time.sleep(0.1)
            seen = seen[-len(text):] + log.read()


async def register_fillers(coordinator: LocalCoordinator, count: int, batch: int = 2048) -> None:
    """Registers processes 0..count-1 of a cluster of count + 1, ``batch`` at a time.

    Each call is held open (as a waiting process's is) until the daemon has logged its batch's last registration,
    then cancelled: the registrations stay (the heartbeat timeout is long) and nobody receives the topology but
    the process the test runs. A batch is done in a few seconds, well within the 30 s a call may be held: a call
    that timed out would instead be answered with the progress, computed anew for every caller while
    registrations keep arriving.
    """
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        register = channel.unary_unary(REGISTER)
        for first in range(0, count, batch):
            last = min(first + batch, count)
            calls = [register(register_request(pid, wait_ms=600_000).SerializeToString(), timeout=600)
                     for pid in range(first, last)]
            try:
                await asyncio.to_thread(log_has, coordinator, f": {last}/{count + 1} registered", 120)
            finally:
                for call in calls:
                    call.cancel()
            failed = [call for call in calls if call.done() and not call.cancelled()]
            assert not failed, [(await call.code(), await call.details()) for call in failed[:3]]


@pytest.mark.slow
def test_int64_ids_lift_the_process_limit(start_coordinator):
    """Process 16384, the first id whose global ids leave int32, is a real process of a published topology."""
    coordinator = start_coordinator("--int64-ids", "--heartbeat-timeout", "3600", num_processes=INT32_PROCESSES + 1)
    asyncio.run(register_fillers(coordinator, INT32_PROCESSES))
    code, out, err = finish(discover_process(coordinator.address, "--process-id", "16384", "--num-processes",
                                             "16385", devices=2), timeout=120)
    assert code == 0, err
    topology = Topology.from_dict(json.loads(out))
    assert (topology.process_id, topology.num_processes, topology.generation) == (16384, 16385, 1)
    assert [d.id for d in topology.local_devices] == [2147483648, 2147483649]  # 16384 << 17 | 0 and | 1: past int32
    assert topology.device(2147483649).process_id == 16384
    assert topology.device(2147352576).process_id == 16383  # the last id below the limit: 16383 << 17
    assert len(topology.devices) == 16386
    assert "published generation 1: 16385 processes, 16386 devices" in coordinator.log


def test_without_int64_ids_a_process_id_past_the_limit_is_refused(start_coordinator):
    coordinator = start_coordinator(num_processes=INT32_PROCESSES)
    with grpc.insecure_channel(coordinator.address) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(REGISTER)(register_request(16384).SerializeToString(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("process id 16384 is out of range: expected 0 <= process_id < 16384 (num_processes 16384, id limit "
            "16384)") in info.value.details()
    assert "registered process" not in coordinator.log  # nothing was admitted


def test_without_int64_ids_more_processes_than_the_limit_are_refused():
    result = run_coordinator("--num-processes", "16385")
    assert result.returncode == 2
    assert "num_processes 16385 is out of range: expected 1 <= num_processes <= 16384" in result.stderr


def test_taken_port_is_a_clear_error():
    with taken_port() as port:
        result = run_coordinator("--num-processes", "1", "--bind", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_daemon_cleanly(sig):
    with LocalCoordinator(num_processes=2) as coordinator:
        assert coordinator.stop(sig) == 0
        assert f"received {sig.name}" in coordinator.log
        assert "shutting down: 0/2 processes registered" in coordinator.log  # says what it leaves unfinished
        assert coordinator.log.rstrip().endswith("stopped")


def test_check_replay_logs_at_a_graceful_stop_that_the_journal_replays_to_the_live_state(start_coordinator):
    coordinator = start_coordinator(num_processes=1)  # the suite starts every daemon with --check-replay
    code, _, err = finish(discover_process(coordinator.address, "--process-id", "0", "--num-processes", "1"))
    assert code == 0, err
    assert coordinator.stop() == 0
    assert re.search(r"the journal \(\d+ entries\) replays to the live state", coordinator.log), coordinator.log
