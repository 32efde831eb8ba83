"""What the stand-in answers, whatever the wire layout: XLA's coordination semantics on ifrt's client.

Every key JAX uses lives under the start's own prefix (``scope``: topology generation and the nonce of the start
that ``ifrt.startup`` agreed), so a restarted job never meets the keys of the last one; barriers are ifrt barriers
under the same prefix, named with XLA's barrier counter, so that a late caller is answered the result the others
got. A peer's failure, as ifrt decides it, ends every wait at once with ifrt's words.

In JAX's recoverable mode (``recoverable``: ``jax_enable_recoverability``, ifrt's ``on_failure="recover"``) a peer's
failure is no failure of this process: its task is in error until its replacement registers, barriers over it fail,
``PollForError`` does not report it, and ``GetAliveTasks`` answers the coordinator's agreement on who is alive, with
each process's ifrt incarnation. A replacement writes again the keys its previous incarnation wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ifrt import events, failfast
from ifrt.errors import (
    BarrierCancelled,
    BarrierFailed,
    BarrierTimeout,
    IfrtError,
    JobFailed,
    KeyExists,
    KeyValueTimeout,
)
from ifrt.jax.xla_standin import topology_check

if TYPE_CHECKING:
    from ifrt.client import Client
    from ifrt.topology import Topology

log = logging.getLogger("ifrt.jax.xla_standin")

WAIT_SLICE_S = 5.0
"""A blocking get is asked of ifrt in waits this long at most, so that a failure ifrt decided meanwhile ends it
(with ``on_failure="exit"`` fail-fast has ended the process before)."""
TOPOLOGY_SLICE_S = 1.0
"""The same for a wait on JAX's topology records, which also ends when any process refused one: every process then
fails its start with the same words within a second."""
NO_DEADLINE_S = 365 * 86400.0
"""The wait of a call JAX made without a deadline (its preemption-notice watch): a get, a watch or an error poll, each
of which ends when its call does (the caller cancels it)."""
BARRIER_BOUND_S = 3600.0
"""The longest a barrier (a registration, a shutdown) waits without a deadline of its own: XLA's default registration
timeout, the longest of its waits' defaults (XLA's own service bounds every barrier by its timeout). Such a wait is
one coordinator call that the caller's cancel cannot end, so it has a bound."""
BACKSTOP_S = failfast.RAISE_GRACE_S + 1.0
"""How long ``PollForError`` holds a failure back from JAX, whose client terminates its process on the answer:
fail-fast ends the process first in every ``on_failure`` mode (at once with ``"exit"``, after the program's grace
to save its state with ``"raise"`` or a callable); JAX hears the same words only if the process outlived that."""

GLOO_PREFIX = "cpu:gloo/"
"""JAX's CPU collectives' rendezvous keys (jaxlib 0.10: gloo's, one per ordered device list and rank)."""
LIVE_SET_WAIT_S = 120.0
"""How long ``GetAliveTasks`` without a deadline waits for every live process to ask (a replacement asks once its JAX
has started); then DEADLINE_EXCEEDED names who did not."""

# XLA's status codes (absl), as gRPC numbers them.
CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, ALREADY_EXISTS = 1, 3, 4, 5, 6
FAILED_PRECONDITION, ABORTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 9, 10, 12, 13, 14

T = TypeVar("T")


