"""What the state machine hands the shell: the answers of a registration and the effects to carry out. Plain values."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.core.agreement import LeftOut, LiveSetResolved
from coordinator.core.barriers import BarrierResolved
from coordinator.core.job_records import AttemptProcessFailed, AttemptsExhausted, AttemptStarted
from coordinator.core.preemption import PreemptionResolved
from coordinator.core.registration import Registration
from ifrt.events import PreemptionNotice, ProcessFailed, ProcessLeft, ProcessRestarted
from ifrt.records import TopologyContent


@dataclass(frozen=True)
class Admitted:
    """A new registration was admitted (for the log): how many are in, and the missing explicit ids when few."""

    registration: Registration
    registered: int
    expected: int
    missing_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class FirstPublication:
    """Generation 1 was published by this registration: every waiting Register call can be answered."""

    topology: TopologyContent
    number: int
    """The job event number of its publication."""
    waited_s: float
    """From the first registration to the publication."""


# The answer of a registration. What led to it (an admission, the first publication) rides along for the shell,
# outside equality: two equal answers say the same to their caller.
@dataclass(frozen=True)
class Waiting:
    """Admitted; the topology is not complete yet."""

    registered: int
    expected: int
    admitted: Admitted | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Published:
    """The topology is complete; ``process_id`` is the caller's."""

    process_id: int
    topology: TopologyContent
    admitted: Admitted | None = field(default=None, compare=False)
    first: FirstPublication | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Notify:
    """Effect: tell every live session about ``event``, job event number ``number``."""

    event: ProcessFailed | ProcessRestarted | ProcessLeft | PreemptionNotice
    number: int = 0


@dataclass(frozen=True)
class Republish:
    """Effect: a new generation; send it to every live session."""

    topology: TopologyContent
    number: int = 0
    """The job event number of its publication."""


@dataclass(frozen=True)
class Evict:
    """Effect: close this client's session, telling it why."""

    client_uid: str
    reason: str


@dataclass(frozen=True)
class Forgotten:
    """Effect (for the log): a registration dropped before publication."""

    who: str
    reason: str


@dataclass(frozen=True)
class KeyChanged:
    """Effect: ``key`` now holds ``value`` (None: deleted); tell the sessions that watch a prefix of it."""

    key: str
    value: bytes | None


# The job's runs (coordinator.core.runs).
@dataclass(frozen=True)
class RunStarted:
    """Effect: run ``run`` started (``ended`` was over); the shell ends what waited in the old one."""

    ended: int
    run: int


@dataclass(frozen=True)
class RunEnded:
    """Effect: every process of run ``run`` left or failed; registrations waiting for the next run may start it."""

    run: int


@dataclass(frozen=True)
class SuspectSelf:
    """Effect: most of the job went silent at once; this leader takes it as its own partition first. Nothing was
    journaled on that evidence: the shell steps aside (releases leadership, and campaigns again only after
    ``for_s``), so that a replica the processes reach takes over and judges them itself."""

    why: str
    for_s: float


@dataclass(frozen=True)
class WaitingForNextRun:
    """A registration's answer: its id's process left the running ``run`` (or the run is finishing, a process of it
    having left), so it waits for the next run; ``still_live`` names the run's processes still live."""

    run: int
    expected: int
    still_live: tuple[str, ...]
    live: int

    def describe(self) -> str:
        """``waiting for run 2 of the job to end (...): 2 of its processes are still live: 1 (h1 (10.0.0.2)), 3``."""
        more = self.live - len(self.still_live)
        named = ", ".join(self.still_live) + (f" and {more} more" if more > 0 else "")
        return (f"waiting for run {self.run} of the job to end (a process of it left: this one joins the next run): "
                f"{self.live} of its processes {'is' if self.live == 1 else 'are'} still live: {named}")


@dataclass(frozen=True)
class WaitingForHolder:
    """A registration's answer: its id's process was answered with the topology and has not attached its session
    yet, so it is neither a second launch to refuse nor a crash to take over: the call waits (nothing is admitted)
    until that process attaches (then ProcessIdTaken) or is declared failed (then a restart takes its id)."""

    process: str
    answered_s: float

    def describe(self) -> str:
        return (f"waiting for process {self.process}, answered {self.answered_s:.1f}s ago, to attach its session "
                "(then this registration is refused: ProcessIdTaken) or to be declared failed (then it takes its id)")


Effect = (Notify | Republish | Evict | Forgotten | BarrierResolved | KeyChanged | LiveSetResolved | LeftOut
          | PreemptionResolved | AttemptStarted | AttemptsExhausted | AttemptProcessFailed | RunStarted | RunEnded
          | SuspectSelf)
