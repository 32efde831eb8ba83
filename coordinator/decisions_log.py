"""What the coordinator logs of its decisions: one line per admission and per job event, with the fields
``--log-format json`` carries (event, process id, host). Callers' text in the message is escaped (``ifrt.safe_text``),
so a hostname or reason cannot start a line of its own or a terminal escape, whatever handler prints it."""

from __future__ import annotations

import logging

from coordinator.core.effects import Admitted
from coordinator.core.state import ClusterState
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.safe_text import safe

log = logging.getLogger("ifrt.coordinator")


def log_admitted(admitted: Admitted) -> None:
    """``registered process 3 on h3 (10.0.0.3) with 8 devices: 3/4 registered, waiting for process 1``."""
    if not log.isEnabledFor(logging.INFO):
        return
    r = admitted.registration
    who = f"process {r.process_id}" if r.process_id is not None else "a process"
    missing = admitted.expected - admitted.registered
    if not missing:
        waiting = "complete"
    elif ids := admitted.missing_ids:
        waiting = f"waiting for process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
    else:
        waiting = f"waiting for {missing} more"
    log.info("registered %s on %s with %d devices: %d/%d registered, %s", who, safe(r.describe()), len(r.devices),
             admitted.registered, admitted.expected, waiting,
             extra={"event": "registered", "process_id": r.process_id, "host": r.hostname,
                    "host_address": r.host_address})


def log_event(event: ProcessFailed | ProcessRestarted | ProcessLeft | PreemptionNotice, state: ClusterState) -> None:
    """One line for a job event, naming the process and its host."""
    who = safe(state.describe_process(event.process_id))
    match event:
        case ProcessFailed(process_id=pid, reason=reason):
            log.warning("process %s failed: %s", who, safe(reason),
                        extra=_about(state, pid, "process_failed", reason=reason))
        case ProcessRestarted(process_id=pid, incarnation=incarnation):
            log.info("process %s restarted (incarnation %d)", who, incarnation,
                     extra=_about(state, pid, "process_restarted", incarnation=incarnation))
        case PreemptionNotice(process_id=pid):
            log.warning("process %s will be preempted: every process is told", who,
                        extra=_about(state, pid, "preemption_notice"))
        case ProcessLeft(process_id=pid):
            log.info("process %s left", who, extra=_about(state, pid, "process_left"))


def _about(state: ClusterState, process_id: int, event: str, **fields: object) -> dict[str, object]:
    """``extra`` for a log line about one process: the event, its id and host (for --log-format json)."""
    r = state.registration_of(process_id)
    where = {"host": r.hostname, "host_address": r.host_address} if r is not None else {}
    return {"event": event, "process_id": process_id, **where, **fields}
