"""Fail fast: after ifrt.jax.initialize() / ifrt.torch.init_process_group(), a peer killed or hung mid-loop ends
every other process within the coordinator's heartbeat timeout + 1 s, with one line naming it and exit code 75;
a normal end ends nobody early. Real JAX and torch processes (CPU, gloo) against a real coordinator."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.requirements import require

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("torch") is None:
    require("jax and torch", "pip install 'ifrt-topology[jax,torch]' (scripts/test.sh installs them)")

from ifrt import events, failfast, wire
from ifrt.errors import EXIT_COORDINATOR_LOST, EXIT_PEER_FAILED, InvalidArgument, PeerFailed
from ifrt.records import Device, Process, TopologyContent
from ifrt.settings import FAILOVER_WINDOW_ENV
from ifrt.topology import Topology
from tests.workers import start_jax_workers

WORKER = Path(__file__).with_name("failfast_worker.py")
HEARTBEAT_TIMEOUT_S = 1.0
VICTIM = 2
"""The process killed or stopped (not process 0, whose JAX hosts JAX's own coordination service)."""
START_TIMEOUT = 120


class Job:
    """Four worker processes of one runtime and scenario, their output read as it comes."""

    def __init__(self, start_coordinator, runtime: str, scenario: str, env: dict[str, str] | None = None,
                 tmp: Path | None = None) -> None:
        """``tmp``: each worker's TMPDIR is ``tmp/<rank>`` (else the system's)."""
        self.coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), num_processes=4,
                                             log_level="WARNING")
        env = {"IFRT_CPU_DEVICE_COUNT": "1", **(env or {})}
        own: dict[int, dict[str, str]] = {r: {} for r in range(4)}
        if tmp is not None:
            for r in own:
                (tmp / str(r)).mkdir()
                own[r] = {"TMPDIR": str(tmp / str(r))}
        self.workers = start_jax_workers(self.coordinator.address, 4, f"{runtime} {scenario}", devices=1,
                                         extra_env={r: {**env, **own[r]} for r in range(4)}, worker=WORKER)
        self.out = [[] for _ in self.workers]
        self.err = [[] for _ in self.workers]
        self.ended = [0.0] * 4
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(4)]
        for reader in self._readers:
            reader.start()

    def _read(self, i: int) -> None:
        worker = self.workers[i]
        drain = threading.Thread(target=lambda: self.err[i].extend(worker.stderr), daemon=True)
        drain.start()
        self.out[i].extend(worker.stdout)
        drain.join()
        worker.wait()
        self.ended[i] = time.monotonic()

    def wait_steps(self, steps: int = 3) -> None:
        """Waits until every worker ran ``steps`` collective steps (the job is mid-loop)."""
        deadline = time.monotonic() + START_TIMEOUT
        while not all(f"step {steps}\n" in lines for lines in self.out):
            for i, worker in enumerate(self.workers):
                if worker.poll() is not None:
                    self.stop()
                    pytest.fail(f"worker {i} exited {worker.returncode} before step {steps}:\n{self.stderr(i)}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the job did not reach step {steps} within {START_TIMEOUT}s:\n{self.stderr(0)}")
            time.sleep(0.05)

    def wait_ended(self, which: list[int], timeout: float = 60.0) -> None:
        for i in which:
            self._readers[i].join(timeout)
            if self._readers[i].is_alive():
                self.stop()
                pytest.fail(f"worker {i} still running {timeout}s later:\n{self.stderr(i)}")

    def stderr(self, i: int) -> str:
        return "".join(self.err[i])[-3000:]

    def stop(self) -> None:
        """Kills every worker still running (a stopped one too), by its pid."""
        for worker in self.workers:
            if worker.poll() is None:
                os.kill(worker.pid, signal.SIGKILL)
        for reader in self._readers:
            reader.join(30)


def failure_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ifrt: ") and "job failed" in line]


