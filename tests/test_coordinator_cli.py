"""The daemon as operators meet it: --help, bad flags, a taken port, signals."""

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.local import LocalCoordinator
from coordinator.main import parser

COORDINATOR = str(Path(sys.executable).parent / "ifrt-coordinator")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([COORDINATOR, *args], capture_output=True, text=True, timeout=60)


def test_help_explains_every_flag():
    out = run("--help").stdout
    flags = [a.option_strings[-1] for a in parser()._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 15
    for action in parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
    for flag in flags:
        assert flag in out


def test_ifrt_cli_help_explains_every_flag():
    for sub in ("discover", "plugins", "env"):
        result = subprocess.run([str(Path(sys.executable).parent / "ifrt"), sub, "--help"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and "usage: ifrt " + sub in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    ((), "--num-processes"),
    (("--num-processes", "0"), "num_processes 0 is out of range"),
    (("--num-processes", "20000"), "expected 1 <= num_processes <= 16384"),
    (("--num-processes", "2", "--min-processes", "1"), "--min-processes applies only with --on-failure elastic"),
    (("--num-processes", "2", "--on-failure", "elastic", "--min-processes", "3"), "min_processes 3 is out of range"),
    (("--num-processes", "2", "--store", "redis://db:6379"), "expected memory or etcd://HOST:PORT"),
])
def test_bad_flags_exit_with_a_usage_error(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_int64_ids_lift_the_process_limit(start_coordinator):
    coordinator = start_coordinator("--int64-ids", num_processes=20000)
    assert "of 20000 processes" in coordinator.log


def test_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = run("--num-processes", "1", "--bind", f"127.0.0.1:{port}")
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_daemon_cleanly(sig):
    with LocalCoordinator(num_processes=2) as coordinator:
        assert coordinator.stop(sig) == 0
        assert f"received {sig.name}" in coordinator.log
        assert "waiting" in coordinator.log or "0/2 processes registered" in coordinator.log
        assert coordinator.log.rstrip().endswith("stopped")
