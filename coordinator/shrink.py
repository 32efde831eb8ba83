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

Authority: only the job's agents (their secrets) may ask, and only for processes the coordinator itself declared
failed in this attempt and that no replacement or takeover claims since (``Attempts.declared``); anything else is
PermissionDenied, changing nothing. A shrink restarts nothing, so it spends no restart budget: it is bounded by the
job's size (at most ``num_processes - M`` processes are ever dropped). A shrunk job does not grow back in this
attempt: the dropped ids' processes, should they return, are not in any later generation of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator import journal
from coordinator.attempts import Attempts, check_call
from coordinator.job_records import JobView, NextAttempt
from coordinator.limits import Limits
from ifrt.errors import InvalidArgument, PermissionDenied


@dataclass(frozen=True)
class ShrinkAnswer:
    """NextAttempt's answer to a shrink: the job's state, and why it was refused ("": shrunk, now or before)."""

    view: JobView
    refused: str = ""


def decide(call: NextAttempt, attempts: Attempts, in_topology: set[int], *, allowed: bool, min_processes: int,
           num_processes: int, limits: Limits) -> journal.Shrunk | str | None:
    """The shrink ``call`` asks for, to journal; a refusal (why, changing nothing); or None when it changes nothing
    (a retry, ids a shrink dropped already, an attempt that ended, restarts exhausted): the caller gets the job's
    state. InvalidArgument or PermissionDenied, changing nothing, for malformed ids or ids the coordinator did not
    declare failed."""
    check_call(call, limits)
    ids = call.shrink
    if len(ids) > num_processes or len(set(ids)) != len(ids) or any(not 0 <= pid < num_processes for pid in ids):
        raise InvalidArgument(f"shrink names process ids {list(ids[:8])}{' ...' if len(ids) > 8 else ''}: expected "
                              f"distinct process ids of the job (0 to {num_processes - 1}), at most {num_processes}")
    if call.ended_attempt > attempts.current:
        raise InvalidArgument(f"ended_attempt {call.ended_attempt} is ahead of the job's current attempt "
                              f"{attempts.current}: expected the attempt the agent's workers run")
    if attempts.decided(call.request_id) or call.ended_attempt < attempts.current or attempts.exhausted:
        return None
    rest = [pid for pid in ids if pid not in attempts.shrunk]
    if not rest:
        return None  # dropped already: a second agent that gave up on the same processes is answered the same
    declared = attempts.declared
    undeclared = [pid for pid in rest if pid not in declared]
    if undeclared:
        raise PermissionDenied(f"process {undeclared[0]} is not a failure the coordinator declared in attempt "
                               f"{attempts.current} and that nothing replaces: a shrink drops only such processes")
    if not allowed:
        return ("the coordinator runs without --min-processes: this job does not shrink (start the coordinator with "
                "--min-processes M to let the survivors go on without failed processes)")
    remain = len(in_topology - set(rest))
    if remain < min_processes:
        return (f"only {remain} processes would remain without processes {', '.join(map(str, sorted(rest)))}, fewer "
                f"than --min-processes {min_processes}")
    return journal.Shrunk(attempts.current, tuple(sorted(rest)), call.request_id)