def check_survivors_end(job: Job, signalled_at: float, how: str) -> list[float]:
    """Asserts processes other than VICTIM end with EXIT_PEER_FAILED and one line naming it; returns how long each
    took after ``signalled_at``."""
    survivors = [i for i in range(4) if i != VICTIM]
    job.wait_ended(survivors)
    took = []
    for i in survivors:
        worker = job.workers[i]
        assert worker.returncode == EXIT_PEER_FAILED, (f"worker {i} exited {worker.returncode} after the {how} of "
                                                       f"process {VICTIM}:\n{job.stderr(i)}")
        lines = failure_lines("".join(job.err[i]))
        assert len(lines) == 1, job.stderr(i)
        assert f"process {VICTIM} (" in lines[0] and "failed" in lines[0], lines[0]
        assert "topology generation 1" in lines[0] and "127.0.0.1" in lines[0], lines[0]
        assert "SIGABRT" not in job.stderr(i) and "Terminating process" not in job.stderr(i)
        took.append(job.ended[i] - signalled_at)
    return took


def survivors_end_after(start_coordinator, runtime: str, sig: signal.Signals, tmp: Path | None = None) -> list[float]:
    """Sends ``sig`` to VICTIM of a job mid-loop and checks the others end (``check_survivors_end``); returns how
    long each took. ``tmp``: as Job's."""
    job = Job(start_coordinator, runtime, "loop", tmp=tmp)
    try:
        job.wait_steps()
        signalled_at = time.monotonic()
        os.kill(job.workers[VICTIM].pid, sig)
        took = check_survivors_end(job, signalled_at, sig.name)
    finally:
        job.stop()
    print(f"{runtime}: {sig.name} to survivors' exit: {', '.join(f'{t:.2f}s' for t in took)}")
    return took


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["jax", "torch"])
def test_a_process_killed_mid_loop_ends_the_others_within_the_heartbeat_timeout(start_coordinator, runtime,
                                                                               short_tmp_path):
    tmp_path = short_tmp_path  # each worker's TMPDIR, where its stand-in's socket lives
    took = survivors_end_after(start_coordinator, runtime, signal.SIGKILL, tmp_path)
    assert max(took) < HEARTBEAT_TIMEOUT_S + 1.0 + 1.0  # + 1 s of slack for a machine shared by other tests
    if runtime == "jax":  # JAX's coordination is served on a socket in a directory of each process's own
        left = {r: [p.name for p in (tmp_path / str(r)).glob("ifrt-xla-*")] for r in range(4)}
        assert len(left.pop(VICTIM)) == 1, left  # the SIGKILLed process could not remove its own
        assert left == {r: [] for r in left}, "fail fast's exit left the stand-in's socket directory behind"


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["jax", "torch"])
def test_a_process_stopped_mid_loop_ends_the_others_within_the_heartbeat_timeout(start_coordinator, runtime):
    took = survivors_end_after(start_coordinator, runtime, signal.SIGSTOP)
    assert max(took) < HEARTBEAT_TIMEOUT_S + 1.0 + 1.0


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["jax", "torch"])
def test_a_normal_end_of_the_job_ends_nobody_early(start_coordinator, runtime):
    job = Job(start_coordinator, runtime, "finish")
    job.wait_ended(list(range(4)), timeout=START_TIMEOUT)
    for i, worker in enumerate(job.workers):
        assert worker.returncode == 0, f"worker {i} exited {worker.returncode}:\n{job.stderr(i)}"
        assert not failure_lines("".join(job.err[i])), job.stderr(i)
        assert json.loads(job.out[i][-1])["finished"] == failure_worker_steps()


def failure_worker_steps() -> int:
    from tests import failfast_worker

    return failfast_worker.STEPS


@pytest.mark.slow
def test_a_bug_in_one_process_exits_it_with_1_and_ends_the_others_naming_it(start_coordinator):
    job = Job(start_coordinator, "torch", "bug")
    try:
        job.wait_ended(list(range(4)))
    finally:
        job.stop()
    assert job.workers[VICTIM].returncode == 1, job.stderr(VICTIM)
    assert "AssertionError: a bug in process 2" in job.stderr(VICTIM)
    assert not failure_lines("".join(job.err[VICTIM])), job.stderr(VICTIM)
    check_survivors_end(job, 0.0, "bug")


