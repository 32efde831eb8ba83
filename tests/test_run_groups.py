"""``ifrt run`` stops a worker's whole process group (a ``bash -c`` wrapper's children too), and an agent whose loop
fails still stops its workers: real processes, a real coordinator."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import pytest

from ifrt.run import agent as core
from ifrt.run.job import JobLink
from ifrt.run.shell import Shell
from ifrt.run.workers import Worker, stop_all
from tests.helpers import poll_until
from tests.run_agents import loopback_env

WRAPPER = "sleep 300 & echo $! > {file}; wait"
"""A worker that is a shell: its child (the sleep) writes its pid, and outlives the shell unless its group is ended."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, already ended, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def child_pid(file: Path) -> int:
    return int(poll_until(lambda: file.read_text().strip() if file.exists() else "", what=f"a pid in {file}"))


def test_stopping_a_worker_ends_the_children_it_started(tmp_path):
    file = tmp_path / "child"
    worker = Worker(["bash", "-c", WRAPPER.format(file=file)], os.environ, attempt=0, local_rank=0, label=None)
    child = child_pid(file)
    assert alive(child)
    stop_all([worker], grace_s=5)
    poll_until(lambda: not alive(child), timeout=5, what=f"the worker's child {child} ended")


def test_an_agent_ended_by_sigterm_leaves_no_child_of_its_workers(start_coordinator, agents, tmp_path):
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    file = tmp_path / "child"
    agent = agents("--grace-seconds", "2", "--", "bash", "-c", WRAPPER.format(file=file),
                   env=loopback_env(coordinator.address))
    child = child_pid(file)
    agent.process.send_signal(signal.SIGTERM)
    agent.wait()
    poll_until(lambda: not alive(child), timeout=5, what=f"the worker's child {child} ended with its agent")


def test_an_exception_in_the_agents_loop_stops_its_workers(start_coordinator, tmp_path, monkeypatch):
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")
    for name, value in loopback_env(coordinator.address).items():
        monkeypatch.setenv(name, value)
    file = tmp_path / "child"
    args = argparse.Namespace(nproc_per_host=1, max_restarts=None, grace_seconds=2.0, no_prefix=True, recover="restart",
                              coordinator=None, token_file=None, host_rank=None, num_hosts=None, spare=0)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with JobLink(None, 10.0, workers=1) as link:
            shell = Shell(args, ["bash", "-c", WRAPPER.format(file=file)], link)

            def break_the_loop() -> None:
                child_pid(file)
                shell.events.put(core.IdsKnown(None))  # type: ignore[arg-type]  # the agent's handling raises
            threading.Thread(target=break_the_loop, daemon=True).start()
            with pytest.raises(TypeError):
                shell.run()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert [w.process.poll() for w in shell.workers.values()] != [None]
    child = child_pid(file)
    poll_until(lambda: not alive(child), timeout=5, what=f"the worker's child {child} ended with the agent's loop")