class CoordinationError(Exception):
    """An error answer to JAX: a gRPC status code, a message, and where it is about a task (a failed peer), that
    task, for XLA's ``CoordinationServiceError`` payload."""

    def __init__(self, code: int, message: str, *, task: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.task = code, message, task


@dataclass(frozen=True)
class TaskStatus:
    """A task (process) as XLA's task-state messages describe it."""

    task: int
    state: str  # "CONNECTED", "ERROR" or "DISCONNECTED"
    incarnation: int = 0
    error_code: int = 0
    error_message: str = ""


class CoordinationStandIn:
    """XLA's coordination service for one process's JAX client, answered from ``client`` (see the module docstring).

    ``scope`` is the key prefix of this start (``ifrt/jax/g<generation>/<nonce>``); the service incarnation JAX
    checks on every call is derived from it, so it is the same in every process and stable for the start.
    ``recoverable``: JAX's recoverable mode (see the module docstring)."""

    def __init__(self, client: Client, topology: Topology, scope: str, *, recoverable: bool = False) -> None:
        self.client, self.topology, self.scope, self.recoverable = client, topology, scope, recoverable
        self.task = topology.process_id
        self.tasks = [p.process_id for p in topology.processes]
        self.incarnation = int.from_bytes(hashlib.sha256(scope.encode()).digest()[:8], "big") or 1
        """The service incarnation: one per start, the same in every process."""
        self.refusal: str | None = None
        """Why JAX's topology exchange was refused, in this process or another, once it was."""
        self.failure: JobFailed | None = None
        self._failed = threading.Event()
        self._changed = threading.Condition()
        self._version = 0
        self._states: dict[int, TaskStatus] = {}
        self._registered: int | None = None  # the incarnation this process's JAX client registered with
        self._register_lock = threading.Lock()
        self._inserted: set[str] = set()  # keys this process's JAX client inserted (a second insert is refused)
        self._writer = uuid.uuid4().hex  # this stand-in, as the writer of a key: its process's incarnation
        self._peer_failures: list[str] = []  # in recoverable mode: each peer's failure, in the words of its event
        self.agreed: list[tuple[int, int]] = []
        """The live set this process's JAX was last told (``alive_tasks``): (process id, incarnation) pairs."""
        self.era = ""
        """A digest of the live set this process's JAX was last told (``alive_tasks``), the same in every process that
        was told it; "" before the first."""
        self._serving = threading.local()  # the call being answered in this thread: ``ended`` once it ended
        client.on_event(self._on_event, since_topology=True)

    # Calls.
    @contextlib.contextmanager
    def serving(self, ended: threading.Event) -> Iterator[None]:
        """Answers one call in this thread; ``ended`` is set once the call ended (its caller cancelled it, or its
        deadline passed), and every wait of the call then ends (``wake`` wakes those that sleep)."""
        self._serving.ended = ended
        try:
            yield
        finally:
            self._serving.ended = None

    def wake(self) -> None:
        """Wakes every wait that sleeps, to see whether its call ended."""
        with self._changed:
            self._changed.notify_all()

    def _ended(self) -> bool:
        ended = getattr(self._serving, "ended", None)
        return ended is not None and ended.is_set()

    def _raise_ended(self, what: str) -> None:
        if self._ended():
            raise CoordinationError(CANCELLED, f"{what}: the call ended (cancelled by its caller, or past its "
                                    "deadline)")

    # Tasks.
    def register(self, task: int, incarnation: int, timeout: float | None) -> int:
        """Registers this process's JAX client; returns once every process of the topology has registered (XLA's
        registration barrier; jaxlib 0.4.30 adds its own connect barrier after it)."""
        self.check_task(task, "RegisterTask")
        with self._register_lock:
            if self._registered is None:
                self._registered = incarnation
            elif incarnation != self._registered:
                raise CoordinationError(ALREADY_EXISTS, (
                    f"RegisterTask of task {task} with incarnation {incarnation:#x}: task {task} is registered with "
                    f"incarnation {self._registered:#x} here already. This stand-in serves one JAX client for its "
                    "process's life; a restarted process registers with its own new stand-in"))
        self._barrier("register", None, timeout, "registration (every process's JAX client connects)")
        return self.incarnation

    def heartbeat(self, task: int) -> int:
        """A heartbeat of this process's JAX client: its liveness is ifrt's to judge, so only checked and answered."""
        self.check_task(task, "Heartbeat")
        return self.incarnation

    def poll_for_error(self, task: int) -> None:
        """Waits for the job's first failure as ifrt decides it; then, once fail-fast has had its time, raises it."""
        self.check_task(task, "PollForError")
        with self._changed:
            while not self._failed.is_set() and not self._ended():
                self._changed.wait(WAIT_SLICE_S)
        self._raise_ended("PollForError")
        time.sleep(BACKSTOP_S)
        raise self._failure_error()

    def shutdown(self, task: int, timeout: float | None) -> None:
        """JAX's shutdown barrier: returns once every process shut down too; fails at once when one failed, else at
        the timeout. In recoverable mode a process ends alone: the others may have died, and a failed barrier would
        make JAX's client abort its process."""
        self.check_task(task, "ShutdownTask")
        if not self.recoverable:
            self._barrier("shutdown", None, timeout, "shutdown")

    def check_task(self, task: int, method: str) -> None:
        """INVALID_ARGUMENT unless ``task`` is this process: the stand-in serves this process's JAX client only."""
        if task != self.task:
            raise CoordinationError(INVALID_ARGUMENT, f"{method} from task {task}: this coordination service (ifrt's "
                                    f"stand-in) serves process {self.task} only")

    def task_states(self, tasks: Sequence[int] = ()) -> list[TaskStatus]:
        """The state of each task (all of them for none): connected, failed (with ifrt's reason) or left."""
        with self._changed:
            states = dict(self._states)
        return [states.get(t, TaskStatus(t, "CONNECTED")) for t in (tasks or self.tasks)]

    def watch(self, version: int, timeout: float | None) -> tuple[int, list[TaskStatus]]:
        """The task states once their version differs from ``version`` (at once for another version), or at the
        timeout: XLA's long poll on the job's state."""
        deadline = time.monotonic() + (NO_DEADLINE_S if timeout is None else timeout)
        with self._changed:
            while self._version == version and time.monotonic() < deadline and not self._ended():
                self._changed.wait(min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic())))
            current = self._version
        self._raise_ended("the watch of the tasks' states")
        return current, self.task_states()

    def alive_tasks(self, task: int, tasks: Sequence[int], timeout: float | None) -> list[tuple[int, int]]:
        """Of ``tasks`` (every process), those alive with their incarnations, as ifrt's coordinator decided them once
        for every caller: returns once every live process asked (a barrier of the live processes, as XLA's service
        answers it). A process that fails meanwhile is left out as soon as the coordinator declares it failed; one
        replaced has a new incarnation. INVALID_ARGUMENT for a part of the job: the agreement is the whole job's."""
        self.check_task(task, "GetAliveTasks")
        asked = sorted(set(tasks or self.tasks))
        if asked != sorted(self.tasks):
            raise CoordinationError(INVALID_ARGUMENT, (
                f"GetAliveTasks over processes {asked}: ifrt's coordinator agrees on the live processes of the whole "
                f"job ({len(self.tasks)} processes), and a process outside those asked would never answer; ask with "
                "every process's devices (live_devices(jax.devices()))"))
        live = self._call(lambda t: self.client.live_processes(timeout=t), LIVE_SET_WAIT_S if timeout is None
                          else timeout)
        self.agreed = sorted(live.items())
        self.era = hashlib.sha256(repr(self.agreed).encode()).hexdigest()[:16]
        return self.agreed

    def report_error(self, task: int, code: int, message: str) -> None:
        """A task's own report of an error: logged; its process ends, and ifrt's coordinator then decides."""
        log.warning("JAX in process %d reported an error to its coordination service (code %d): %s", task, code,
                    message)

    # Key-values.
    def insert(self, key: str, value: bytes, allow_overwrite: bool, timeout: float | None) -> None:
        """Stores ``value`` under ``key``; ALREADY_EXISTS for a key set before, unless ``allow_overwrite``. JAX's
        local topology is checked against ifrt's first (INVALID_ARGUMENT naming both)."""
        problem = topology_check.problem(key, value, self.topology)
        if problem is not None:
            self._refuse_topology(problem)
        # XLA refuses a second insert without overwrite whatever its value, where ifrt's set takes an equal value as
        # a repeat: each key names its first writer, and only that writer's first insert may go without overwrite.
        # A replacement writes again what its previous incarnation wrote (gloo's address of its rank, its topology).
        mine = f"{self.task}:{self._writer}".encode()
        writer = self._call(lambda t: self.client.kv_compare_set(self._kv(key, "writers"), b"", mine, timeout=t),
                            timeout)
        if not allow_overwrite:
            previous = (writer or b"").split(b":")[0]
            if key in self._inserted or (writer != mine and previous != str(self.task).encode()):
                raise CoordinationError(ALREADY_EXISTS, f"key {key!r} is set already (InsertKeyValue without "
                                        "allow_overwrite)")
            if writer != mine:  # this process's previous incarnation wrote it
                self._call(lambda t: self.client.kv_set(self._kv(key, "writers"), mine, allow_overwrite=True,
                                                        timeout=t), timeout)
                allow_overwrite = True
        self._raise_failure()
        try:
            self.client.kv_set(self._kv(key), value, allow_overwrite=allow_overwrite,
                               timeout=60.0 if timeout is None else max(0.001, timeout))
        except KeyExists:
            raise CoordinationError(ALREADY_EXISTS, f"key {key!r} is set already (InsertKeyValue without "
                                    "allow_overwrite)") from None
        except IfrtError as e:
            raise _translated(e) from None
        self._inserted.add(key)

    def get(self, key: str, timeout: float | None) -> bytes:
        """The value of ``key``, waiting for some process to set it (DEADLINE_EXCEEDED at the timeout); the wait is
        asked of ifrt in slices, and ends after the slice in which its call ended (CANCELLED). In recoverable mode a
        collective's rendezvous (a gloo key) ends with UNAVAILABLE once a peer failed while it waited: the key may
        be the dead process's to write, and the block it belongs to fails in every process anyway."""
        deadline = time.monotonic() + (NO_DEADLINE_S if timeout is None else timeout)
        topology_record = topology_check.is_record(key)
        rendezvous = self.recoverable and key.startswith(GLOO_PREFIX)
        failures = len(self._peer_failures)
        while True:
            self._raise_ended(f"the get of key {key!r}")
            self._raise_failure()
            if topology_record:
                self._raise_refusal()
            if rendezvous and len(self._peer_failures) > failures:
                raise CoordinationError(UNAVAILABLE, f"key {key!r} (a collective's rendezvous) will not be set: "
                                        f"{self._peer_failures[failures]} while it was awaited")
            remaining = deadline - time.monotonic()
            try:
                value = self.client.kv_get(self._kv(key), timeout=max(0.0, min(
                    TOPOLOGY_SLICE_S if topology_record or rendezvous else WAIT_SLICE_S, remaining)))
            except KeyValueTimeout:
                if time.monotonic() >= deadline:
                    raise CoordinationError(DEADLINE_EXCEEDED, f"key {key!r} was not set within {timeout:.1f} s"
                                            ) from None
                continue
            except IfrtError as e:
                raise _translated(e) from None
            problem = topology_check.problem(key, value, self.topology)
            if problem is not None:
                self._refuse_topology(problem)
            return value

    def try_get(self, key: str) -> bytes | None:
        """The value of ``key`` now, or None."""
        return self._call(lambda t: self.client.kv_try_get(self._kv(key), timeout=t), None)

    def increment(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the decimal integer under ``key`` (unset: 0); returns the sum."""
        return self._call(lambda t: self.client.kv_increment(self._kv(key), amount, timeout=t), None)

    def get_dir(self, directory: str) -> list[tuple[str, bytes]]:
        """Every key under ``directory/`` and its value, sorted by key."""
        prefix = self._kv(f"{directory.rstrip('/')}/")
        found = self._call(lambda t: self.client.kv_dir(prefix, timeout=t), None)
        strip = len(prefix) - len(directory.rstrip("/")) - 1
        return [(k[strip:], v) for k, v in sorted(found.items())]

    def delete(self, key: str, is_directory: bool) -> None:
        """Deletes ``key`` and every key under ``key/`` (XLA deletes both, whichever it was asked)."""
        del is_directory  # older layouts ask; XLA's service deletes the key and its directory either way
        self._inserted -= {k for k in self._inserted if k == key or k.startswith(f"{key.rstrip('/')}/")}
        for space in ("kv", "writers"):
            self._call(lambda t, space=space: self.client.kv_delete(self._kv(key, space), timeout=t), None)
            self._call(lambda t, space=space: self.client.kv_delete(self._kv(f"{key.rstrip('/')}/", space),
                                                                    prefix=True, timeout=t), None)

    # Barriers.
    def barrier(self, task: int, barrier_id: str, counter: int, tasks: Sequence[int], timeout: float | None) -> int:
        """Waits until every task of ``tasks`` (all of them for none) reached ``barrier_id`` (its ``counter``-th use);
        returns the counter. A late caller gets the result the others got."""
        self.check_task(task, "Barrier")
        self._barrier(f"barrier/{barrier_id}/{counter}", tasks or None, timeout, f"barrier {barrier_id!r}")
        return counter

    def cancel_barrier(self, task: int, barrier_id: str, counter: int) -> None:
        """Cancels ``barrier_id`` (its ``counter``-th use) for every waiter, before or after they arrive (the
        coordinator takes a cancel only from a participant). Logged as a warning: it ends the barrier in every
        process, and whoever can reach this process's socket can ask it."""
        self.check_task(task, "CancelBarrier")
        name = self._key(f"barrier/{barrier_id}/{counter}")
        log.warning("JAX barrier %r (use %d) cancelled for every participant, as asked on process %d's coordination "
                    "socket", barrier_id, counter, self.task)
        if not self._call(lambda t: self.client.cancel_barrier(name, timeout=t), None):
            raise CoordinationError(FAILED_PRECONDITION, f"barrier {barrier_id!r} has completed, failed or been "
                                    "cancelled already")

    # Inside.
    def _key(self, name: str) -> str:
        return f"{self.scope}/{name}"

    def _kv(self, key: str, space: str = "kv") -> str:
        """Where JAX's ``key`` lives. Its CPU collectives' rendezvous keys (gloo's) live under the live set last agreed
        (``era``): a replacement never meets the addresses its previous incarnation's collectives published, and
        meets the others' only in collectives they form anew with it."""
        if key.startswith(GLOO_PREFIX) and self.era:
            return self._key(f"{space}/{self.era}/{key}")
        return self._key(f"{space}/{key}")

    def _barrier(self, name: str, tasks: Sequence[int] | None, timeout: float | None, what: str) -> None:
        """One ifrt barrier for the whole wait: its deadline is fixed at the first arrival, and it fails at once
        when a participant fails."""
        self._raise_failure()
        try:
            bound = BARRIER_BOUND_S if timeout is None else max(0.001, timeout)
            self.client.barrier(self._key(name), timeout=bound, process_ids=tasks)
        except BarrierCancelled as e:
            raise CoordinationError(CANCELLED, f"{what} was cancelled: {e}") from None
        except BarrierTimeout as e:
            raise CoordinationError(DEADLINE_EXCEEDED, f"{what} timed out: {e}") from None
        except BarrierFailed as e:
            self._raise_failure()
            raise CoordinationError(INTERNAL, f"{what} failed: {e}") from None
        except IfrtError as e:
            raise _translated(e) from None

    def _call(self, call: Callable[[float], T], timeout: float | None) -> T:
        self._raise_failure()
        try:
            return call(60.0 if timeout is None else max(0.001, timeout))
        except IfrtError as e:
            raise _translated(e) from None

    def _refuse_topology(self, problem: str) -> None:
        """Refuses JAX's topology record, here and (through the start's ``refused`` key) in every process."""
        log.error("%s", problem)
        self.refusal = problem
        self._call(lambda t: self.client.kv_set(self._key("refused"), problem.encode(), allow_overwrite=True,
                                                timeout=t), None)
        raise CoordinationError(INVALID_ARGUMENT, f"ifrt: {problem}")

    def _raise_refusal(self) -> None:
        if self.refusal is None:
            found = self._call(lambda t: self.client.kv_try_get(self._key("refused"), timeout=t), None)
            if found is None:
                return
            self.refusal = found.decode(errors="replace")
        raise CoordinationError(INVALID_ARGUMENT, f"ifrt: {self.refusal}")

    def _raise_failure(self) -> None:
        if self._failed.is_set():
            raise self._failure_error()

    def _failure_error(self) -> CoordinationError:
        assert self.failure is not None
        task = getattr(self.failure, "process_id", None)
        return CoordinationError(UNAVAILABLE, f"ifrt: {self.failure}", task=task)

    def _on_event(self, event: events.Event) -> None:
        status = None
        if isinstance(event, events.ProcessFailed):
            status = TaskStatus(event.process_id, "ERROR", error_code=UNAVAILABLE, error_message=event.reason)
            if self.recoverable and event.process_id != self.task:
                self._peer_failures.append(f"process {event.process_id} failed ({event.reason})")
        elif isinstance(event, events.ProcessLeft):
            status = TaskStatus(event.process_id, "DISCONNECTED")
        elif isinstance(event, events.ProcessRestarted):
            status = TaskStatus(event.process_id, "CONNECTED", incarnation=event.incarnation)
        if status is not None:
            with self._changed:
                self._states[status.task] = status
                self._version += 1
                self._changed.notify_all()
        failure = failfast.failure_for(event, self.topology, recover=self.recoverable)
        if failure is not None and self.failure is None:
            self.failure = failure
            self._failed.set()
            self.wake()


def _translated(error: IfrtError) -> CoordinationError:
    """ifrt's error as XLA's status: its own gRPC code and words."""
    return CoordinationError(error.code.value[0], str(error))
