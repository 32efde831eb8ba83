"""XLA's coordination protocol as each supported jaxlib speaks it: the gRPC service, its methods, their messages.

Three layouts share two service names (the full list in docs/jax.md):

- ``/tensorflow.CoordinationService/*``: jaxlib 0.4.30 (15 methods) and up to 0.4.38 (17: adds ``PollForError``,
  ``GetAliveTasks`` and barrier counters). One message set serves both, the last form of the file (19 methods):
  each jaxlib's messages are a subset of it, field by field.
- ``/xla.coordination.CoordinationService/*``: jaxlib 0.10 (14 methods, tasks as plain ids, an ``Incarnations``
  message on every request, fields renumbered).

The stand-in serves both names, so the layout is the one the client's own calls name; a message is never decoded
under another layout's numbers. Each method maps its request onto ``CoordinationStandIn`` and its answer back.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from ifrt._generated import tensorflow_coordination_pb2 as tf_pb
from ifrt._generated import xla_coordination_pb2 as xla_pb
from ifrt.jax.xla_standin.service import (
    FAILED_PRECONDITION,
    NOT_FOUND,
    UNIMPLEMENTED,
    CoordinationError,
    CoordinationStandIn,
    TaskStatus,
)

PAYLOAD_KEY = "type.googleapis.com/tensorflow.CoordinationServiceError"
"""Where XLA looks for the task an error is about, in the error's payloads (both layouts use this name)."""

Handler = Callable[[CoordinationStandIn, Any, "float | None"], Any]
"""An RPC's answer: (the stand-in, the decoded request, the call's time left or None) -> the response message."""



def _not_served(rpc: str, why: str) -> CoordinationError:
    return CoordinationError(UNIMPLEMENTED, f"{rpc}: ifrt's stand-in does not serve it ({why})")