@pytest.mark.slow
def test_a_coordinator_lost_beyond_the_failover_window_ends_every_process(start_coordinator):
    job = Job(start_coordinator, "torch", "loop", env={FAILOVER_WINDOW_ENV: "1"})
    try:
        job.wait_steps()
        job.coordinator.stop(signal.SIGKILL)
        job.wait_ended(list(range(4)))
    finally:
        job.stop()
    for i, worker in enumerate(job.workers):
        assert worker.returncode == EXIT_COORDINATOR_LOST, f"worker {i} exited {worker.returncode}:\n{job.stderr(i)}"
        lines = failure_lines("".join(job.err[i]))
        assert len(lines) == 1 and "stayed out of reach for 1 s" in lines[0], job.stderr(i)
        assert job.coordinator.address in lines[0]


@pytest.mark.slow
def test_on_failure_raise_delivers_the_typed_error_to_the_main_thread(start_coordinator):
    job = Job(start_coordinator, "torch", "raise")
    try:
        job.wait_steps()
        os.kill(job.workers[VICTIM].pid, signal.SIGKILL)
        job.wait_ended([i for i in range(4) if i != VICTIM])
    finally:
        job.stop()
    for i in (i for i in range(4) if i != VICTIM):
        caught = json.loads(job.out[i][-1])
        assert caught == {"caught": "PeerFailed", "process_id": VICTIM, "exit_code": EXIT_PEER_FAILED, "me": i}
        assert job.workers[i].returncode == EXIT_PEER_FAILED, job.stderr(i)


# The decisions, without processes.
def four_processes() -> Topology:
    processes = tuple(Process(p, f"host-{p}", f"10.0.0.{p}:9000") for p in range(4))
    devices = tuple(Device(p << 17, p, 0, "cpu", "cpu") for p in range(4))
    return Topology(wire.encode(TopologyContent("", 1, 4, processes, devices)), 0)


def test_a_failed_or_restarted_peer_is_a_failure_that_names_it_and_a_peer_that_left_is_not():
    topology = four_processes()
    failed = failfast.failure_for(events.ProcessFailed(2, "heartbeat timeout"), topology)
    assert isinstance(failed, PeerFailed) and failed.exit_code == EXIT_PEER_FAILED
    assert (failed.process_id, failed.hostname, failed.generation) == (2, "host-2 10.0.0.2:9000", 1)
    assert "process 2 (host-2 10.0.0.2:9000) failed: heartbeat timeout (topology generation 1)" in str(failed)
    restarted = failfast.failure_for(events.ProcessRestarted(3, 1), topology)
    assert isinstance(restarted, PeerFailed) and restarted.process_id == 3
    assert "this process was declared failed" in str(failfast.failure_for(events.ProcessFailed(0, "x"), topology))
    assert failfast.failure_for(events.ProcessLeft(1), topology) is None
    assert failfast.failure_for(events.CoordinatorRestored("c"), topology) is None


def test_an_unknown_on_failure_is_refused_naming_what_is_accepted():
    with pytest.raises(InvalidArgument, match=r"on_failure='abort': expected 'exit', 'raise', 'recover' or a callable"):
        failfast.check("abort")  # type: ignore[arg-type]
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_refused(lambda: failfast.check("raise"))))
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]
    with pytest.raises(InvalidArgument, match=r"IFRT_FAILOVER_WINDOW='soon': expected a positive number of seconds"):
        failfast.failover_window_from_env({FAILOVER_WINDOW_ENV: "soon"})
    assert failfast.failover_window_from_env({}) == failfast.FAILOVER_WINDOW_S


def _refused(call) -> str:
    try:
        call()
    except InvalidArgument as e:
        return str(e)
    return ""
