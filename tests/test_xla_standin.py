"""ifrt's stand-in for XLA's coordination service, exercised through JAX's own distributed client.

Real JAX CPU processes (one device each) start with ``ifrt.jax.initialize()`` against a real coordinator; every call
under test is JAX's (``jax._src.distributed.global_state.client``, ``multihost_utils``), answered by the stand-in in
the same process (tests/xla_standin_worker.py). Each test runs on both wire layouts: jax 0.10 (this interpreter) and
jax 0.4.30 (``IFRT_TEST_JAX04_PYTHON``). One job of three processes per jaxlib runs every phase once (the module's
``job`` fixture); each test checks one semantic of XLA's service that JAX relies on, in the answers of that job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import json_answers
from tests.requirements import jax_python, require
from tests.workers import start_jax_workers

if importlib.util.find_spec("jax") is None:
    require("jax", "pip install 'ifrt-topology[jax]' (scripts/test.sh installs it)")

from coordinator.local import LocalCoordinator

WORKER = Path(__file__).with_name("xla_standin_worker.py")
PROCESSES = 3
LAST = PROCESSES - 1
PREEMPTED = 1
"""The process that gets SIGTERM while every process steps towards the preemption sync point."""
LATE_S = 3.0
"""How late the last process arrives at barrier "late", after the others."""
JOB_TIMEOUT_S = 90.0
SYNC_POINT_WAIT_S = 8.0
"""How long after the SIGTERM every process must have returned True from reached_preemption_sync_point (XLA's own
service takes about a second)."""
MISSING_NAMED = r"did not arrive: {0} \(|task names:\s*(/job:\w+/replica:\d+/task:)?{0}\b"
"""How a barrier timeout names missing process {0}: ifrt's words (the stand-in passes them on), or XLA's own."""
JAXLIBS = [pytest.param("0.10", id="jax-0.10"), pytest.param("0.4.30", id="jax-0.4.30")]


# The job: one run of every phase, per jaxlib.
@dataclass
class JobRun:
    """What each process of one ``job`` printed, by phase and process id, and how the run went."""

    jaxlib: str
    phases: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    exits: list[int | None] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def phase(self, name: str) -> dict[int, dict[str, Any]]:
        """Each process's answer for phase ``name``; fails, with what the run did, unless every process gave one."""
        found = self.phases.get(name, {})
        if sorted(found) != list(range(PROCESSES)):
            pytest.fail(f"jax {self.jaxlib}: phase {name!r} reported by processes {sorted(found)} only, of "
                        f"{PROCESSES}; {self.describe()}", pytrace=False)
        return found

    def methods(self) -> list[str]:
        return self.phase("basics")[0]["methods"]

    def needs(self, method: str) -> None:
        """Fails where this jaxlib's client has no ``method``: the stand-in's answer could not be reached."""
        assert method in self.methods(), (f"jax {self.jaxlib}: JAX's DistributedRuntimeClient has no {method}() (its "
                                          f"methods: {', '.join(self.methods())})")

    def describe(self) -> str:
        tails = "\n".join(f"--- stderr of worker {i} (exit {code}):\n{err[-2500:]}"
                          for i, (code, err) in enumerate(zip(self.exits, self.stderr, strict=True)))
        return f"{'; '.join(self.notes)}\n{tails}"


