"""A replace-mode job shrunk to its survivors: the coordinator's decision, pure (no clock, no I/O), journaled by the
router (``ClusterState``) as ``journal.Shrunk`` so that a retry, a second agent and a failover get the same answer.

With ``ifrt run --recover replace`` a survivor's agent waits ``--replace-timeout`` for another host's failed
processes to be replaced, taken over by a spare host, or brought back by their agent (``ifrt.run.waits``). When that
passes, it asks to shrink (``NextAttempt`` with ``shrink``: the ids it gave up on) before it asks for a whole-job
restart. The coordinator shrinks only where the operator opted in (``--min-processes M``) and at least M processes
remain: the ids leave the topology and a new generation over the survivors is published, as ``--on-failure elastic``
publishes; the attempt goes on. Otherwise it refuses, changing nothing, and the agents restart the job as before.

    process declared failed ─(agents wait --replace-timeout)─▶ NextAttempt(shrink=ids)
        ├─(--min-processes M, >= M remain)──▶ journal.Shrunk: a new generation without ids; the attempt goes on
        └─(no --min-processes, or too few remain)──▶ refused: the agents ask for the next attempt (whole restart)

Authority: only the job's agents (their secrets) may ask, never a spare host, and only for processes the coordinator
itself declared failed in this attempt and that no replacement or takeover claims since (``Attempts.declared``);
anything else is PermissionDenied, changing nothing. A shrink never races a replacement: while a named process's own
agent (the one on the host it registered from) still watches the job and its ``--replace-timeout`` has not passed
since the coordinator declared the process failed, the answer is to wait (``Wait``: ask again after the rest of it);
a process a shrink dropped is not replaced later in the attempt (``Attempts``). A shrink restarts nothing, so it
spends no restart budget: it is bounded by the job's size (at most ``num_processes - M`` processes are ever
dropped). A shrunk job does not grow back in this attempt: the dropped ids' processes, should they return, are not
in any later generation of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.core import journal
from coordinator.core.attempts import check_call
from coordinator.core.job_records import Agent, Host, JobView, NextAttempt
from coordinator.core.limits import Limits
from ifrt.errors import InvalidArgument, PermissionDenied


@dataclass(frozen=True)
class ShrinkAnswer:
    """NextAttempt's answer to a shrink: the job's state, why it was refused ("": shrunk, now or before), and how
    long to wait before asking again (0: decided)."""

    view: JobView
    refused: str = ""
    wait_s: float = 0.0


@dataclass(frozen=True)
class AttemptFacts:
    """What a shrink decision reads of the job's attempts (``Attempts.shrink_facts``)."""

    current: int
    settled: bool
    """Whether the call decided already (a retry) or the restarts are exhausted."""
    shrunk: frozenset[int]
    declared: frozenset[int]
    """The processes the coordinator declared failed in this attempt, none replaced since."""
    agents: tuple[Agent, ...]


@dataclass(frozen=True)
class Wait:
    """Not decided yet: a named process's own agent may still replace it for ``seconds``."""

    seconds: float


def decide(call: NextAttempt, attempts: AttemptFacts, in_topology: set[int], *, allowed: bool, min_processes: int,
           num_processes: int, limits: Limits, where_of: Callable[[int], Host | None] = lambda pid: None,
           waited: Callable[[int], float] = lambda pid: math.inf,
           absent: frozenset[str] = frozenset()) -> journal.Shrunk | str | Wait | None:
    """The shrink ``call`` asks for, to journal; a refusal (why, changing nothing); a Wait while a named process's
    own agent may still replace it (``where_of``: where a process registered from, ``waited``: seconds since it was
    declared failed, ``absent``: agents gone); or None when it changes nothing (a retry, ids a shrink dropped
    already, an attempt that ended, restarts exhausted): the caller gets the job's state. InvalidArgument or
    PermissionDenied, changing nothing, for malformed ids or ids the coordinator did not declare failed."""
    check_call(call, limits)
    ids = call.shrink
    if len(ids) > num_processes or len(set(ids)) != len(ids) or any(not 0 <= pid < num_processes for pid in ids):
        raise InvalidArgument(f"shrink names process ids {list(ids[:8])}{' ...' if len(ids) > 8 else ''}: expected "
                              f"distinct process ids of the job (0 to {num_processes - 1}), at most {num_processes}")
    if call.ended_attempt > attempts.current:
        raise InvalidArgument(f"ended_attempt {call.ended_attempt} is ahead of the job's current attempt "
                              f"{attempts.current}: expected the attempt the agent's workers run")
    if attempts.settled or call.ended_attempt < attempts.current:
        return None
    rest = [pid for pid in ids if pid not in attempts.shrunk]
    if not rest:
        return None  # dropped already: a second agent that gave up on the same processes is answered the same
    undeclared = [pid for pid in rest if pid not in attempts.declared]
    if undeclared:
        raise PermissionDenied(f"process {undeclared[0]} is not a failure the coordinator declared in attempt "
                               f"{attempts.current} and that nothing replaces: a shrink drops only such processes")
    wait = max((_replace_time_left(pid, attempts, where_of, waited, absent) for pid in rest), default=0.0)
    if wait > 0:
        return Wait(wait)
    if not allowed:
        return ("the coordinator runs without --min-processes: this job does not shrink (start the coordinator with "
                "--min-processes M to let the survivors go on without failed processes)")
    remain = len(in_topology - set(rest))
    if remain < min_processes:
        return (f"only {remain} processes would remain without processes {', '.join(map(str, sorted(rest)))}, fewer "
                f"than --min-processes {min_processes}")
    return journal.Shrunk(attempts.current, tuple(sorted(rest)), call.request_id)


def _replace_time_left(pid: int, attempts: AttemptFacts, where_of: Callable[[int], Host | None],
                       waited: Callable[[int], float], absent: frozenset[str]) -> float:
    """How long ``pid``'s own agent (on the host it registered from, watching still) may yet replace it: the rest of
    its --replace-timeout since the coordinator declared ``pid`` failed; 0 when none may."""
    where = where_of(pid)
    own = [a for a in attempts.agents if where is not None and a.where == where and not a.spare
           and a.uid not in absent]
    return max((a.replace_timeout_s - waited(pid) for a in own), default=0.0)