class Layout:
    """One wire layout: its gRPC service name, its messages, and each of its RPCs as a method of the same name that
    maps the request onto ``CoordinationStandIn`` and the answer back. What both layouts ask alike is answered here
    once; a layout says how it spells a task (``task_of``, ``tasks_of``, ``task_message``, ``state``) and its
    incarnation (``INCARNATION``)."""

    name: str
    service: str
    messages: ModuleType
    RPCS: tuple[str, ...]
    INCARNATION: str
    """The field that carries the service incarnation in RegisterTask's and Heartbeat's answers."""

    @property
    def methods(self) -> dict[str, tuple[type, Handler]]:
        """Each RPC's request class and answer."""
        return {rpc: (getattr(self.messages, f"{rpc}Request"), self._answer(rpc)) for rpc in self.RPCS}

    def error_payload(self, task: int) -> bytes:
        """The serialized CoordinationServiceError naming ``task``, in this layout."""
        raise NotImplementedError

    def task_of(self, request: Any, field: str = "source_task") -> int:
        raise NotImplementedError

    def tasks_of(self, request: Any) -> list[int]:
        raise NotImplementedError

    def task_message(self, task: int) -> Any:
        raise NotImplementedError

    def state(self, status: TaskStatus) -> Any:
        raise NotImplementedError

    def check(self, standin: CoordinationStandIn, request: Any) -> None:
        """Refuses a request this layout's rules say is not for this start (nothing to check by default)."""

    def _answer(self, rpc: str) -> Handler:
        answer = getattr(self, rpc)

        def checked(standin: CoordinationStandIn, request: Any, timeout: float | None) -> Any:
            self.check(standin, request)
            return answer(standin, request, timeout)
        return checked

    # What both layouts ask alike.
    def RegisterTask(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        return self.messages.RegisterTaskResponse(**{self.INCARNATION: s.register(self.task_of(r), r.incarnation, t)})

    def Heartbeat(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        return self.messages.HeartbeatResponse(**{self.INCARNATION: s.heartbeat(self.task_of(r))})

    def ShutdownTask(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        s.shutdown(self.task_of(r), t)
        return self.messages.ShutdownTaskResponse()

    def InsertKeyValue(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        s.insert(r.kv.key, r.kv.value, r.allow_overwrite, t)
        return self.messages.InsertKeyValueResponse()

    def GetKeyValue(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        return self.messages.GetKeyValueResponse(kv={"key": r.key, "value": s.get(r.key, t)})

    def TryGetKeyValue(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        value = s.try_get(r.key)
        if value is None:
            raise CoordinationError(NOT_FOUND, f"key {r.key!r} is not set")
        return self.messages.TryGetKeyValueResponse(kv={"key": r.key, "value": value})

    def IncrementKeyValue(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        total = s.increment(r.key, r.increment)
        return self.messages.IncrementKeyValueResponse(kv={"key": r.key, "value": str(total).encode()})

    def GetKeyValueDir(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        return self.messages.GetKeyValueDirResponse(directory_key=r.directory_key, kv=[
            {"key": key, "value": value} for key, value in s.get_dir(r.directory_key)])

    def DeleteKeyValue(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        s.delete(r.key, r.is_directory)
        return self.messages.DeleteKeyValueResponse()

    def Barrier(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        mine = r.barrier_timeout_in_ms / 1000 if r.barrier_timeout_in_ms > 0 else None
        timeout = min((x for x in (mine, t) if x is not None), default=None)
        return self.messages.BarrierResponse(counter=s.barrier(self.task_of(r), r.barrier_id, r.counter,
                                                               self.tasks_of(r), timeout))

    def CancelBarrier(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        s.cancel_barrier(self.task_of(r), r.barrier_id, r.counter)
        return self.messages.CancelBarrierResponse()

    def GetAliveTasks(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        alive = s.alive_tasks(self.task_of(r, "requesting_task"), self.tasks_of(r), t)
        return self.alive_response(alive)

    def alive_response(self, alive: list[tuple[int, int]]) -> Any:
        raise NotImplementedError

    def PollForError(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        s.poll_for_error(self.task_of(r))


class TensorflowLayout(Layout):
    """``/tensorflow.CoordinationService/*`` (jaxlib 0.4.x): tasks as (job name, task id) messages."""

    name, service, messages = "tensorflow", "tensorflow.CoordinationService", tf_pb
    RPCS = ("RegisterTask", "Heartbeat", "WaitForAllTasks", "ShutdownTask", "ResetTask", "ReportErrorToTask",
            "ReportErrorToService", "GetTaskState", "WatchJobState", "InsertKeyValue", "GetKeyValue",
            "TryGetKeyValue", "IncrementKeyValue", "GetKeyValueDir", "DeleteKeyValue", "Barrier", "CancelBarrier",
            "GetAliveTasks", "PollForError")
    INCARNATION = "leader_incarnation"

    def error_payload(self, task: int) -> bytes:
        return tf_pb.CoordinationServiceError(is_reported_error=True,
                                              source_task=self.task_message(task)).SerializeToString()

    def task_of(self, request: Any, field: str = "source_task") -> int:
        return getattr(request, field).task_id

    def tasks_of(self, request: Any) -> list[int]:
        return [task.task_id for task in request.tasks]

    def task_message(self, task: int) -> Any:
        return tf_pb.CoordinatedTask(job_name="jax_worker", task_id=task)

    def state(self, status: TaskStatus) -> Any:
        return tf_pb.CoordinatedTaskStateInfo(
            task=self.task_message(status.task), state=tf_pb.CoordinatedTaskState.Value(f"TASKSTATE_{status.state}"),
            error_code=status.error_code, error_message=status.error_message, incarnation=status.incarnation)

    def alive_response(self, alive: list[tuple[int, int]]) -> Any:
        return tf_pb.GetAliveTasksResponse(alive_tasks=[self.task_message(task) for task, _ in alive],
                                           incarnations=[incarnation for _, incarnation in alive])

    def WaitForAllTasks(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        s.barrier(self.task_of(r), "WaitForAllTasks", 0, (), t)
        return tf_pb.WaitForAllTasksResponse(leader_incarnation=s.incarnation)

    def ReportErrorToService(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        s.report_error(r.error_origin.task_id, r.error_code, r.error_message)
        return tf_pb.ReportErrorToServiceResponse()

    def GetTaskState(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        return tf_pb.GetTaskStateResponse(task_state=[
            self.state(status) for status in s.task_states([task.task_id for task in r.source_task])])

    def WatchJobState(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        version, states = s.watch(r.version_number, t)
        return tf_pb.WatchJobStateResponse(version_number=version, task_state=[self.state(x) for x in states])

    def ResetTask(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        raise _not_served("ResetTask", "a process that ends is restarted by `ifrt run` as the job's next attempt, "
                          "with a stand-in of its own")

    def ReportErrorToTask(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        raise _not_served("ReportErrorToTask", "a service sends it to a task's agent, never the other way")


class XlaLayout(Layout):
    """``/xla.coordination.CoordinationService/*`` (jaxlib 0.10): tasks as ids, and every request after the
    registration carries the incarnations of its task and of the service."""

    name, service, messages = "xla", "xla.coordination.CoordinationService", xla_pb
    RPCS = ("RegisterTask", "Heartbeat", "ShutdownTask", "WatchTasks", "InsertKeyValue", "GetKeyValue",
            "TryGetKeyValue", "IncrementKeyValue", "GetKeyValueDir", "DeleteKeyValue", "Barrier", "CancelBarrier",
            "GetAliveTasks", "PollForError")
    INCARNATION = "service_incarnation"

    def error_payload(self, task: int) -> bytes:
        return xla_pb.CoordinationServiceError(is_reported_error=True, source_task_id=task).SerializeToString()

    def task_of(self, request: Any, field: str = "source_task") -> int:
        return getattr(request, f"{field}_id")

    def tasks_of(self, request: Any) -> list[int]:
        return list(request.task_ids)

    def task_message(self, task: int) -> Any:
        return task

    def state(self, status: TaskStatus) -> Any:
        return xla_pb.TaskInfo(task_id=status.task, state=xla_pb.TaskState.Value(status.state),
                               error_code=status.error_code, error_message=status.error_message,
                               incarnation=status.incarnation)

    def alive_response(self, alive: list[tuple[int, int]]) -> Any:
        return xla_pb.GetAliveTasksResponse(alive_task_ids=[task for task, _ in alive],
                                            incarnations=[incarnation for _, incarnation in alive])

    def check(self, standin: CoordinationStandIn, request: Any) -> None:
        """XLA's incarnation check, as strict as XLA's own service: a request for another service incarnation
        (another start of the job), or for none (0: JAX's client names the one RegisterTask answered on every later
        call), is refused."""
        if "incarnations" not in request.DESCRIPTOR.fields_by_name:  # RegisterTask: the incarnations come after it
            return
        theirs = request.incarnations.service_incarnation
        if not theirs:
            raise CoordinationError(FAILED_PRECONDITION, f"the request names no service incarnation (0); this start's "
                                    f"is {standin.incarnation:#x}, as RegisterTask answered: JAX's client names it on "
                                    "every call after registering")
        if theirs != standin.incarnation:
            raise CoordinationError(FAILED_PRECONDITION, f"service incarnation {theirs:#x} is not this start's "
                                    f"({standin.incarnation:#x}): the request belongs to another start of the job")

    def WatchTasks(self, s: CoordinationStandIn, r: Any, t: float | None) -> Any:
        version, states = s.watch(r.version_number, t)
        return xla_pb.WatchTasksResponse(version_number=version, task_state=[self.state(x) for x in states])


TENSORFLOW = TensorflowLayout()
XLA = XlaLayout()
LAYOUTS = (TENSORFLOW, XLA)
"""Every layout the stand-in serves, each under its own service name."""
SUPPORTED = "jaxlib 0.4.30 to 0.4.38 and 0.10.x"
"""The jaxlib versions whose layouts these are (each checked against its embedded descriptors by the suite)."""


def supports(jaxlib_version: str) -> bool:
    """Whether a jaxlib of this version speaks one of these layouts (``SUPPORTED``)."""
    try:
        release = tuple(int(part) for part in jaxlib_version.split("+")[0].split(".")[:3])
    except ValueError:
        return False
    return (0, 4, 30) <= release <= (0, 4, 38) or release[:2] == (0, 10)