def run_job(jaxlib: str) -> JobRun:
    """Three processes run the ``job`` scenario; once all step towards the preemption sync point, process PREEMPTED
    gets SIGTERM (by pid). A process that is still running SYNC_POINT_WAIT_S after it (or JOB_TIMEOUT_S after the
    start) is killed by pid, and what it printed before stays in the answer."""
    python = jax_python(jaxlib)
    run = JobRun(jaxlib)
    with LocalCoordinator(num_processes=PROCESSES, log_level="WARNING") as coordinator:
        workers = start_jax_workers(coordinator.address, PROCESSES, "job", devices=1, python=python, worker=WORKER,
                                    extra_env={rank: {"LATE_S": str(LATE_S)} for rank in range(PROCESSES)})
        lines: queue.Queue = queue.Queue()
        stderr = [""] * PROCESSES

        def read_out(index: int, worker: subprocess.Popen) -> None:
            for line in worker.stdout:  # type: ignore[union-attr]
                lines.put((index, line))
            lines.put((index, None))

        def read_err(index: int, worker: subprocess.Popen) -> None:
            stderr[index] = worker.stderr.read()  # type: ignore[union-attr]

        readers = [threading.Thread(target=target, args=(i, w), daemon=True)
                   for i, w in enumerate(workers) for target in (read_out, read_err)]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        looping: dict[int, subprocess.Popen] = {}
        open_outputs = PROCESSES
        try:
            while open_outputs and time.monotonic() < deadline:
                try:
                    index, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if line is None:
                    open_outputs -= 1
                    continue
                try:
                    answer = json.loads(line)
                except ValueError:
                    run.notes.append(f"worker {index} printed {line.strip()[:200]!r}")
                    continue
                run.phases.setdefault(answer["phase"], {})[answer["process_id"]] = answer
                if answer["phase"] == "preemption-loop":
                    looping[answer["process_id"]] = workers[index]
                    if len(looping) == PROCESSES:
                        time.sleep(0.2)  # a few steps into the loop
                        os.kill(looping[PREEMPTED].pid, signal.SIGTERM)
                        run.notes.append(f"SIGTERM sent to process {PREEMPTED} (pid {looping[PREEMPTED].pid})")
                        deadline = min(deadline, time.monotonic() + SYNC_POINT_WAIT_S)
        finally:
            for i, worker in enumerate(workers):
                if worker.poll() is None:
                    worker.kill()
                    run.notes.append(f"worker {i} (pid {worker.pid}) killed: still running at the deadline")
                worker.wait()
            for reader in readers:
                reader.join(timeout=10)
        run.exits = [w.returncode for w in workers]
        run.stderr = stderr
    return run


_RUNS: dict[str, JobRun] = {}


def run_once(jaxlib: str) -> JobRun:
    """``run_job(jaxlib)``, once per module: the fixtures below share it."""
    if jaxlib not in _RUNS:
        _RUNS[jaxlib] = run_job(jaxlib)
    return _RUNS[jaxlib]


@pytest.fixture(scope="module", params=JAXLIBS)
def job(request) -> Iterator[JobRun]:
    yield run_once(request.param)


@pytest.fixture(scope="module")
def newer_job() -> Iterator[JobRun]:
    """The job on jax 0.10 alone: for JAX client calls that 0.4.30's client does not have (try-get, increment, live
    nodes), whose answers only a newer client can reach."""
    yield run_once("0.10")


def error_of(result: dict[str, Any]) -> str:
    assert "error" in result, f"expected an error, the call returned {result}"
    return result["error"]


def value_of(result: dict[str, Any]) -> Any:
    assert "value" in result, f"expected a value, the call answered {result}"
    return result["value"]


# JAX's process 0 runs no service.
@pytest.mark.slow
def test_no_process_runs_jax_s_coordination_service(job):
    for pid, basics in job.phase("basics").items():
        assert basics["client_is_set"], pid
        assert basics["service_is_none"], f"process {pid} runs XLA's coordination service"
        assert (basics["jax_process_index"], basics["jax_process_count"]) == (pid, PROCESSES)


# Key-values.
@pytest.mark.slow
def test_a_key_one_process_sets_is_got_by_a_blocking_get_in_another(job):
    for pid, kv in job.phase("kv").items():
        if pid == 0:
            assert value_of(kv["set_shared"]) is None and value_of(kv["set_bytes"]) is None
        else:
            assert value_of(kv["blocking_get"]) == "hello from 0"
            assert value_of(kv["blocking_get_bytes"]) == "\x00\xff\x01"  # bytes, not text: every byte kept


@pytest.mark.slow
def test_a_second_insert_without_overwrite_is_refused_and_one_with_overwrite_replaces(job):
    kvs = job.phase("kv")
    for pid, kv in kvs.items():
        assert value_of(kv["set_own"]) is None
        assert "ALREADY_EXISTS" in error_of(kv["set_own_other_value"])
        assert value_of(kv["own_after_refusals"]) == "first"
        assert value_of(kv["overwrite_own"]) is None
        assert value_of(kv["own_after_overwrite"]) == "third"
        # every process sees every other's replaced value
        assert {p: value_of(r) for p, r in kv["everyones_own"].items()} == {str(p): "third" for p in kvs}, pid


@pytest.mark.slow
def test_a_second_insert_of_the_same_value_without_overwrite_is_refused_too(job):
    """XLA's service refuses any insert of a key that is set, whatever the value (InsertKeyValue: ALREADY_EXISTS
    unless allow_overwrite)."""
    for pid, kv in job.phase("kv").items():
        assert "error" in kv["set_own_same_value"], (
            f"process {pid}: a second key_value_set({f'own/{pid}'!r}, 'first') without allow_overwrite returned "
            f"{kv['set_own_same_value']}; XLA's service answers ALREADY_EXISTS")
        assert "ALREADY_EXISTS" in kv["set_own_same_value"]["error"]


@pytest.mark.slow
def test_a_blocking_get_of_a_key_nobody_sets_times_out(job):
    for kv in job.phase("kv").values():
        assert "DEADLINE_EXCEEDED" in error_of(kv["blocking_get_unset"])
        assert 1.0 < kv["blocking_get_unset"]["seconds"] < 10  # its own timeout (1.5 s), not at once, not forever


@pytest.mark.slow
def test_try_get_answers_a_set_key_and_not_found_for_an_unset_one(newer_job):
    job = newer_job
    job.needs("key_value_try_get")
    for kv in job.phase("kv").values():
        assert value_of(kv["try_get_own"]) == "third"
        assert "NOT_FOUND" in error_of(kv["try_get_unset"])
        assert kv["try_get_unset"]["seconds"] < 1  # at once: try_get never waits


@pytest.mark.slow
def test_dir_get_returns_every_key_under_the_directory_and_nothing_else(job):
    under = [["dir/sub/z", "3"], ["dir/x", "1"], ["dir/y", "2"]]  # not "dir" itself, "dirx" or "other/dir/w"
    for pid, kv in job.phase("kv").items():
        assert value_of(kv["dir_get"]) == under, pid
        assert value_of(kv["dir_get_slash"]) == under, pid
        assert value_of(kv["dir_get_bytes"]) == under, pid


@pytest.mark.slow
def test_delete_removes_the_key_and_every_key_under_it(job):
    for pid, kv in job.phase("kv").items():
        if pid == 0:
            assert value_of(kv["delete_dir"]) is None and value_of(kv["delete_own"]) is None
        after = kv["after_delete"]
        assert value_of(after["dir_get"]) == [], pid
        for gone in ("get dir", "get dir/sub/z", "get own/0"):
            assert "DEADLINE_EXCEEDED" in error_of(after[gone]), (pid, gone)
        if "key_value_try_get" in job.methods():
            assert "NOT_FOUND" in error_of(after["try_get dir"]) and "NOT_FOUND" in error_of(after["try_get dir/x"])
        assert value_of(after["get dirx"]) == "beside"  # a key beside the directory, not under it
        assert value_of(after["get other/dir/w"]) == "elsewhere"


@pytest.mark.slow
def test_increment_returns_the_running_sum_across_processes(newer_job):
    job = newer_job
    job.needs("key_value_increment")
    kvs = job.phase("kv")
    increments = {pid: pid + 1 for pid in kvs}
    sums = sorted(value_of(kv["increment"]) for kv in kvs.values())
    # each call returned the sum after its own increment: in the order they were applied, the sums step by the
    # increments, each increment once
    assert sorted(b - a for a, b in zip([0, *sums], sums, strict=False)) == sorted(increments.values()), sums
    for kv in kvs.values():
        assert value_of(kv["counter_total"]) == sum(increments.values())


# Keys are the start's own.
@pytest.mark.slow
@pytest.mark.parametrize("jaxlib", [p.values[0] for p in JAXLIBS], ids=[p.id for p in JAXLIBS])
def test_a_key_set_in_one_start_of_the_job_is_not_seen_by_the_next(start_coordinator, jaxlib):
    """The job runs twice against one coordinator: the second start's JAX finds none of the first start's keys
    (a blocking get times out, try_get is NOT_FOUND, the directory is empty) and sets them anew without overwrite.

    Here every process of the first start left before the second registered, so the second start is also the job's
    next run, whose store the coordinator starts empty; the stand-in's own scope (generation and start nonce) is
    what keeps two starts within one run apart."""
    python = jax_python(jaxlib)
    coordinator = start_coordinator(num_processes=2, log_level="WARNING")

    def start(scenario: str) -> list[dict[str, Any]]:
        workers = start_jax_workers(coordinator.address, 2, scenario, devices=1, python=python, worker=WORKER)
        return sorted(json_answers(workers, JOB_TIMEOUT_S), key=lambda a: a["process_id"])

    def keys(answer: dict[str, Any]) -> list[str]:  # process 0 set "scoped/shared", each its own key
        return ["scoped/shared", f"scoped/{answer['process_id']}"]

    first = start("scope-set")
    for a in first:
        assert {k: value_of(r) for k, r in a["seen"].items()} == dict.fromkeys(keys(a), "first start")
    second = start("scope-get")  # the same job again, against the same coordinator
    for a in second:
        assert sorted(a["blocking_get"]) == sorted(keys(a))
        for key, result in a["blocking_get"].items():
            assert "DEADLINE_EXCEEDED" in error_of(result), key
        if "key_value_try_get" in a["methods"]:
            assert all("NOT_FOUND" in error_of(r) for r in a["try_get"].values()), a["try_get"]
        assert value_of(a["dir_get"]) == []
        assert all(value_of(r) is None for r in a["set"].values()), a["set"]  # set anew, without overwrite
        assert {k: value_of(r) for k, r in a["seen"].items()} == dict.fromkeys(keys(a), "second start")


# Barriers.
@pytest.mark.slow
def test_every_process_passes_a_barrier_and_a_barrier_of_some_processes(job):
    for pid, barrier in job.phase("barrier").items():
        assert value_of(barrier["together"][0]) is None, pid
        if pid in (0, 1):
            assert value_of(barrier["pair"]) is None, pid
        assert value_of(barrier["after_missing"]) is None, pid  # a barrier that failed before harms no other


@pytest.mark.slow
def test_a_barrier_one_process_misses_times_out_naming_it(job):
    for pid, barrier in job.phase("barrier").items():
        if pid == LAST:
            assert "missing" not in barrier
            continue
        message = error_of(barrier["missing"])
        assert "DEADLINE_EXCEEDED" in message
        assert "missing" in message  # the barrier's id
        assert re.search(MISSING_NAMED.format(LAST), message), message  # who is missing
        assert 1.0 < barrier["missing"]["seconds"] < 10


@pytest.mark.slow
def test_the_same_barrier_id_passes_again(job):
    for pid, barrier in job.phase("barrier").items():
        again = barrier["together"][1:]
        refused = [r.get("error", "") for r in again]
        if job.jaxlib == "0.4.30":  # no barrier counters before jaxlib 0.4.31: its client refuses a used id itself
            assert all("should not be called with the same id more than once" in e for e in refused), (pid, refused)
            continue
        assert [value_of(r) for r in again] == [None, None], pid


@pytest.mark.slow
def test_a_barrier_waits_for_a_process_that_arrives_late_within_the_timeout(job):
    """The last process arrives LATE_S after the others, well within everyone's timeout: XLA's barrier passes (ifrt's
    barrier fixes its deadline at the first arrival, so the stand-in asks it once, for the whole wait). JAX's own
    barriers (registration, shutdown) depend on it."""
    for pid, late in job.phase("late").items():
        assert "error" not in late, (
            f"process {pid} (late by {late['late_by_s']:.0f} s) failed at barrier 'late' after "
            f"{late['seconds']:.1f} s: {late['error'].splitlines()[0]}")


# Live tasks.
@pytest.mark.slow
def test_every_process_sees_every_live_task(newer_job):
    job = newer_job
    job.needs("get_live_nodes")
    live = {pid: value_of(answer["live"]) for pid, answer in job.phase("live").items()}
    for pid, nodes in live.items():
        assert sorted(nodes) == [str(p) for p in range(PROCESSES)], pid
    assert all(nodes == live[0] for nodes in live.values()), live  # agreed: the same incarnations everywhere


# The preemption sync point.
@pytest.mark.slow
def test_every_process_reaches_the_preemption_sync_point_at_the_same_step(job):
    """Every process calls reached_preemption_sync_point(step) about every millisecond; one gets SIGTERM (XLA's
    preemption notifier catches it: ifrt installs no handler unless IFRT_PREEMPTION_SIGNALS says so). Each returns
    True at one and the same step."""
    assert sorted(job.phase("preemption-loop")) == list(range(PROCESSES))
    reached = job.phases.get("preemption", {})
    assert sorted(reached) == list(range(PROCESSES)), (
        f"jax {job.jaxlib}: only processes {sorted(reached)} returned True from reached_preemption_sync_point within "
        f"{SYNC_POINT_WAIT_S:.0f} s of the SIGTERM to process {PREEMPTED}; {job.describe()}")
    steps = {pid: answer["sync_step"] for pid, answer in reached.items()}
    assert None not in steps.values(), steps
    assert len(set(steps.values())) == 1, steps
